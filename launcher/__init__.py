"""The stage launcher: a fork server ("zygote") that imports torch, diffusers, transformers and
the stage modules once, then forks every process `stagemesh serve` asks it for.

Why: importing a stage costs ~6.5 s of CPU (torch, diffusers and transformers, and the
pipelines our modules pull in). The default mesh starts 17 stage processes plus a `model
prepare` child, so on two cores that was most of serve's minute of start-up. A forked child
shares the launcher's modules copy-on-write and only loads its model.

Run as `python -m stagemesh.launcher --fd N` by serve, never by hand. The requests come over
that file descriptor, a SOCK_SEQPACKET socket (one JSON object per packet, never pickle), not
over stdin/stdout: a child inherits the launcher's stdio, which is serve's, so a stage's output
lands where it did when serve spawned it.

    serve -> launcher   {"id": 7, "argv": ["stage", "dit", ...], "env": {...}}
                        (one file descriptor may ride along: the child's stdout)
    launcher -> serve   {"id": 7, "pid": 1234}          the child runs `stagemesh ARGV`
                        {"id": 7, "error": "..."}       nothing forked (bad request, unsafe)
                        {"pid": 1234, "returncode": 0}  a child exited (-N: killed by signal N)

Fork safety: the launcher starts no thread, gRPC channel or server, or OpenMP region, and
checks before each fork that it runs a single thread; if not, it refuses, and serve spawns
`python -m stagemesh ...` instead. Lifetime: the launcher dies with serve, each child with the
launcher (PR_SET_PDEATHSIG, see `stagemesh.shared.process.die_with_parent`); it exits when
serve closes the socket. Linux only; `STAGEMESH_STAGE_LAUNCHER=spawn` turns it off.

The modules: `protocol` (the messages, both ends), `server` (the launcher process) and
`client` (serve's end, exported here).
"""

from stagemesh.launcher.client import (
    LAUNCHER_ENV,
    ChildProcess,
    ForkedChild,
    Launcher,
    LauncherUnavailable,
    StartMode,
    exited,
    stagemesh_command,
    start_mode,
    start_stagemesh,
)

__all__ = ["LAUNCHER_ENV", "ChildProcess", "ForkedChild", "Launcher", "LauncherUnavailable",
           "StartMode", "exited", "stagemesh_command", "start_mode", "start_stagemesh"]
