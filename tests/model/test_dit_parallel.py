"""A DiT group (services/dit/parallel.py) computes what one device computes: text-to-image and
image edit, under each layout.

Three module-scoped groups in turn, one per layout: `parallel_cfg: 2` (2 ranks),
`parallel_ulysses: 2` (2 ranks) and both (4 ranks); rank 0 is this process, the others worker
processes, 1 thread each. Each group runs over the tiny Qwen-Image-Edit folder and serves two
rank-0 adapters: the edit folder's, and a text-to-image folder over the same transformer files
(the group runs every forward on the transformer it was started with, so one group start serves
both tasks). Mixed batches (prompts of different lengths, guided and unguided rows, different
steps, seeds and condition images, a request joining later) and a lone unguided request (under
CFG-parallel its unconditional half has no rows) must match one device within 1e-5; a cancel
stops every rank at the same block (before the first, or between two), after which the group
serves on. With the step cache on (first_block: the ranks hold the residuals' shards and
all-reduce each decision), a mixed batch decides row by row and step by step as one device
does, with the same latents. The edit adapters serve LoRA (two seeded adapters): rows with
one adapter, two, none, guided and unguided, in one batch, match one device too (rank 0 syncs
its slots to the workers before the forward that needs them). Text-to-video:
tests/model/test_dit_wan_parallel.py; the engine's promises over gRPC:
tests/integration/test_dit_group.py.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from diffusers import __version__ as diffusers_version
from diffusers.models._modeling_parallel import ContextParallelConfig

from stagemesh.launcher import Launcher
from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.services.dit.lora import LoraConfig, LoraUse
from stagemesh.services.dit.parallel import (
    Degrees,
    GroupDevices,
    QwenImageFamily,
    running_group,
    start_group,
    worker_options,
)
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput, DenoiseState
from stagemesh.services.dit.step_cache import StepCacheConfig, StepCacheMethod
from stagemesh.shared.engine import (
    EngineRequest,
    StepInterrupt,
    StepInterrupted,
)
from tests.lora_files import write_adapter
from tests.model import test_dit_edit as edit_tests
from tests.model import test_dit_step_cache as step_cache_tests
from tests.model.test_dit_batching import TOLERANCE, Job, _continuous, _solo
from tests.model.test_dit_edit import HEIGHT, WIDTH, _embeddings
from tests.model.test_dit_step_cache import Triple, _drive

#: The layouts every test runs under (a group start each, about 6 s of CPU per worker).
LAYOUTS = {"cfg2": Degrees(cfg=2), "ulysses2": Degrees(ulysses=2),
           "cfg2-ulysses2": Degrees(cfg=2, ulysses=2)}
TASKS = ("text-to-image", "edit")
#: The condition image's latents: [1, C, 1, 4, 6] (64x96 pixels through the 16x VAE), 6 tokens
#: beside the output's 6: 12 tokens divide among 2 Ulysses ranks.
CONDITION = (1, 1, 4, 6)

#: The tiny edit folder, and a text-to-image folder over its transformer, as the edit tests
#: build them.
edit_dir = edit_tests.edit_dir
text_to_image_dir = edit_tests.text_to_image_dir
#: The step cache's committed decisions, and (autouse) the check that no one-device decision
#: lies within 1% of its threshold, as the step-cache tests have them.
mesh_decisions = step_cache_tests.mesh_decisions
clear_of_the_threshold = step_cache_tests.clear_of_the_threshold


@dataclass(frozen=True)
class Adapters:
    """One adapter per task."""

    text_to_image: DenoiseAdapter
    edit: DenoiseAdapter

    def of(self, task: str) -> DenoiseAdapter:
        return self.edit if task == "edit" else self.text_to_image


@pytest.fixture(scope="module")
def loras(edit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoraConfig:
    """Two seeded adapters of the edit transformer ("ink" rank 4, "wax" rank 2)."""
    root = tmp_path_factory.mktemp("loras")
    transformer = QwenImageTransformer2DModel.from_pretrained(edit_dir, subfolder="transformer")
    for name, rank, seed in (("ink", 4, 1), ("wax", 2, 2)):
        write_adapter(transformer, root, name, rank, seed, alpha=rank * 4)
    return LoraConfig(directory=root.resolve(), max_lora_rank=4)


@pytest.fixture(scope="module")
def one_device(edit_dir: Path, text_to_image_dir: Path, loras: LoraConfig) -> Adapters:
    return Adapters(DenoiseAdapter(text_to_image_dir), DenoiseAdapter(edit_dir, lora=loras))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def group(request: pytest.FixtureRequest, edit_dir: Path, text_to_image_dir: Path,
          loras: LoraConfig, group_launcher: Launcher) -> Iterator[Adapters]:
    # the edit adapter's transformer is the one the group runs: its LoRA slots are rank 0's
    adapters = Adapters(DenoiseAdapter(text_to_image_dir), DenoiseAdapter(edit_dir, lora=loras))
    family = QwenImageFamily(adapters.edit.transformer)
    with running_group(family, edit_dir, LAYOUTS[request.param],
                       launcher=group_launcher) as adapters.edit.group:
        adapters.text_to_image.group = adapters.edit.group
        yield adapters


def test_diffusers_context_parallel_is_the_one_set_up_by_hand() -> None:
    """The group sets diffusers' ParallelConfig up itself (enable_parallelism needs an
    accelerator): pinned to the diffusers version whose source was read."""
    assert diffusers_version.startswith("0.42.")
    assert ContextParallelConfig(ulysses_degree=2).mesh_dim_names == ("ring", "ulysses")


def _condition(adapter: DenoiseAdapter, seed: int) -> tuple[torch.Tensor, ...]:
    channels = adapter.transformer.config["out_channels"]
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(CONDITION[0], channels, *CONDITION[1:], generator=generator),)


def _job(adapter: DenoiseAdapter, task: str, name: str, emb: PromptEmbeddings, seed: int, *,
         arrives: int = 0, steps: int = 3, cfg: float = 4.0,
         lora: tuple[LoraUse, ...] = ()) -> Job:
    condition = _condition(adapter, seed) if task == "edit" else ()
    return Job(name, DenoiseInput(emb, HEIGHT, WIDTH, steps, cfg, seed,
                                  condition_latents=condition, lora=lora), arrives)


@pytest.mark.parametrize("task", TASKS)
def test_group_equals_one_device(task: str, one_device: Adapters, group: Adapters) -> None:
    short = _embeddings(1, 3, 2)
    long = _embeddings(2, 9, 5)
    plain = _embeddings(3, 6, None)
    grouped = group.of(task)
    job = functools.partial(_job, grouped, task)

    jobs = [
        job("guided-short", short, 1),
        job("guided-long", long, 11, steps=4),
        job("unguided", plain, 3, arrives=1, steps=2),
        job("cfg-off", long, 5, arrives=2, cfg=1.0),
    ]
    batched = _continuous(grouped, jobs)
    for j in jobs:
        want = _solo(one_device.of(task), j)
        assert (batched[j.name] - want).abs().max().item() <= TOLERANCE, j.name
    # a lone unguided request: the unconditional half of the group has no rows at all
    lone = job("lone-unguided", plain, 8, steps=2)
    got = _solo(grouped, lone)
    assert (got - _solo(one_device.of(task), lone)).abs().max().item() <= TOLERANCE


def test_rows_with_lora_adapters_equal_one_device(one_device: Adapters, group: Adapters) -> None:
    """Rows with one adapter, two at other scales, none; guided (the unconditional row carries
    the adapters: under CFG-parallel on another rank) and unguided; one joining later."""
    short, long = _embeddings(1, 3, 2), _embeddings(2, 9, 5)
    job = functools.partial(_job, group.edit, "edit")
    ink = (LoraUse("ink", 0.8),)
    jobs = [
        job("ink", short, 1, lora=ink),
        job("ink-and-wax", long, 2, lora=(LoraUse("wax", 1.5), LoraUse("ink", -0.6))),
        job("none", short, 3),
        job("wax-unguided", long, 4, arrives=1, cfg=1.0, lora=(LoraUse("wax", 1.0),)),
    ]
    batched = _continuous(group.edit, jobs)
    for j in jobs:
        want = _solo(one_device.edit, j)
        assert (batched[j.name] - want).abs().max().item() <= TOLERANCE, j.name
    # ... and the adapters are strong enough that a rank running without them would show
    plain = replace(jobs[0], payload=replace(jobs[0].payload, lora=()))
    assert (batched["ink"] - _solo(one_device.edit, plain)).abs().max().item() > 100 * TOLERANCE


def test_a_worker_that_cannot_load_fails_the_start_at_once(
        one_device: Adapters, tmp_path: Path, group_launcher: Launcher) -> None:
    family = QwenImageFamily(one_device.edit.transformer)  # no worker joins: it stays unsharded
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] ended before the group started"):
        start_group(family, tmp_path / "no-model", {"parallel_cfg": 2}, Degrees(cfg=2),
                    launcher=group_launcher)
    assert time.monotonic() - started < 60  # not a collective's timeout


@pytest.mark.parametrize(("block", "guided"), [(0, True), (1, True), (1, False)],
                         ids=["first-block", "mid-forward", "mid-forward-unguided"])
def test_interrupt_stops_every_rank_then_the_group_serves_on(
        block: int, guided: bool, one_device: Adapters, group: Adapters) -> None:
    """A cancel before block `block` of the forward: every rank (those of an empty CFG half
    too, when the request is unguided) stops there, and the next forward runs in step."""
    emb = _embeddings(4, 5, 3 if guided else None)
    payload = DenoiseInput(emb, HEIGHT, WIDTH, 2, 4.0, 4)
    grouped = group.text_to_image
    interrupt = StepInterrupt()
    grouped.bind_interrupt(interrupt)
    state = grouped.prepare(EngineRequest(request_id="r", payload=payload))
    interrupt.arm(["r"])
    # rank 0 runs every forward on the edit adapter's transformer (see `group`)
    blocks = group.edit.transformer.transformer_blocks
    if block == 0:
        interrupt.cancel("r")  # cancelled before the first block: every rank stops there
    else:  # cancelled while block `block - 1` runs on rank 0: every rank stops before `block`
        hook = blocks[block - 1].register_forward_hook(lambda *_: interrupt.cancel("r"))
    with pytest.raises(StepInterrupted):
        grouped.step([state])
    if block:
        hook.remove()
    assert state.step_index == 0
    interrupt.disarm()
    grouped.release(state)
    # the same ranks run the next forward in step: no collective was left half taken
    got = _solo(grouped, Job("after", payload))
    want = _solo(one_device.text_to_image, Job("after", payload))
    assert (got - want).abs().max().item() <= TOLERANCE


def test_every_rank_gets_its_device_from_one_place() -> None:
    """`GroupDevices` is where a group's devices are chosen, on CPU and CUDA alike (the CPU
    groups above run the same code; no CUDA device was lent to run the other path)."""
    cpu = GroupDevices.named("cpu")
    assert (cpu.backend, cpu.names(Degrees(2, 2))) == ("gloo", ["cpu"] * 4)
    cuda = GroupDevices.named("cuda:2")
    assert cuda.backend == "nccl"
    assert cuda.names(Degrees(2, 2)) == ["cuda:2", "cuda:3", "cuda:4", "cuda:5"]
    options, devices = worker_options({"device": "cuda:2", "parallel_cfg": 2}, rank=1)
    assert (options, devices) == ({"device": "cuda:3", "parallel_cfg": 2}, cuda)
    assert worker_options({"parallel_cfg": 2}, rank=1)[0]["device"] == "cpu"
    if torch.cuda.device_count() < 6:
        with pytest.raises(ValueError, match="needs 6 CUDA devices"):
            cuda.check(Degrees(2, 2))
    with pytest.raises(ValueError, match="cpu or cuda devices, not mps"):
        GroupDevices.named("mps")


#: The step cache of the group's rank 0 and of one device: first_block at a threshold that
#: reuses rows of this model (no one-device decision lies within 1% of it:
#: `clear_of_the_threshold`), at most 2 reuses in a row.
CACHE = StepCacheConfig(method=StepCacheMethod.FIRST_BLOCK, threshold=0.55, max_threshold=1.0,
                        max_skips=2)
CACHE_STEPS = 8


def test_the_step_cache_decides_in_a_group_as_on_one_device(
        group: Adapters, text_to_image_dir: Path, mesh_decisions: list[Triple]) -> None:
    """A mixed batch (guided and unguided rows, different steps, seeds and prompts, a request
    with its cache off, one paused for two steps as a preemption does, one cancelled midway)
    with the step cache on: every request reuses or computes at each step, branch by branch,
    as on one device, and the latents are one device's within 1e-5. The requests' shards are
    freed on the ranks once they left (with the next forward)."""
    embeddings = [_embeddings(1, 3, 2), _embeddings(2, 9, 5), _embeddings(3, 6, None)]
    base = DenoiseInput(embeddings[0], HEIGHT, WIDTH, CACHE_STEPS, 4.0, 1)
    payloads = {
        "guided": base,
        "guided-long": replace(base, embeddings=embeddings[1], seed=11),
        "unguided": replace(base, embeddings=embeddings[2], seed=3, num_inference_steps=6),
        "off": replace(base, seed=5, step_cache_threshold=0.0),
        "paused": replace(base, embeddings=embeddings[1], seed=7, num_inference_steps=6),
        "cancelled": replace(base, seed=9),
    }

    def pick(tick: int, live: dict[str, DenoiseState]) -> list[str]:
        return [name for name in live if not (name == "paused" and 1 <= tick < 3)
                and not (name == "cancelled" and tick >= 3)]

    want, want_reused = _drive(DenoiseAdapter(text_to_image_dir, step_cache=CACHE), payloads,
                               pick)
    one_device = sorted(mesh_decisions)
    mesh_decisions.clear()
    grouped = DenoiseAdapter(text_to_image_dir, step_cache=CACHE)
    grouped.group = forward = group.edit.group
    assert forward is not None
    got, got_reused = _drive(grouped, payloads, pick)
    assert any(reused for *_, reused in one_device), "the threshold reuses nothing"
    assert sorted(mesh_decisions) == one_device  # (step, branch, reused) of every row
    assert got_reused == want_reused  # by request, step by step
    assert set(got) == set(payloads) - {"cancelled"}
    for name, latents in want.items():
        assert (got[name] - latents).abs().max().item() <= TOLERANCE, name
    # every request left: the next forward frees their shards on every rank
    assert len(forward.store) > 0
    _solo(grouped, Job("after", replace(base, step_cache_threshold=0.0, num_inference_steps=2)))
    assert len(forward.store) == 0
