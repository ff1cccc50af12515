"""Runtime LoRA updates of the DiT stage (option `runtime_lora_updates`): what the servicer's
LoadLoraAdapter and UnloadLoraAdapter do.

A load makes a file of `lora_dir` a name requests may use. Its path (absolute, or relative to
the directory) is resolved and must stay inside the directory, symlinks included; its header
gives rank and targets, checked against the slots and the transformer; and it is read once,
off the event loop, so that a broken file is refused here rather than failing the first
request that names it. An unload withdraws the name at once: a request submitted after it,
or still queued, is INVALID_ARGUMENT naming `lora` (`LoraCatalog.resolve` in prepare); rows
that hold the adapter (running, preempted, or prepared and waiting for a slot) keep it to
their end, and its slot frees at the first step boundary after the last of them
(`SlotBank.attach`). Describe publishes the names after every change.
"""

from __future__ import annotations

import asyncio
import logging
import re

import grpc

from stagemesh.services.dit.lora import LoraCatalog, find_adapter
from stagemesh.services.dit.lora_slots import SlotBank, read_adapter
from stagemesh.shared.proto.v1 import dit_service_pb2 as pb

logger = logging.getLogger(__name__)

#: A name a runtime load may give: what a URL, a log line and a JSON key carry unescaped.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class LoraRefused(Exception):
    """A load or unload refused: the status, its ErrorInfo reason and the field at fault."""

    def __init__(self, code: grpc.StatusCode, reason: str, field_name: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.field_name, self.message = code, reason, field_name, message


def _bad(field_name: str, message: str) -> LoraRefused:
    return LoraRefused(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", field_name, message)


def updates_off() -> LoraRefused:
    """What a stage without runtime updates answers."""
    return LoraRefused(
        grpc.StatusCode.FAILED_PRECONDITION, "RUNTIME_LORA_UPDATES_OFF", "lora_name",
        "this DiT stage does not load adapters at run time (option runtime_lora_updates)",
    )  # fmt: skip


class LoraUpdates:
    """Loads and unloads on one stage's catalog and slots; `description` is its Describe."""

    def __init__(
        self, catalog: LoraCatalog, bank: SlotBank, description: pb.DescribeDitResponse
    ) -> None:
        assert catalog.config.directory is not None, "runtime updates need lora_dir"
        self.catalog, self.bank, self.description = catalog, bank, description
        self.directory = catalog.config.directory
        self._lock = asyncio.Lock()  # one change at a time: a load awaits its file's read

    @property
    def names(self) -> list[str]:
        return self.catalog.names

    async def load(self, name: str, path: str) -> bool:
        """Publish `path` as `name`; False when `name` names that very file already.
        LoraRefused: a bad name or path, or a name taken by another file."""
        if not NAME_PATTERN.fullmatch(name):
            raise _bad("lora_name", "lora_name: 1 to 128 letters, digits and . _ - "
                                    f"(starting with a letter or digit), got {name!r}")
        if not path:
            raise _bad("lora_path", "lora_path: required")
        async with self._lock:
            try:
                adapter = find_adapter(self.directory, name, path)
                self.catalog.check_rank(adapter)
                self.bank.check_targets(adapter.targets)
            except (OSError, ValueError) as exc:
                raise _bad("lora_path", f"lora_path: {exc}") from None
            known = self.catalog.adapters.get(name)
            if known == adapter:
                return False
            if known is not None:
                raise LoraRefused(
                    grpc.StatusCode.ALREADY_EXISTS, "LORA_NAME_TAKEN", "lora_name",
                    f"lora_name: {name!r} names another adapter; unload it first",
                )  # fmt: skip
            try:  # read once now: a file that cannot load is refused, not a request's failure
                await asyncio.to_thread(read_adapter, adapter, self.bank.files)
            except Exception as exc:  # diffusers' converters raise what they raise
                raise _bad("lora_path", f"lora_path: {exc}") from None
            self.catalog.publish(adapter)
            self._describe()
        logger.info("LoRA %s loaded at run time from %s", name, adapter.path)
        return True

    async def unload(self, name: str) -> None:
        """Withdraw `name` (LoraRefused NOT_FOUND when it names nothing)."""
        async with self._lock:
            if name not in self.catalog.adapters:
                raise LoraRefused(grpc.StatusCode.NOT_FOUND, "LORA_NOT_FOUND", "lora_name",
                                  f"lora_name: this stage serves no adapter {name!r}")
            self.catalog.withdraw(name)
            self._describe()
        logger.info("LoRA %s unloaded (its slot frees once no row holds it)", name)

    def _describe(self) -> None:
        del self.description.lora_names[:]
        self.description.lora_names.extend(self.catalog.names)
