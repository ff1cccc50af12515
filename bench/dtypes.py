"""`stagemesh bench dtypes`: each stage's work in float32 and in bfloat16 on this CPU.

What picks each stage's default CPU dtype (`CPU_DTYPE` in each adapter module): one unit of
the stage's work on the default models, through the stage's own adapter, the dtypes
interleaved round by round (on a shared, noisy machine the drift then hits both), best of
`--rounds`. Units, at the default recipes' sizes:

    tokenizer  a prompt and an empty negative prompt (tiny-shapes' text encoder)
    dit        16 denoise steps at 32x32 with true CFG (tiny-shapes' transformer)
    vae        one 32x32 decode (tiny-shapes' VAE)
    talker     prefill + 20 frames of one request (csm-tiny)
    codec      30 frames decoded as a 5-frame chunk then a 25-frame chunk (csm-tiny's Mimi)

To see a CPU without bfloat16 instructions on one that has them, hold oneDNN and ATen to AVX2:
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 stagemesh bench dtypes`.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import torch

from stagemesh.bench.common import machine_info, markdown_table, write_json
from stagemesh.models.registry import resolve_model
from stagemesh.shared.devices import DTYPE_NAMES, Placement, cpu_has_native_bf16
from stagemesh.shared.engine.adapter import EngineRequest, NoStream, StageAdapter

log = logging.getLogger(__name__)

IMAGE_MODEL = "builtin:tiny-shapes"
SPEECH_MODEL = "builtin:csm-tiny"
DTYPES = (torch.float32, torch.bfloat16)
PROMPT = "a red circle on the left"
SIZE, STEPS, GUIDANCE = 32, 16, 4.0
TALKER_FRAMES = 20
CODEC_CHUNKS = (5, 25)  # the codec's default initial chunk, then one regular chunk
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")

InputT = TypeVar("InputT")
StateT = TypeVar("StateT")
PartialT = TypeVar("PartialT")
ResultT = TypeVar("ResultT")
#: One unit of a stage's work, built for one placement, ready to run again and again.
Work = Callable[[], object]


def run_request(
    adapter: StageAdapter[InputT, NoStream, StateT, PartialT, ResultT], payload: InputT
) -> ResultT:
    """prepare, step until finished, finish, release: one request, as the engine drives it."""
    state = adapter.prepare(EngineRequest(request_id="bench", payload=payload))
    while not adapter.step([state])[0].finished:
        pass
    result = adapter.finish(state)
    adapter.release(state)
    return result


def tokenizer_work(placement: Placement) -> Work:
    from stagemesh.services.tokenizer.base import PromptInput
    from stagemesh.services.tokenizer.qwen_image_adapter import PromptEncoderAdapter

    adapter = PromptEncoderAdapter(resolve_model(IMAGE_MODEL), placement=placement)
    return lambda: run_request(adapter, PromptInput(PROMPT, negative_prompt=""))


def dit_work(placement: Placement) -> Work:
    from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
    from stagemesh.services.tokenizer.base import PromptInput
    from stagemesh.services.tokenizer.qwen_image_adapter import PromptEncoderAdapter

    model = resolve_model(IMAGE_MODEL)
    encoder = PromptEncoderAdapter(model, placement=placement)
    embeddings = run_request(encoder, PromptInput(PROMPT, negative_prompt=""))
    adapter = DenoiseAdapter(model, placement=placement)
    payload = DenoiseInput(embeddings, SIZE, SIZE, STEPS, true_cfg_scale=GUIDANCE, seed=0)
    return lambda: run_request(adapter, payload)


def vae_work(placement: Placement) -> Work:
    from stagemesh.services.vae.qwen_image_adapter import LatentDecoderAdapter, LatentsInput

    adapter = LatentDecoderAdapter(resolve_model(IMAGE_MODEL), placement=placement)
    tokens = (SIZE // adapter.latent_factor) ** 2
    channels = adapter.vae.config.z_dim * 4
    latents = torch.randn((1, tokens, channels), generator=torch.Generator().manual_seed(0))
    payload = LatentsInput(latents.to(placement.dtype), SIZE, SIZE)
    return lambda: run_request(adapter, payload)


def talker_work(placement: Placement) -> Work:
    from stagemesh.services.talker.csm_adapter import SamplingParams, TalkerAdapter, TalkerInput

    adapter = TalkerAdapter(resolve_model(SPEECH_MODEL), placement=placement)
    payload = TalkerInput(text="The quick brown fox jumps over the lazy dog.",
                          sampling=SamplingParams(seed=0), max_new_frames=TALKER_FRAMES,
                          stop_on_end_of_audio=False)
    return lambda: run_request(adapter, payload)


def codec_work(placement: Placement) -> Work:
    from stagemesh.services.codec.csm_adapter import CodecDecoderAdapter, DecodeInput

    adapter = CodecDecoderAdapter(resolve_model(SPEECH_MODEL), placement=placement)
    initial, regular = CODEC_CHUNKS
    # Any valid codes: the decode's cost does not depend on their values.
    codes = torch.randint(0, 2, (initial + regular, adapter.num_codebooks),
                          generator=torch.Generator().manual_seed(0))

    def decode() -> object:
        payload = DecodeInput(chunk_frames=regular, initial_chunk_frames=initial,
                              left_context_frames=regular, frames=codes, final=True)
        state = adapter.prepare(EngineRequest(request_id="bench", payload=payload))
        while not adapter.step([state])[0].finished:
            pass
        adapter.release(state)
        return state.samples

    return decode


STAGE_WORK: dict[str, Callable[[Placement], Work]] = {
    "tokenizer": tokenizer_work,
    "dit": dit_work,
    "vae": vae_work,
    "talker": talker_work,
    "codec": codec_work,
}


def measure(stages: list[str], rounds: int) -> dict[str, dict[str, float]]:
    """Per stage: the best seconds per unit of work in each dtype, and the median over rounds
    of float32 time / bfloat16 time (each round times both back to back, so the ratio of a
    round cancels the machine's drift; > 1 means bfloat16 is faster)."""
    results: dict[str, dict[str, float]] = {}
    for stage in stages:
        works = {dtype: STAGE_WORK[stage](Placement(torch.device("cpu"), dtype))
                 for dtype in DTYPES}
        for work in works.values():
            work()  # warm-up: first-call allocations and oneDNN kernel creation
        times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in DTYPES}
        for _ in range(rounds):
            for dtype, work in works.items():
                started = time.perf_counter()
                work()
                times[dtype].append(time.perf_counter() - started)
        fp32, bf16 = times[torch.float32], times[torch.bfloat16]
        results[stage] = {DTYPE_NAMES[dtype]: min(seconds) for dtype, seconds in times.items()}
        results[stage]["bf16_speedup_best"] = min(fp32) / min(bf16)
        results[stage]["bf16_speedup_median"] = statistics.median(
            f / b for f, b in zip(fp32, bf16, strict=True))
        log.info("%s: %s", stage, results[stage])
    return results


