"""Step previews on tiny-shapes (services/dit/preview.py): the picture the DiT sends at step 12
of 16 shows what the final image will, as the project's scorer reads it.

The folder's projection is fitted here (as a folder's prepare would) on tiny-shapes renders;
the shipped folder is read-only, so the test works on a copy whose `vae/` holds the fit.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.tiny_shapes import SHIPPED_DIR
from stagemesh.models.tiny_shapes.data import make_dataset
from stagemesh.models.tiny_shapes.evaluate import DEFAULT_GUIDANCE, DEFAULT_STEPS, subset_prompts
from stagemesh.models.tiny_shapes.scoring import score
from stagemesh.services.dit.preview import PreviewOptions, Projection
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
from stagemesh.services.vae.kinds import latent_stats
from stagemesh.services.vae.preview_fit import fit_folder_projection
from stagemesh.shared.engine import EngineRequest, InvalidInputError

SIZE = 32
PREVIEW_STEP = 12
#: The issue's bar is 30 prompts; the test runs fewer to stay fast (the full 30: the report).
PROMPTS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """tiny-shapes with its VAE's preview projection fitted on 512 renders."""
    folder = tmp_path_factory.mktemp("preview") / "tiny-shapes"
    folder.mkdir()
    for part in Path(SHIPPED_DIR).iterdir():
        if part.name == "vae":
            shutil.copytree(part, folder / "vae")
        else:
            (folder / part.name).symlink_to(part)
    pictures, _ = make_dataset(512, seed=3)  # the distribution the model was trained on
    fit_folder_projection(folder, pictures)
    yield folder


