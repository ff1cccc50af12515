"""The DiT stage on a Qwen-Image-Edit folder denoises as QwenImageEditPipeline does, step by step.

The stock pipeline runs on the folder's own transformer, scheduler and VAE, from a PIL image (the
only input its `calculate_dimensions` takes); a hook on its VAE encode captures the normalized
image latents, which are what the VAE stage's EncodeImage hands the DiT.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
from PIL import Image
from prometheus_client import CollectorRegistry

from stagemesh.models import qwen_image, qwen_image_edit
from stagemesh.models.families.qwen_image import PromptEmbeddings, edit_image_size
from stagemesh.services.dit.qwen_image_adapter import (
    DenoiseAdapter,
    DenoiseInput,
    DenoiseState,
    is_edit_folder,
)
from stagemesh.shared.engine import (
    Aborted,
    Completed,
    EngineMetrics,
    EngineRequest,
    InvalidInputError,
    StepBudget,
    StepEngine,
)

#: Step-by-step latents may differ from the stock pipeline's by float rounding only.
TOLERANCE = 1e-5
HEIGHT, WIDTH = 64, 96  # the output; the condition image is ~1024x1024 as the pipeline makes it
STEPS = 3
TEXT_DIM = qwen_image.PRESETS["tiny"].text_hidden


@pytest.fixture(scope="module")
def edit_dir() -> Path:
    """builtin:qwen-image-edit-tiny (built once into the model cache)."""
    return qwen_image_edit.ensure_edit_model()


@pytest.fixture(scope="module")
def text_to_image_dir(edit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same components under a text-to-image pipeline's model_index.json."""
    folder = tmp_path_factory.mktemp("qwen-image-t2i")
    for component in ("transformer", "scheduler", "vae"):
        (folder / component).symlink_to(edit_dir / component)
    index = json.loads((edit_dir / "model_index.json").read_text())
    index["_class_name"] = "QwenImagePipeline"
    for unused in ("processor",):
        index.pop(unused, None)
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def dit(edit_dir: Path) -> DenoiseAdapter:
    return DenoiseAdapter(edit_dir)


@pytest.fixture(scope="module")
def pipe(edit_dir: Path) -> QwenImageEditPipeline:
    """The stock edit pipeline over the folder's DiT, VAE and scheduler; prompts come as
    embeddings, so it needs no text encoder."""
    pipe = QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(edit_dir, subfolder="scheduler"),
        vae=AutoencoderKLQwenImage.from_pretrained(edit_dir, subfolder="vae"),
        # diffusers takes None for a component a call never uses; its annotations do not say so.
        text_encoder=None,  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        processor=None,  # type: ignore[arg-type]
        transformer=QwenImageTransformer2DModel.from_pretrained(edit_dir, subfolder="transformer"),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _embeddings(seed: int, tokens: int, negative_tokens: int | None) -> PromptEmbeddings:
    """Seeded stand-ins for the Tokenizer stage's output (the DiT only sees tensors); the
    negative prompt is right-padded by 3 masked tokens, as a batched encode pads it."""
    generator = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, tokens, TEXT_DIM, generator=generator)
    if negative_tokens is None:
        return PromptEmbeddings(embeds, None)
    negative = torch.randn(1, negative_tokens + 3, TEXT_DIM, generator=generator)
    mask = torch.ones(1, negative_tokens + 3, dtype=torch.long)
    mask[0, negative_tokens:] = 0
    return PromptEmbeddings(embeds, None, negative, mask)


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A small seeded RGB picture (width, height): the pipeline resizes it to ~1024x1024."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@dataclass(frozen=True)
class StockRun:
    """What the stock pipeline computed: the condition latents its VAE encode made, and its
    latents after every step."""

    condition: torch.Tensor  # [1, C, 1, h, w], normalized
    steps: list[torch.Tensor]