def table(results: dict[str, dict[str, float]]) -> str:
    rows = [[stage, f"{r['float32'] * 1000:.1f} ms", f"{r['bfloat16'] * 1000:.1f} ms",
             f"{r['bf16_speedup_best']:.2f}x", f"{r['bf16_speedup_median']:.2f}x"]
            for stage, r in results.items()]
    return markdown_table(["stage", "float32 (best)", "bfloat16 (best)", "bf16 speed-up (bests)",
                           "bf16 speed-up (median of rounds)"], rows)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stagemesh bench dtypes", description=__doc__)
    parser.add_argument("--stages", default=",".join(STAGE_WORK),
                        help="comma-separated stages (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per dtype (best of)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (stages use 1)")
    parser.add_argument("--out", default="bench-results/dtypes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(list(argv or []))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    stages = [stage for stage in args.stages.split(",") if stage]
    unknown = sorted(set(stages) - set(STAGE_WORK))
    if unknown:
        raise SystemExit(f"unknown stages {unknown}; known: {list(STAGE_WORK)}")
    results = measure(stages, args.rounds)
    report = {"benchmark": "dtypes", "created": datetime.now(UTC).isoformat(),
              "machine": machine_info(), "cpu_has_native_bf16": cpu_has_native_bf16(),
              "isa_limits": {name: os.environ.get(name, "") for name in ISA_VARIABLES},
              "torch_threads": args.threads, "rounds": args.rounds, "results": results}
    path = write_json(Path(args.out) / "dtypes.json", report)
    log.info("results:\n%s", table(results))
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
