"""The built-in edit and video models: real diffusers folders the stock pipelines load.

`builtin:qwen-image-edit-tiny`, `builtin:wan-t2v-tiny` and `builtin:wan-i2v-tiny` must load with
`QwenImageEditPipeline` / `WanPipeline` / `WanImageToVideoPipeline.from_pretrained` (offline),
generate deterministically per seed, keep their layout facts (the two Wan 2.2 experts, the I2V
channel count, the Pil image processor), and be rebuilt when their build stamp changes. The
family helpers the stages share must reproduce what the stock pipelines do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
from PIL import Image

from stagemesh.models import qwen_image, qwen_image_edit, wan
from stagemesh.models.families import qwen_image as qwen_family
from stagemesh.models.families.qwen_vl_processor import (
    install_processor_support,
    load_vl_processor,
)
from stagemesh.models.families.wan import (
    WanGeometry,
    i2v_condition_mask,
    read_boundary_ratio,
    round_num_frames,
)
from stagemesh.models.registry import resolve_model

PROMPT = "a red square slides to the left"
SIZE, FRAMES = 32, 5


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


PipelineT = TypeVar("PipelineT", QwenImageEditPipeline, WanPipeline, WanImageToVideoPipeline)


def _stock(pipeline_class: type[PipelineT], builtin: str) -> PipelineT:
    """The stock pipeline loaded offline from the built-in folder."""
    pipe = pipeline_class.from_pretrained(resolve_model(f"builtin:{builtin}"),
                                          local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def edit_pipe() -> QwenImageEditPipeline:
    install_processor_support()
    return _stock(QwenImageEditPipeline, "qwen-image-edit-tiny")


@pytest.fixture(scope="module")
def t2v_pipe() -> WanPipeline:
    return _stock(WanPipeline, "wan-t2v-tiny")


@pytest.fixture(scope="module")
def i2v_pipe() -> WanImageToVideoPipeline:
    return _stock(WanImageToVideoPipeline, "wan-i2v-tiny")


def _spy(module: torch.nn.Module, name: str, seen: list[Any]) -> None:
    """Record the first positional argument of every call of `module.name`."""
    original = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(args[0] if args else next(iter(kwargs.values())))
        return original(*args, **kwargs)

    setattr(module, name, spy)


def test_the_edit_folder_runs_as_the_stock_pipeline_and_the_helpers_match_it(
    edit_pipe: QwenImageEditPipeline,
) -> None:
    processor = edit_pipe.processor
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert edit_pipe.text_encoder.config.vision_config.depth == 1
    for token in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"):
        assert token in edit_pipe.tokenizer.get_vocab()

    source = _image(64, 48)
    vae_inputs: list[torch.Tensor] = []
    vision_inputs: list[torch.Tensor] = []
    _spy(edit_pipe.vae, "encode", vae_inputs)
    encoder_forward = edit_pipe.text_encoder.forward

    def encoder_spy(*args: Any, **kwargs: Any) -> Any:
        vision_inputs.append(kwargs["pixel_values"])
        return encoder_forward(*args, **kwargs)

    edit_pipe.text_encoder.forward = encoder_spy
    try:
        out = edit_pipe(image=source, prompt=PROMPT, num_inference_steps=2, height=64, width=64,
                        generator=torch.Generator().manual_seed(0), output_type="np").images
    finally:  # drop the instance attributes: the class methods are back
        del edit_pipe.vae.encode, edit_pipe.text_encoder.forward
    assert out.shape == (1, 64, 64, 3) and np.isfinite(out).all()

    # The shared rules: the resize both the processor and the VAE see, and the VAE's input.
    width, height = qwen_family.edit_image_size(64, 48)
    assert (width, height) == (1184, 896)  # calculate_dimensions(1024*1024, 4/3)
    resized = qwen_family.resize_edit_image(source)
    assert resized.size == (1184, 896)
    vision_prompt = "<|vision_start|><|image_pad|><|vision_end|>"
    expected_vision = processor(text=[vision_prompt], images=resized, return_tensors="pt")
    assert torch.equal(vision_inputs[0], expected_vision["pixel_values"])
    assert vae_inputs[0].shape == (1, 3, 1, 896, 1184)  # the VAE encodes the same size
    multiple = qwen_family.latent_factor(resolve_model("builtin:qwen-image-edit-tiny"))
    assert multiple == 32  # the edit preset's 16x VAE, times 2 for packing

    loaded = load_vl_processor(resolve_model("builtin:qwen-image-edit-tiny"))
    assert loaded.image_processor.size == processor.image_processor.size
    with pytest.raises(ValueError, match="images only"):
        loaded.video_processor(videos=[np.zeros((2, 28, 28, 3), np.uint8)])


def test_the_edit_weights_come_from_the_seeded_builders() -> None:
    """The folder's transformer is exactly the seeded builder's; another seed differs."""
    folder = resolve_model("builtin:qwen-image-edit-tiny")
    from safetensors.torch import load_file

    stored = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    spec = qwen_image.PRESETS[qwen_image_edit.PRESET]

    def build(seed: int) -> dict[str, torch.Tensor]:
        model = qwen_image.seeded(seed, 3, lambda: qwen_image._build_transformer(spec))
        return dict(model.state_dict())

    same, other = build(0), build(1)
    assert stored.keys() == same.keys()
    assert all(torch.equal(stored[k], same[k]) for k in stored)
    assert not all(torch.equal(stored[k], other[k]) for k in stored)


def test_text_to_video_is_deterministic_per_seed(t2v_pipe: WanPipeline) -> None:
    def run(seed: int) -> np.ndarray:
        frames: np.ndarray = t2v_pipe(
            prompt=PROMPT, negative_prompt="blurry", height=SIZE, width=SIZE, num_frames=FRAMES,
            num_inference_steps=3, guidance_scale=5.0,
            generator=torch.Generator().manual_seed(seed), output_type="np").frames
        return frames

    first, again, other = run(0), run(0), run(1)
    assert first.shape == (1, FRAMES, SIZE, SIZE, 3)
    assert np.array_equal(first, again)
    assert not np.allclose(first, other)
    config = t2v_pipe.scheduler.config
    assert config.prediction_type == "flow_prediction" and config.use_flow_sigmas
    assert config.flow_shift == wan.PRESETS["t2v"].flow_shift
    assert t2v_pipe.transformer_2 is None and t2v_pipe.config["boundary_ratio"] is None


def test_image_to_video_uses_both_experts_and_the_first_frame_mask(
    i2v_pipe: WanImageToVideoPipeline,
) -> None:
    folder = resolve_model("builtin:wan-i2v-tiny")
    geometry = WanGeometry.from_folder(folder)
    assert i2v_pipe.image_encoder is None
    assert i2v_pipe.transformer.config.in_channels == 2 * geometry.z_dim + 4
    assert read_boundary_ratio(folder) == i2v_pipe.config["boundary_ratio"] == 0.9

    experts: list[str] = []
    conditions: list[torch.Tensor] = []
    for name in ("transformer", "transformer_2"):
        module = getattr(i2v_pipe, name)
        original = module.forward

        def forward(*args: Any, _original: Any = original, _name: str = name,
                    **kwargs: Any) -> Any:
            experts.append(_name)
            conditions.append(kwargs["hidden_states"][:, geometry.z_dim:])
            return _original(*args, **kwargs)

        module.forward = forward
    try:
        frames = i2v_pipe(image=_image(SIZE, SIZE), prompt=PROMPT, height=SIZE, width=SIZE,
                          num_frames=FRAMES, num_inference_steps=4, guidance_scale=1.0,
                          generator=torch.Generator().manual_seed(0), output_type="np").frames
    finally:
        del i2v_pipe.transformer.forward, i2v_pipe.transformer_2.forward
    assert frames.shape == (1, FRAMES, SIZE, SIZE, 3)
    assert experts == ["transformer"] * 2 + ["transformer_2"] * 2  # flow_shift 5, boundary 0.9
    lat = SIZE // geometry.spatial_factor
    mask = i2v_condition_mask(FRAMES, geometry.temporal_factor, lat, lat)
    assert torch.equal(conditions[0][:, :4], mask)


def test_the_wan_geometry_rules_are_the_pipelines() -> None:
    geometry = WanGeometry.from_folder(resolve_model("builtin:wan-t2v-tiny"))
    assert (geometry.temporal_factor, geometry.spatial_factor, geometry.z_dim) == (4, 8, 16)
    assert geometry.size_multiple == (16, 16) and geometry.frame_multiple == 4
    assert [round_num_frames(n, 4) for n in (1, 2, 5, 8, 9, 10)] == [1, 1, 5, 9, 9, 9]
    assert geometry.latent_shape(9, 32, 48) == (16, 3, 4, 6)
    latents = torch.randn(1, 16, 2, 4, 4)
    assert torch.allclose(geometry.denormalize(geometry.normalize(latents)), latents, atol=1e-5)


def test_a_folder_is_rebuilt_when_its_stamp_changes(tmp_path: Path) -> None:
    folder = wan.ensure_wan_model("t2v", root=tmp_path)
    stamp_file = folder / qwen_image.BUILD_STAMP
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    built = weights.stat().st_ino
    assert wan.ensure_wan_model("t2v", root=tmp_path) == folder
    assert weights.stat().st_ino == built  # current: reused as it is

    stamp = json.loads(stamp_file.read_text())
    stamp["builder_version"] = -1  # as if an older builder had written it
    stamp_file.write_text(json.dumps(stamp))
    assert wan.ensure_wan_model("t2v", root=tmp_path) == folder
    assert weights.stat().st_ino != built  # rebuilt
    assert json.loads(stamp_file.read_text()) == wan.build_stamp("t2v", 0)
    assert WanPipeline.from_pretrained(folder, local_files_only=True).transformer is not None
