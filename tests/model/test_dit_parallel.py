"""A DiT group (services/dit/parallel.py) computes what one device computes.

One module-scoped CFG-parallel group of 2 CPU ranks (parallel_cfg 2, 1 thread each): rank 0 is
this process, rank 1 a worker process. Mixed batches (prompts of different lengths, guided and
unguided rows, different steps and seeds) and a lone unguided request (the unconditional half
has no rows) must match one device within 1e-5, and a whole-batch cancel stops every rank at
the same block. Ulysses alone: tests/model/test_dit_wan_parallel.py; both at once, over gRPC:
tests/integration/test_dit_group.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from diffusers import __version__ as diffusers_version
from diffusers.models._modeling_parallel import ContextParallelConfig

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.services.dit.parallel import (
    Degrees,
    QwenImageFamily,
    running_group,
    start_group,
)
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
from stagemesh.services.tokenizer.qwen_image_adapter import PromptEncoderAdapter
from stagemesh.shared.engine import (
    EngineRequest,
    StepInterrupt,
    StepInterrupted,
)
from tests.model import test_dit_batching as batching
from tests.model.test_dit_batching import TOLERANCE, Job, _continuous, _embed, _solo

SIZE = 64
DEGREES = Degrees(cfg=2)


#: The tiny Qwen-Image folder and its prompt encoder, as the batching tests build them.
model_dir = batching.model_dir
encoder = batching.encoder


@pytest.fixture(scope="module")
def one_device(model_dir: Path) -> DenoiseAdapter:
    return DenoiseAdapter(model_dir)


@pytest.fixture(scope="module")
def group(model_dir: Path) -> Iterator[DenoiseAdapter]:
    adapter = DenoiseAdapter(model_dir)
    with running_group(QwenImageFamily(adapter.transformer), model_dir, DEGREES) as adapter.group:
        yield adapter


def test_diffusers_context_parallel_is_the_one_set_up_by_hand() -> None:
    """The group sets diffusers' ParallelConfig up itself (enable_parallelism needs an
    accelerator): pinned to the diffusers version whose source was read."""
    assert diffusers_version.startswith("0.42.")
    assert ContextParallelConfig(ulysses_degree=2).mesh_dim_names == ("ring", "ulysses")


def test_group_equals_one_device(encoder: PromptEncoderAdapter, one_device: DenoiseAdapter,
                                 group: DenoiseAdapter) -> None:
    short = _embed(encoder, "a cat", "")
    long = _embed(encoder, "a large blue square above a small red circle", "dark")
    plain = _embed(encoder, "a green triangle", None)

    def job(name: str, emb: PromptEmbeddings, seed: int, *, arrives: int = 0, steps: int = 3,
            cfg: float = 4.0) -> Job:
        return Job(name, DenoiseInput(emb, SIZE, SIZE, steps, cfg, seed), arrives)

    jobs = [
        job("guided-short", short, 1),
        job("guided-long", long, 11, steps=4),
        job("unguided", plain, 3, arrives=1, steps=2),
        job("cfg-off", long, 5, arrives=2, cfg=1.0),
    ]
    batched = _continuous(group, jobs)
    for j in jobs:
        want = _solo(one_device, j)
        assert (batched[j.name] - want).abs().max().item() <= TOLERANCE, j.name
    # a lone unguided request: the unconditional half of the group has no rows at all
    lone = job("lone-unguided", plain, 8, steps=2)
    got = _solo(group, lone)
    assert (got - _solo(one_device, lone)).abs().max().item() <= TOLERANCE


def test_a_worker_that_cannot_load_fails_the_start_at_once(
        one_device: DenoiseAdapter, tmp_path: Path) -> None:
    family = QwenImageFamily(one_device.transformer)  # no worker joins: it stays unsharded
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] ended before the group started"):
        start_group(family, tmp_path / "no-model", {"parallel_cfg": 2}, DEGREES)
    assert time.monotonic() - started < 60  # not a collective's timeout


def test_interrupt_stops_every_rank_then_the_group_serves_on(
        encoder: PromptEncoderAdapter, one_device: DenoiseAdapter,
        group: DenoiseAdapter) -> None:
    emb = _embed(encoder, "a cat", "")
    payload = DenoiseInput(emb, SIZE, SIZE, 2, 4.0, 4)
    interrupt = StepInterrupt()
    group.bind_interrupt(interrupt)
    state = group.prepare(EngineRequest(request_id="r", payload=payload))
    interrupt.arm(["r"])
    interrupt.cancel("r")  # cancelled before the first block: every rank stops there
    with pytest.raises(StepInterrupted):
        group.step([state])
    assert state.step_index == 0
    interrupt.disarm()
    group.release(state)
    # the same ranks run the next forward in step: no collective was left half taken
    got = _solo(group, Job("after", payload))
    assert (got - _solo(one_device, Job("after", payload))).abs().max().item() <= TOLERANCE
