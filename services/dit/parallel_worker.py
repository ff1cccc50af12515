"""A worker rank of a DiT group (`services/dit/parallel.py`): started by rank 0 as
`stagemesh dit-group-worker <builder> <source> <options as JSON>` (forked from a stage launcher,
or spawned; `python -m stagemesh.services.dit.parallel_worker ...` runs the same), it
builds the same transformers as rank 0 on its own device (`parallel.GroupDevices`) with the
builder, a `module:function` taking (source, options) (`parallel.STAGE_BUILDER`: the stage's
model folder; `stagemesh bench gpu`: a seeded real-size model), joins the group and runs its
share of every forward until rank 0 stops it. It dies with rank 0 (PR_SET_PDEATHSIG); anything
it raises ends it with status 1, which rank 0 sees as a group fault."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys

from stagemesh.shared.process import die_with_parent, stage_threads, stay_offline

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    stay_offline()
    die_with_parent()
    import torch
    import torch.distributed as dist

    from stagemesh.services.dit import parallel

    torch.set_num_threads(stage_threads("dit"))
    builder, source, given = argv
    module, _, function = builder.partition(":")
    build: parallel.Builder = getattr(importlib.import_module(module), function)
    rank, world = int(os.environ[parallel.RANK_ENV]), int(os.environ[parallel.WORLD_ENV])
    options, devices = parallel.worker_options(json.loads(given), rank)
    family, degrees = build(source, options)
    parallel.join_group(rank, world, int(os.environ[parallel.PORT_ENV]), devices)
    group = parallel.shard_family(family, degrees, rank, devices)
    log.info("DiT group rank %d of %d serving on %s", rank, world, group.device)
    group.serve()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(sys.argv[1:]))