def _run(folder: Path, prompts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(the preview after PREVIEW_STEP steps, the final image) for each prompt, all prompts
    stepped in one batch as the stage would."""
    pipe = QwenImagePipeline.from_pretrained(folder, local_files_only=True)
    dit = DenoiseAdapter(folder)
    states = []
    for index, prompt in enumerate(prompts):
        embeds, mask = pipe.encode_prompt(prompt)
        negative, negative_mask = pipe.encode_prompt("")
        payload = DenoiseInput(PromptEmbeddings(embeds, mask, negative, negative_mask), SIZE,
                               SIZE, DEFAULT_STEPS, DEFAULT_GUIDANCE, seed=index,
                               preview=PreviewOptions(every=1, size=SIZE))
        dit.check_inputs(payload)
        states.append(dit.prepare(EngineRequest(request_id=str(index), payload=payload)))
    previews: list[np.ndarray] = [np.zeros(0, np.uint8)] * len(prompts)
    for _ in range(DEFAULT_STEPS):
        for i, output in enumerate(dit.step(states)):
            assert output.error is None and output.partial is not None  # every step
            assert output.partial.step_index == output.step_index
            if output.step_index == PREVIEW_STEP:
                previews[i] = output.partial.pixels
    mean, std = latent_stats(pipe.vae)
    results = []
    for preview, state in zip(previews, states, strict=True):
        latents = QwenImagePipeline._unpack_latents(dit.finish(state).latents, SIZE, SIZE,
                                                    pipe.vae_scale_factor)
        with torch.inference_mode():
            decoded = pipe.vae.decode(latents * std + mean).sample[0, :, 0]
        final = ((decoded.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
        results.append((preview, final))
    return results


Runs = tuple[list[str], list[tuple[np.ndarray, np.ndarray]]]


@pytest.fixture(scope="module")
def runs(folder: Path) -> Runs:
    """The prompts and their (preview, final) pairs, run once for both checks below (fixed
    seeds: a second run gives the same pictures). Read-only for the tests."""
    prompts = subset_prompts(30)[:PROMPTS]
    return prompts, _run(folder, prompts)


@pytest.mark.timeout(120)
def test_the_preview_at_step_12_of_16_shows_the_final_picture(runs: Runs) -> None:
    prompts, results = runs
    preview_hits = {"place": 0, "shape": 0}
    final_shapes = 0
    for prompt, (preview, final) in zip(prompts, results, strict=True):
        assert preview.shape == (SIZE, SIZE, 3) and preview.dtype == np.uint8
        seen, wanted = score(preview, prompt), score(final, prompt)
        preview_hits["place"] += seen["colour"] and seen["position"]
        preview_hits["shape"] += seen["shape"]
        final_shapes += wanted["shape"]
    # Measured on 30 prompts: 25/30 colour and place, 17/30 shapes (final: 27/30); the
    # issue's bar (90%, shapes within 15 points) is not met yet: see the strict xfail below.
    assert preview_hits["place"] >= 0.7 * len(prompts), preview_hits
    assert preview_hits["shape"] >= 0.4 * len(prompts), (preview_hits, final_shapes)
    assert final_shapes >= 0.8 * len(prompts)


@pytest.mark.xfail(strict=True, reason="issue 26's bar: the linear projection reaches 83% "
                   "colour+place and -33 points of shape at step 12 (30 prompts)")
@pytest.mark.timeout(120)
def test_the_preview_at_step_12_meets_the_issues_bar(runs: Runs) -> None:
    prompts, results = runs
    places = shapes = final_shapes = 0
    for prompt, (preview, final) in zip(prompts, results, strict=True):
        seen, wanted = score(preview, prompt), score(final, prompt)
        places += seen["colour"] and seen["position"]
        shapes += seen["shape"]
        final_shapes += wanted["shape"]
    assert places >= 0.9 * len(prompts) and shapes >= final_shapes - 0.15 * len(prompts)


def test_a_folder_without_a_projection_refuses_previews_naming_the_field() -> None:
    assert Projection.load(SHIPPED_DIR) is None
    dit = DenoiseAdapter(SHIPPED_DIR)
    embeddings = PromptEmbeddings(torch.zeros(1, 4, 64), torch.ones(1, 4, dtype=torch.long),
                                  None, None)
    payload = DenoiseInput(embeddings, SIZE, SIZE, 2, 1.0, 0, preview=PreviewOptions(every=1))
    dit.check_inputs(replace(payload, preview=None))  # the same request without previews
    with pytest.raises(InvalidInputError) as refused:
        dit.check_inputs(payload)
    assert refused.value.field_name == "preview"


@pytest.mark.timeout(120)
async def test_the_stage_publishes_its_limits_and_streams_previews(folder: Path) -> None:
    from stagemesh.services.registry import build_stage
    from stagemesh.shared.proto.v1 import common_pb2, dit_service_pb2, dit_service_pb2_grpc
    from stagemesh.shared.stage_runtime import start_stage, stop_stage
    from stagemesh.shared.tensors import array_from_proto
    from stagemesh.shared.torch_tensors import to_proto

    start = dit_service_pb2.DenoiseStart(
        request_id="p", prompt_embeds=to_proto(torch.randn(1, 5, 64)), height=SIZE,
        width=SIZE, num_inference_steps=8, true_cfg_scale=1.0, seed=0,
        preview=common_pb2.PreviewOptions(every=4, size=16))
    described = {}
    for name, model_dir in (("fitted", folder), ("shipped", Path(SHIPPED_DIR))):
        bundle = build_stage("dit", model_dir, {})
        server = await start_stage(bundle)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = dit_service_pb2_grpc.DitServiceStub(channel)
                described[name] = await stub.DescribeDit(dit_service_pb2.DescribeDitRequest())
                if name == "fitted":
                    responses = [r async for r in stub.Denoise(iter([
                        dit_service_pb2.DenoiseRequest(start=start)]))]
        finally:
            await stop_stage(bundle, server, grace=0.5)
    assert (described["fitted"].max_preview_size, described["fitted"].min_preview_every) == (
        256, 1)
    assert described["shipped"].max_preview_size == 0  # no projection, no previews
    events = [r.WhichOneof("event") for r in responses]
    previews = [r.preview for r in responses if r.HasField("preview")]
    assert [p.step_index for p in previews] == [4, 8]
    assert events.index("preview") == events.index("progress") + 4  # right after step 4
    pixels = array_from_proto(previews[0].pixels)
    assert pixels.shape == (16, 16, 3) and pixels.dtype == np.uint8
    assert (previews[0].width, previews[0].height) == (16, 16)
    assert events[-1] == "result"
