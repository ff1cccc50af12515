"""LoRA per request on the DiT (services/dit/lora.py, lora_slots.py) with qwen-image-tiny.

Seeded adapters are written with diffusers' `save_lora_weights` (and one as a bare
`<name>.safetensors`) into a tmp `lora_dir`. One adapter at a scale, and two adapters at two
scales, must give diffusers' latents (`load_lora_weights` + `set_adapters`) within 1e-5 in fp32;
in one step batch, rows with four different adapters and a row without any each equal their
solo run; a cancelled batch mate and a preemption change nobody's result; a symlink out of the
directory is refused.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file, save_file

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.registry import resolve_model
from stagemesh.services.dit import lora_slots
from stagemesh.services.dit.lora import AdapterFile, LoraCatalog, LoraConfig, LoraUse, inside
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput, DenoiseState
from stagemesh.shared.engine import (
    Aborted,
    Completed,
    EngineMetrics,
    EngineRequest,
    InvalidInputError,
    StepBudget,
    StepEngine,
)
from tests.lora_files import write_adapter

TOLERANCE = 1e-5
SIZE, STEPS, CFG = 32, 6, 4.0
#: name -> (rank, lora_alpha in the file's metadata or None, seed, written as a bare file)
ADAPTERS: dict[str, tuple[int, int | None, int, bool]] = {
    "ink": (4, 8, 1, False),
    "wax": (8, None, 2, False),
    "clay": (2, 2, 3, True),
    "neon": (6, 3, 4, False),
}


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return resolve_model("builtin:qwen-image-tiny")


@pytest.fixture(scope="module")
def lora_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    pipe = QwenImagePipeline.from_pretrained(tiny_dir, local_files_only=True)
    for name, (rank, alpha, seed, bare) in ADAPTERS.items():
        write_adapter(pipe.transformer, root, name, rank, seed, alpha, bare)
    return root


def _config(lora_dir: Path, **fields: object) -> LoraConfig:
    return replace(LoraConfig(directory=lora_dir.resolve(), max_lora_rank=8), **fields)  # type: ignore[arg-type]


def _payload(seed: int, dim: int, lora: tuple[LoraUse, ...] = ()) -> DenoiseInput:
    generator = torch.Generator().manual_seed(seed)
    emb = PromptEmbeddings(
        torch.randn(1, 5 + seed, dim, generator=generator), None,
        torch.randn(1, 4, dim, generator=generator), None,
    )  # fmt: skip
    return DenoiseInput(emb, SIZE, SIZE, STEPS, CFG, seed, lora=lora)


def _start(dit: DenoiseAdapter, name: str, payload: DenoiseInput) -> DenoiseState:
    dit.check_inputs(payload)
    return dit.prepare(EngineRequest(request_id=name, payload=payload))


def _solo(dit: DenoiseAdapter, payload: DenoiseInput) -> torch.Tensor:
    state = _start(dit, "solo", payload)
    while not dit.step([state])[0].finished:
        pass
    latents = dit.finish(state).latents
    dit.release(state)
    return latents


def _dim(dit: DenoiseAdapter) -> int:
    dim: int = dit.transformer.config["joint_attention_dim"]
    return dim


@pytest.mark.parametrize(
    "uses", [(LoraUse("ink", 0.7),), (LoraUse("wax", 1.3), LoraUse("clay", -0.6))],
    ids=["one", "two"],
)  # fmt: skip
def test_latents_equal_diffusers_set_adapters(
    tiny_dir: Path, lora_dir: Path, uses: tuple[LoraUse, ...]
) -> None:
    pipe = QwenImagePipeline.from_pretrained(tiny_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    for use in uses:
        bare = ADAPTERS[use.name][3]
        source, weight = (
            (lora_dir, f"{use.name}.safetensors") if bare else (lora_dir / use.name, None)
        )
        pipe.load_lora_weights(source, weight_name=weight, adapter_name=use.name)
    pipe.set_adapters([u.name for u in uses], [u.scale for u in uses])
    dit = DenoiseAdapter(tiny_dir, lora=_config(lora_dir))
    payload = _payload(1, _dim(dit), uses)
    emb = payload.embeddings
    want = pipe(
        prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
        true_cfg_scale=CFG, height=SIZE, width=SIZE, num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(payload.seed), output_type="latent",
    ).images  # fmt: skip
    got = _solo(dit, payload)
    base = _solo(dit, replace(payload, lora=()))
    assert (got - base).abs().max().item() > 100 * TOLERANCE, "the adapters change nothing"
    assert (got - want).abs().max().item() <= TOLERANCE


def _mixed(dim: int) -> dict[str, DenoiseInput]:
    return {
        "ink": _payload(1, dim, (LoraUse("ink", 1.0),)),
        "wax+neon": _payload(2, dim, (LoraUse("wax", 0.5), LoraUse("neon", -1.5))),
        "clay": _payload(3, dim, (LoraUse("clay", 2.0),)),
        "neon": _payload(4, dim, (LoraUse("neon", 0.8),)),
        "none": _payload(5, dim),
    }


def test_mixed_batch_rows_equal_their_solo_runs(tiny_dir: Path, lora_dir: Path) -> None:
    """Four adapters (one row with two), a row without any, one forward per step; then the
    same with a batch mate cancelled after two steps and one row preempted for two steps."""
    dit = DenoiseAdapter(tiny_dir, lora=_config(lora_dir))
    payloads = _mixed(_dim(dit))
    solo = {name: _solo(dit, payload) for name, payload in payloads.items()}
    for cancel, pause in ((None, None), ("clay", "wax+neon")):
        live = {name: _start(dit, name, p) for name, p in payloads.items()}
        got: dict[str, torch.Tensor] = {}
        tick = 0
        while live:
            if tick == 2 and cancel in live:
                dit.release(live.pop(cancel))
            batch = [n for n in live if not (n == pause and tick in (1, 2))]
            for name, out in zip(batch, dit.step([live[n] for n in batch]), strict=True):
                assert out.error is None
                if out.finished:
                    got[name] = dit.finish(live[name]).latents
                    dit.release(live.pop(name))
            tick += 1
        for name, latents in got.items():
            assert (latents - solo[name]).abs().max().item() <= TOLERANCE, name
        assert set(got) == set(payloads) - {cancel}
    bank = dit.lora_slots
    assert bank is not None and not any(bank.held(s) for s in range(bank.max_loras))


def test_a_request_without_a_slot_waits_while_others_pass(
    tiny_dir: Path, lora_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two slots: `a` holds both (ink, wax), so `b` (clay) waits, never stepped, while `a` and
    `c` (no adapter) run; once `a` is released, `b` evicts the least recently used (ink) and
    runs. Files are read on the loader thread; every result equals its solo run."""
    readers: list[str] = []
    read = lora_slots.read_adapter

    def spied(adapter: AdapterFile, files: lora_slots.LoraFiles) -> lora_slots.Matrices:
        readers.append(threading.current_thread().name)
        return read(adapter, files)

    monkeypatch.setattr(lora_slots, "read_adapter", spied)
    dit = DenoiseAdapter(tiny_dir, lora=_config(lora_dir, max_loras=2, max_loras_per_request=2))
    dim = _dim(dit)
    payloads = {
        "a": _payload(1, dim, (LoraUse("ink"), LoraUse("wax", 0.5))),
        "b": _payload(2, dim, (LoraUse("clay", 1.5),)),
        "c": _payload(3, dim),
    }
    live = {name: _start(dit, name, payload) for name, payload in payloads.items()}
    got: dict[str, torch.Tensor] = {}
    while live:
        names = list(live)
        for name, out in zip(names, dit.step([live[n] for n in names]), strict=True):
            assert out.error is None
            if name == "b" and "a" in live:
                assert out.step_index == 0, "b stepped while every slot was held"
            if out.finished:
                got[name] = dit.finish(live[name]).latents
                dit.release(live.pop(name))
    assert dit.lora_slots is not None and dit.lora_slots.resident() == ["wax", "clay"]
    assert readers and all(name.startswith("lora-loader") for name in readers)
    fresh = DenoiseAdapter(tiny_dir, lora=_config(lora_dir))
    for name, payload in payloads.items():
        assert (got[name] - _solo(fresh, payload)).abs().max().item() <= TOLERANCE, name


