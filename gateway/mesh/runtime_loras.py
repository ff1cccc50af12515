"""The adapters this gateway loaded at run time, put back on a DiT replica that comes back.

A DiT keeps runtime loads in memory only, so a replica that restarts (or a new one behind a
`dns:///` target) starts with the adapters of its `lora_dir` alone. The gateway remembers
every load it fanned out, per DiT stage address (name -> path, as the admin gave them; an
unload forgets it), and the balancer awaits `restore` before it marks a replica that was not
serving SERVING again (balancer.ReplicaSet.on_back): the replica gets each remembered adapter
through the same LoadLoraAdapter RPC, which is a no-op for a name it already serves from the
same file, before it takes a request that names one. Then the stage's Describe is read again.

A replica that cannot be reached for the load stays out of routing and the next poll tries
again; one that refuses an adapter (its file is gone, or the name now names another file of
its `lora_dir`) serves without it, logged, and a request that names it there is a 400 naming
`lora` (core.GatewayCore re-reads the facts). Loads, unloads and restores take one lock, so a
restore never puts back an adapter an unload is taking away.

What is remembered is this gateway's own: with several gateways each puts back what it loaded
(the RPC is idempotent), and a gateway that restarts forgets (load again, or put the adapter in
`lora_dir`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from stagemesh.gateway.mesh.balancer import Replica
from stagemesh.gateway.mesh.stubs import dit_stub
from stagemesh.shared.proto.v1 import dit_service_pb2 as pb

if TYPE_CHECKING:
    from stagemesh.gateway.mesh.stages import StageCatalog

log = logging.getLogger(__name__)

#: A load reads the adapter's file once on the stage: room for a large one.
UPDATE_TIMEOUT_S = 120.0
#: A replica answering these is not up yet: it stays out of routing until a later poll.
NOT_UP = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class RuntimeLoras:
    """What was loaded at run time on each DiT stage address, and its restore."""

    def __init__(self, catalog: StageCatalog) -> None:
        self.catalog = catalog
        #: DiT stage address -> adapter name -> the lora_path it was loaded from, in load order.
        self.loaded: dict[str, dict[str, str]] = {}
        #: Held by a load or unload fan-out and by a restore: one change at a time.
        self.lock = asyncio.Lock()

    def remember(self, address: str, name: str, path: str) -> None:
        self.loaded.setdefault(address, {})[name] = path

    def forget(self, address: str, name: str) -> None:
        self.loaded.get(address, {}).pop(name, None)

    async def restore(self, address: str, replica: Replica) -> None:
        """Load what was loaded at run time on `address` onto `replica` (about to serve again);
        grpc.aio.AioRpcError when it cannot be reached, which keeps it out of routing."""
        if not self.loaded.get(address):
            return  # nothing to wait for: most stages, and every DiT before a runtime load
        async with self.lock:
            wanted = list(self.loaded.get(address, {}).items())
            stub, added = dit_stub(replica.channel), []
            for name, path in wanted:
                request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
                try:
                    answer = await stub.LoadLoraAdapter(request, timeout=UPDATE_TIMEOUT_S)
                except grpc.aio.AioRpcError as failed:
                    if failed.code() in NOT_UP:
                        raise
                    log.warning("LoRA %s could not be loaded again on dit replica %s: %s",
                                name, replica.address, failed.details())
                    continue
                if answer.added:
                    added.append(name)
        if added:
            log.info("LoRA %s loaded again on dit replica %s (it serves again)",
                     ", ".join(added), replica.address)
            self.catalog.drop(address)