def _stock(
    pipe: QwenImageEditPipeline,
    image: Image.Image,
    embeddings: PromptEmbeddings,
    cfg: float,
    seed: int,
    condition: torch.Tensor | None = None,
) -> StockRun:
    """Run the stock pipeline; `condition` (an earlier run's encode of the same image) stands
    in for its VAE encode, which is the same computation again (and the slow part on a CPU)."""
    encoded: list[torch.Tensor] = []
    stepped: list[torch.Tensor] = []
    encode = pipe._encode_vae_image

    def hooked_encode(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        latents = encode(image, generator) if condition is None else condition
        encoded.append(latents)
        return latents

    def on_step_end(
        _pipe: QwenImageEditPipeline, _i: int, _t: torch.Tensor, kwargs: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        stepped.append(kwargs["latents"].clone())
        return kwargs

    pipe._encode_vae_image = hooked_encode  # type: ignore[method-assign]
    try:
        pipe(
            image=image,
            prompt_embeds=embeddings.prompt_embeds,
            prompt_embeds_mask=embeddings.prompt_embeds_mask,
            negative_prompt_embeds=embeddings.negative_prompt_embeds,
            negative_prompt_embeds_mask=embeddings.negative_prompt_embeds_mask,
            true_cfg_scale=cfg,
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=STEPS,
            generator=torch.Generator().manual_seed(seed),
            output_type="latent",
            callback_on_step_end=on_step_end,
        )
    finally:
        del pipe._encode_vae_image
    (latents,) = encoded
    return StockRun(latents, stepped)


@pytest.fixture(scope="module")
def guided_run(pipe: QwenImageEditPipeline) -> StockRun:
    return _stock(pipe, _image(0, (40, 24)), _embeddings(1, 9, 5), cfg=4.0, seed=7)


def _payload(
    embeddings: PromptEmbeddings, condition: torch.Tensor, cfg: float, seed: int
) -> DenoiseInput:
    return DenoiseInput(
        embeddings, HEIGHT, WIDTH, STEPS, true_cfg_scale=cfg, seed=seed,
        condition_latents=(condition,),
    )  # fmt: skip


def _start(dit: DenoiseAdapter, name: str, payload: DenoiseInput) -> DenoiseState:
    dit.check_inputs(payload)
    return dit.prepare(EngineRequest(request_id=name, payload=payload))


def _run(dit: DenoiseAdapter, states: list[DenoiseState]) -> list[list[torch.Tensor]]:
    """Step `states` together to the end; each state's latents after every step."""
    seen: list[list[torch.Tensor]] = [[] for _ in states]
    while not all(len(steps) == STEPS for steps in seen):
        outputs = dit.step(states)
        for steps, state, out in zip(seen, states, outputs, strict=True):
            assert out.error is None
            steps.append(state.live().latents.clone())
    return seen


def _max_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert len(got) == len(want) == STEPS
    assert all(a.shape == b.shape for a, b in zip(got, want, strict=True))
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


# -- equal to the stock pipeline ----------------------------------------------------------------


def test_the_folder_is_an_edit_model(dit: DenoiseAdapter, edit_dir: Path) -> None:
    assert is_edit_folder(edit_dir)
    assert (dit.limits.task, dit.limits.max_condition_images) == ("image-edit", 1)


def test_guided_edit_equals_the_pipeline_step_by_step(
    dit: DenoiseAdapter, guided_run: StockRun
) -> None:
    """True CFG with the norm rescale; a masked, padded negative prompt; a non-square image."""
    assert guided_run.condition.shape[:3] == (1, 16, 1)
    payload = _payload(_embeddings(1, 9, 5), guided_run.condition, cfg=4.0, seed=7)
    (got,) = _run(dit, [_start(dit, "guided", payload)])
    assert _max_diff(got, guided_run.steps) <= TOLERANCE


def test_unguided_edit_equals_the_pipeline_step_by_step(
    dit: DenoiseAdapter, pipe: QwenImageEditPipeline, guided_run: StockRun
) -> None:
    embeddings = _embeddings(2, 6, None)
    want = _stock(
        pipe, _image(0, (40, 24)), embeddings, cfg=1.0, seed=11, condition=guided_run.condition
    )
    state = _start(dit, "plain", _payload(embeddings, guided_run.condition, cfg=1.0, seed=11))
    (got,) = _run(dit, [state])
    assert _max_diff(got, want.steps) <= TOLERANCE
    finished = dit.finish(state)
    assert (finished.height, finished.width) == (HEIGHT, WIDTH)
    factor = dit.limits.size_multiple
    assert finished.latents.shape == (1, HEIGHT // factor * WIDTH // factor, 64)  # output only


def test_the_condition_steers_the_result(dit: DenoiseAdapter, guided_run: StockRun) -> None:
    """The condition reaches the forward: another image gives other latents, by far more than
    rounding (a random tiny DiT attends to it weakly, so the other image is far off)."""
    base = _payload(_embeddings(2, 6, None), guided_run.condition, cfg=1.0, seed=11)
    other = replace(base, condition_latents=(guided_run.condition.flip(-1) * 4,))
    (a,) = _run(dit, [_start(dit, "a", base)])
    (b,) = _run(dit, [_start(dit, "b", other)])
    assert (a[-1] - b[-1]).abs().max().item() > 100 * TOLERANCE


# -- batching ------------------------------------------------------------------------------------


def test_a_batch_of_two_edits_equals_each_alone(dit: DenoiseAdapter, guided_run: StockRun) -> None:
    """One guided and one unguided edit, different prompts, seeds and images, in one forward."""
    condition = guided_run.condition
    first = _payload(_embeddings(1, 9, 5), condition, cfg=4.0, seed=7)
    second = _payload(_embeddings(3, 4, 2), condition * 0.5 + 0.1, cfg=1.0, seed=8)
    states = [_start(dit, "first", first), _start(dit, "second", second)]
    assert dit.batch_key(states[0]) == dit.batch_key(states[1])
    together = _run(dit, states)
    assert _max_diff(together[0], guided_run.steps) <= TOLERANCE
    (alone,) = _run(dit, [_start(dit, "second-alone", second)])
    assert _max_diff(together[1], alone) <= TOLERANCE


def test_edits_of_other_condition_sizes_batch_apart(
    dit: DenoiseAdapter, guided_run: StockRun
) -> None:
    condition = guided_run.condition
    square = _payload(_embeddings(1, 9, None), condition, cfg=1.0, seed=1)
    narrow = replace(square, condition_latents=(condition[..., :-2],))
    states = [_start(dit, "square", square), _start(dit, "narrow", narrow)]
    assert dit.batch_key(states[0]) != dit.batch_key(states[1])
    with pytest.raises(ValueError, match="one image size"):
        dit.step(states)


async def test_an_edit_aborted_mid_run_stops_and_its_batch_mate_completes(
    edit_dir: Path, guided_run: StockRun
) -> None:
    """Through the engine: two edits share each forward; one is aborted during its second step.
    The forward runs on for its batch mate (it stops mid-forward only when the whole batch is
    cancelled), the abort lands before that step's output, and the mate ends as if alone."""
    dit = DenoiseAdapter(edit_dir)  # its own: the engine binds interrupt hooks to it
    engine = StepEngine(dit, max_running=4, max_batch=4,
                        metrics=EngineMetrics("dit", CollectorRegistry()))
    survivor = _payload(_embeddings(1, 9, 5), guided_run.condition, cfg=4.0, seed=7)
    doomed = replace(survivor, num_inference_steps=50, seed=9)
    forwards: list[int] = []

    def abort_in_the_second_forward(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        forwards.append(1)
        if len(forwards) == 2:
            engine.abort("doomed")

    dit.transformer.transformer_blocks[0].register_forward_pre_hook(abort_in_the_second_forward)
    streams = {
        name: engine.submit(EngineRequest(name, payload, StepBudget(payload.num_inference_steps)))
        for name, payload in (("survivor", survivor), ("doomed", doomed))
    }
    engine.start()
    try:
        ends = {name: [event async for event in stream][-1] for name, stream in streams.items()}
    finally:
        await asyncio.to_thread(engine.shutdown, True, 10)
    aborted, completed = ends["doomed"], ends["survivor"]
    assert isinstance(aborted, Aborted), aborted
    assert aborted.step_index == 1  # the second step's output is never published for it
    assert isinstance(completed, Completed), completed
    assert (completed.result.latents - guided_run.steps[-1]).abs().max().item() <= TOLERANCE
    assert len(forwards) == STEPS  # the doomed edit never ran alone


# -- refusals ------------------------------------------------------------------------------------

#: A good condition, and the latent cells of the longest side allowed -> the bad conditions.
Mutation = Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]

BAD_CONDITIONS: dict[str, Mutation] = {
    "none": lambda c, side: (),
    "two images": lambda c, side: (c, c),
    "4-d": lambda c, side: (c[:, :, 0],),
    "wrong channels": lambda c, side: (c[:, :8],),
    "two frames": lambda c, side: (torch.cat([c, c], dim=2),),
    "odd rows": lambda c, side: (c[..., :-1, :],),
    "batch of two": lambda c, side: (torch.cat([c, c]),),
    "integers": lambda c, side: (c.to(torch.int32),),
    "not finite": lambda c, side: (torch.where(c > 0, torch.inf, c),),
    "too many pixels": lambda c, side: (torch.zeros(1, 16, 1, side, side),),
    "too long a side": lambda c, side: (torch.zeros(1, 16, 1, 2, side + 2),),
}


@pytest.mark.parametrize("mutation", list(BAD_CONDITIONS), ids=list(BAD_CONDITIONS))
def test_bad_conditioning_is_refused_naming_the_field(
    dit: DenoiseAdapter, guided_run: StockRun, mutation: str
) -> None:
    good = _payload(_embeddings(1, 9, 5), guided_run.condition, cfg=4.0, seed=7)
    dit.check_inputs(good)
    side = dit.limits.max_side // dit.vae_scale_factor
    bad = replace(good, condition_latents=BAD_CONDITIONS[mutation](guided_run.condition, side))
    with pytest.raises(InvalidInputError) as info:
        dit.check_inputs(bad)
    assert info.value.field_name == "condition_latents"


def test_the_condition_size_follows_the_operator_limit(edit_dir: Path) -> None:
    """A condition image is bounded like the output: max_pixels covers both."""
    small = DenoiseAdapter(edit_dir, max_pixels=512 * 512)
    cells = 512 // small.vae_scale_factor
    fits = _payload(_embeddings(1, 4, None), torch.zeros(1, 16, 1, cells, cells), 1.0, seed=0)
    small.check_inputs(fits)
    wider = torch.zeros(1, 16, 1, cells, cells + 2)
    with pytest.raises(InvalidInputError, match="more than 262144 pixels") as info:
        small.check_inputs(replace(fits, condition_latents=(wider,)))
    assert info.value.field_name == "condition_latents"


def test_an_edit_model_takes_every_size_the_edit_rule_makes(dit: DenoiseAdapter) -> None:
    """The pipeline resizes the input to ~1024x1024 by its own rule (sides rounded to 32, so up
    to ~4% more pixels), and the output defaults to that size: by default the DiT takes both."""
    scale, max_side = dit.vae_scale_factor, dit.limits.max_side
    sizes = {edit_image_size(side, 1000) for side in range(100, 10_000, 13)}
    sizes |= {size[::-1] for size in sizes}  # portrait too
    sizes = {(width, height) for width, height in sizes if max(width, height) <= max_side}
    assert max(width * height for width, height in sizes) > 1024 * 1024
    for width, height in sorted(sizes):
        condition = torch.zeros(1, 16, 1, height // scale, width // scale)
        payload = _payload(_embeddings(1, 4, None), condition, cfg=1.0, seed=0)
        dit.check_inputs(replace(payload, height=height, width=width))


def test_a_text_to_image_model_refuses_any_condition(text_to_image_dir: Path) -> None:
    dit = DenoiseAdapter(text_to_image_dir)
    assert (dit.limits.task, dit.limits.max_condition_images) == ("text-to-image", 0)
    assert dit.limits.max_pixels == 1024 * 1024
    plain = DenoiseInput(_embeddings(1, 4, None), HEIGHT, WIDTH, STEPS, 1.0, 0)
    dit.check_inputs(plain)
    with pytest.raises(InvalidInputError, match="takes 0 condition_latents, got 1") as info:
        dit.check_inputs(replace(plain, condition_latents=(torch.zeros(1, 16, 1, 4, 4),)))
    assert info.value.field_name == "condition_latents"


def test_edit_prompts_may_carry_their_image_tokens(
    dit: DenoiseAdapter, text_to_image_dir: Path
) -> None:
    """An edit prompt's embeddings hold the input image's vision tokens too, so an edit model
    takes more tokens than a text prompt may have; still a bounded number."""
    cells = 1024 // dit.vae_scale_factor
    condition = torch.zeros(1, 16, 1, cells, cells)
    long = _payload(_embeddings(1, 1500, None), condition, cfg=1.0, seed=0)
    dit.check_inputs(long)
    with pytest.raises(InvalidInputError) as info:
        dit.check_inputs(replace(long, embeddings=_embeddings(1, 5000, None)))
    assert info.value.field_name == "embeddings"
    text_only = DenoiseAdapter(text_to_image_dir)
    with pytest.raises(InvalidInputError) as info:
        text_only.check_inputs(replace(long, condition_latents=()))
    assert info.value.field_name == "embeddings"