def test_requests_are_checked_naming_lora(tiny_dir: Path, lora_dir: Path) -> None:
    dit = DenoiseAdapter(tiny_dir, lora=_config(lora_dir, max_lora_scale=2.0))
    dim = _dim(dit)
    assert dit.loras.names == sorted(ADAPTERS)
    bad = [
        (LoraUse("nope"),),
        (LoraUse("ink", 2.5),),
        (LoraUse("ink", float("nan")),),
        (LoraUse("ink"), LoraUse("ink")),
        (*(LoraUse(name) for name in ADAPTERS), LoraUse("x")),
    ]
    for uses in bad:
        with pytest.raises(InvalidInputError) as caught:
            dit.check_inputs(_payload(1, dim, uses))
        assert caught.value.field_name == "lora"
    plain = DenoiseAdapter(tiny_dir)
    with pytest.raises(InvalidInputError):
        plain.check_inputs(_payload(1, dim, (LoraUse("ink"),)))


def test_directory_scan_keeps_inside_and_fitting(lora_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.safetensors").write_bytes((lora_dir / "clay.safetensors").read_bytes())
    root = tmp_path / "loras"
    root.mkdir()
    (root / "evil.safetensors").symlink_to(outside / "evil.safetensors")
    (root / "ok").symlink_to(lora_dir / "ink")  # a link out as well: refused
    (root / "clay.safetensors").write_bytes((lora_dir / "clay.safetensors").read_bytes())
    (root / "big").mkdir()
    (root / "big" / "pytorch_lora_weights.safetensors").write_bytes(
        (lora_dir / "wax" / "pytorch_lora_weights.safetensors").read_bytes()
    )
    (root / "notes.txt").write_text("not an adapter")
    catalog = LoraCatalog(LoraConfig(directory=root.resolve(), max_lora_rank=4))
    assert catalog.names == ["clay"]  # evil and ok lead out; big is rank 8 > 4
    assert catalog.adapters["clay"].rank == 2
    with pytest.raises(ValueError, match="outside"):
        inside(root.resolve(), root / "evil.safetensors")


def test_an_adapter_that_cannot_load_fails_its_request_alone(
    tiny_dir: Path, lora_dir: Path, tmp_path: Path
) -> None:
    """A file with a NaN passes the header scan but not the load: the request naming it fails
    with an error naming lora; its batch mate runs on, equal to its solo run."""
    state = load_file(lora_dir / "clay.safetensors")
    key = next(k for k in state if ".lora_B." in k)
    state[key][0, 0] = float("nan")
    save_file(state, tmp_path / "broken.safetensors")
    (tmp_path / "clay.safetensors").write_bytes((lora_dir / "clay.safetensors").read_bytes())
    dit = DenoiseAdapter(tiny_dir, lora=_config(tmp_path))
    dim = _dim(dit)
    mate = _payload(2, dim, (LoraUse("clay", 0.7),))
    live = {"broken": _start(dit, "broken", _payload(1, dim, (LoraUse("broken"),))),
            "mate": _start(dit, "mate", mate)}  # fmt: skip
    errors: dict[str, str] = {}
    got = None
    while live:
        names = list(live)
        for name, out in zip(names, dit.step([live[n] for n in names]), strict=True):
            if out.error is not None:
                errors[name] = out.error
                dit.release(live.pop(name))
            elif out.finished:
                got = dit.finish(live[name]).latents
                dit.release(live.pop(name))
    assert list(errors) == ["broken"] and errors["broken"].startswith("lora:")
    assert got is not None and (got - _solo(dit, mate)).abs().max().item() <= TOLERANCE


async def test_the_engine_serves_waiting_and_running_lora_requests(
    tiny_dir: Path, lora_dir: Path
) -> None:
    """Through the StepEngine with one slot: `ink` and `wax` cannot hold it at once, so one
    waits (stepping nothing) while the other and a plain request run; all three complete with
    their solo latents, and a cancelled fourth (waiting for the slot) leaves nobody changed."""
    dit = DenoiseAdapter(tiny_dir, lora=_config(lora_dir, max_loras=1, max_loras_per_request=1))
    dim = _dim(dit)
    payloads = {
        "ink": _payload(1, dim, (LoraUse("ink", 0.9),)),
        "wax": _payload(2, dim, (LoraUse("wax", -0.4),)),
        "plain": _payload(3, dim),
        "gone": _payload(4, dim, (LoraUse("clay"),)),
    }
    fresh = DenoiseAdapter(tiny_dir, lora=_config(lora_dir))
    solo = {name: _solo(fresh, p) for name, p in payloads.items() if name != "gone"}
    engine = StepEngine(dit, max_running=4, max_batch=4,
                        metrics=EngineMetrics("dit", CollectorRegistry()))  # fmt: skip
    streams = {name: engine.submit(EngineRequest(name, p, StepBudget(p.num_inference_steps)))
               for name, p in payloads.items()}  # fmt: skip
    engine.start()
    engine.abort("gone")
    terminal: dict[str, object] = {}
    try:
        for name, stream in streams.items():
            async for event in stream:
                terminal[name] = event
    finally:
        await asyncio.to_thread(engine.shutdown, True, 10)
    assert isinstance(terminal["gone"], Aborted)
    for name, want in solo.items():
        done = terminal[name]
        assert isinstance(done, Completed), (name, done)
        assert (done.result.latents - want).abs().max().item() <= TOLERANCE, name
    bank = dit.lora_slots
    assert bank is not None and not bank.held(0)
