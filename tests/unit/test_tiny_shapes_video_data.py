"""tiny-shapes-video without a model: the clips, the held-out split and the judge (the training
path: tests/model/test_tiny_shapes_video.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from stagemesh.cli import build_parser
from stagemesh.commands.train import _config as train_config
from stagemesh.gateway.recipes import DEFAULT_RECIPES, Task, default_recipe, load_recipes
from stagemesh.models.registry import SHIPPED_TINY_SHAPES_VIDEO
from stagemesh.models.tiny_shapes.data import BACKGROUNDS, COLOURS, SHAPES
from stagemesh.models.tiny_shapes.evaluate import DEFAULT_GUIDANCE, DEFAULT_STEPS
from stagemesh.models.tiny_shapes_video.data import (
    MOTIONS,
    NUM_FRAMES,
    PROMPT_TOKENS,
    centres,
    held_out_combinations,
    make_dataset,
    parse_clip_caption,
    render_clip,
    split,
)
from stagemesh.models.tiny_shapes_video.judge import (
    STILL,
    judge,
    judge_accuracy_on_renders,
    measure_clip,
)
from stagemesh.models.tiny_shapes_video.probe import swapped
from stagemesh.models.tiny_shapes_video.train import (
    VideoTrainConfig,
    flow_loss,
    latent_shape_weights,
)


def test_a_fifth_of_the_combinations_is_held_out_in_every_background() -> None:
    held = held_out_combinations()
    assert len(held) == round(0.2 * len(COLOURS) * len(SHAPES) * len(MOTIONS))
    training, held_out = split()
    assert {s.combination for s in training}.isdisjoint(held)
    assert {s.combination for s in held_out} == held
    assert len(held_out) == len(held) * len(BACKGROUNDS)
    assert held_out_combinations() == held  # fixed by its seed
    # Every value of every attribute is still trained on.
    for name, values in (("colour", COLOURS), ("shape", SHAPES), ("motion", MOTIONS)):
        assert {getattr(s, name) for s in training} == set(values)


def test_captions_round_trip_and_stay_in_the_grammar() -> None:
    training, held_out = split()
    for spec in training[::17] + held_out[::7]:
        assert parse_clip_caption(spec.caption) == spec
    assert parse_clip_caption("a blue square falling").motion == "falling"
    with pytest.raises(ValueError):
        parse_clip_caption("a blue square spinning")


def test_the_dataset_renders_training_clips_only() -> None:
    training, _ = split()
    clips, captions = make_dataset(training, 6, seed=3)
    assert clips.shape == (6, NUM_FRAMES, 32, 32, 3) and clips.dtype == np.uint8
    assert set(captions) <= {s.caption for s in training}
    again, _ = make_dataset(training, 6, seed=3)
    assert np.array_equal(clips, again)


@pytest.mark.parametrize("motion", list(MOTIONS))
def test_the_cross_range_bounds_where_the_path_sits_across_the_motion(motion: str) -> None:
    axis = 1 if MOTIONS[motion][0] else 0  # the coordinate that stays put
    for seed in range(20):
        path = centres(motion, np.random.default_rng(seed), cross_range=2.0)
        across = {point[axis] for point in path}
        assert len(across) == 1 and abs(across.pop() - 16) <= 2.0
        along = [point[1 - axis] for point in path]
        assert along == sorted(along, reverse=sum(MOTIONS[motion]) < 0)
    centred = centres(motion, np.random.default_rng(0), cross_range=0.0)
    assert all(point[axis] == 16 for point in centred)


def test_the_judge_passes_ground_truth_clips() -> None:
    assert judge_accuracy_on_renders(24) == {
        "shape_colour": 1.0, "motion": 1.0, "background": 1.0, "correct": 1.0}


@pytest.mark.parametrize("motion", list(MOTIONS))
def test_the_judge_fails_every_other_direction_and_a_still_clip(motion: str) -> None:
    spec = parse_clip_caption(f"a green triangle {motion} on a gray background")
    clip = render_clip(spec, np.random.default_rng(5))
    assert judge(clip, spec.caption)["correct"]
    for other in MOTIONS.keys() - {motion}:
        verdict = judge(clip, f"a green triangle {other} on a gray background")
        assert verdict == {"shape_colour": True, "motion": False, "background": True,
                           "correct": False}, other
    still = np.repeat(clip[:1], NUM_FRAMES, axis=0)
    assert measure_clip(still).motion == STILL
    assert not judge(still, spec.caption)["correct"]


def test_the_judge_reads_shape_and_colour_frame_by_frame() -> None:
    clip = render_clip(parse_clip_caption("a red circle moving left"), np.random.default_rng(2))
    square = render_clip(parse_clip_caption("a red square moving left"), np.random.default_rng(2))
    mixed = clip.copy()
    mixed[3] = square[3]  # one frame of 9 is a square: 89% < 90% of frames
    assert judge(mixed, "a red circle moving left")["shape_colour"] is False
    assert judge(clip, "a blue circle moving left")["shape_colour"] is False


def test_the_default_video_recipe_serves_the_model_as_it_was_trained() -> None:
    """An empty `model` gets tiny-shapes-video, its prompts read at the trained length (the
    transformer never saw Wan's 512 padded tokens), 9 frames of 32x32 at its evaluated steps."""
    recipes = load_recipes(DEFAULT_RECIPES)
    video = default_recipe(recipes, Task.TEXT_TO_VIDEO)
    assert video is not None and video.name == "tiny-shapes-video"
    assert video.stage("tokenizer").options["max_sequence_length"] == PROMPT_TOKENS
    defaults = video.video_defaults
    assert (defaults.width, defaults.height, defaults.num_frames) == (32, 32, NUM_FRAMES)
    assert (defaults.num_inference_steps, defaults.guidance_scale) == (DEFAULT_STEPS,
                                                                      DEFAULT_GUIDANCE)


@pytest.mark.parametrize("attribute", ["colour", "shape", "motion"])
def test_the_probe_swaps_one_attribute_and_keeps_the_rest(attribute: str) -> None:
    for spec in split()[0]:
        other = swapped(spec, attribute)
        assert getattr(other, attribute) != getattr(spec, attribute)
        kept = {"colour", "shape", "motion", "background"} - {attribute}
        assert all(getattr(other, a) == getattr(spec, a) for a in kept)
        assert parse_clip_caption(other.caption) == other  # still in the grammar
        if attribute == "motion":  # the opposite direction: the layout over frames mirrored
            (dx, dy), (ox, oy) = MOTIONS[spec.motion], MOTIONS[other.motion]
            assert (ox, oy) == (-dx, -dy)


class _Truth(torch.nn.Module):
    """A transformer that predicts the flow target exactly, plus `offset`."""

    def __init__(self, x0: torch.Tensor, offset: torch.Tensor) -> None:
        super().__init__()
        self.x0, self.offset = x0, offset

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                **_: object) -> tuple[torch.Tensor]:
        s = (timestep / 1000.0).view(-1, 1, 1, 1, 1)
        noise = (hidden_states - (1.0 - s) * self.x0) / s
        return (noise - self.x0 + self.offset,)


def test_the_motion_weight_charges_only_errors_that_vary_across_frames() -> None:
    x0 = torch.randn(2, 16, 3, 4, 4)
    steady = torch.full_like(x0, 0.1)  # the same error in every latent frame
    varying = steady.clone()
    varying[:, :, 0] = -0.1  # the first frame's error differs from the others'

    def loss(offset: torch.Tensor, motion_weight: float) -> float:
        pipe: Any = SimpleNamespace(  # what flow_loss reads of a WanPipeline
            transformer=_Truth(x0, offset),
            scheduler=SimpleNamespace(config=SimpleNamespace(num_train_timesteps=1000)),
            encode_prompt=lambda *_, **__: (torch.zeros(2, PROMPT_TOKENS, 8),))
        cfg = VideoTrainConfig(motion_weight=motion_weight)
        return float(flow_loss(pipe, x0, ["", ""], torch.Generator().manual_seed(0), cfg))

    assert loss(steady, 0.0) == pytest.approx(0.01, rel=1e-4)
    assert loss(steady, 4.0) == pytest.approx(0.01, rel=1e-4)
    assert loss(varying, 0.0) == pytest.approx(0.01, rel=1e-4)  # plain MSE: the same cost
    # deviation from the frame mean: 2/3 * 0.2 in one frame, 1/3 * 0.2 in two -> 0.2^2 * 2/9
    assert loss(varying, 4.0) == pytest.approx(0.01 + 4.0 * 0.04 * 2 / 9, rel=1e-4)


def test_the_shape_weight_falls_on_the_latent_pixels_each_latent_frame_covers() -> None:
    """Wan's causal VAE encodes frame 0 alone, then 4 frames per latent frame: a latent pixel
    weighs more where the shape is in any frame its latent frame covers, 1 elsewhere."""
    clips = np.zeros((1, NUM_FRAMES, 32, 32, 3), np.uint8)  # a black background
    clips[0, 0, 0:4, 0:4] = 255  # frame 0: latent pixel (0, 0)
    clips[0, 3, 12:14, 16:18] = 255  # frame 3 (latent frame 1): latent pixel (3, 4)
    clips[0, 8, 28:32, 26:30] = 255  # frame 8 (latent frame 2): latent pixels (7, 6), (7, 7)
    weights = latent_shape_weights(clips, 5.0)
    assert weights.shape == (1, 1, 3, 8, 8)
    expected = torch.ones(3, 8, 8)
    expected[0, 0, 0] = expected[1, 3, 4] = expected[2, 7, 6] = expected[2, 7, 7] = 5.0
    assert torch.equal(weights[0, 0], expected)
    assert torch.equal(latent_shape_weights(clips, 1.0), torch.ones(1, 1, 3, 8, 8))
    # the first latent frame (frame 0 alone) weighs `first_frame` times more, shape or not
    first = latent_shape_weights(clips, 5.0, first_frame=3.0)
    assert torch.equal(first[0, 0, 0], 3.0 * expected[0])
    assert torch.equal(first[0, 0, 1:], expected[1:])


def test_the_flow_loss_weighs_each_latent_pixel_as_asked() -> None:
    x0 = torch.randn(1, 16, 3, 4, 4)
    error = torch.zeros_like(x0)
    error[:, :, :, 0, 0] = 0.1  # wrong only at one latent pixel of each latent frame
    pipe: Any = SimpleNamespace(
        transformer=_Truth(x0, error),
        scheduler=SimpleNamespace(config=SimpleNamespace(num_train_timesteps=1000)),
        encode_prompt=lambda *_, **__: (torch.zeros(1, PROMPT_TOKENS, 8),))
    weights = torch.ones(1, 1, 3, 4, 4)

    def loss(w: torch.Tensor | None) -> float:
        return float(flow_loss(pipe, x0, [""], torch.Generator().manual_seed(0),
                               VideoTrainConfig(), w))

    plain = 0.01 / 16
    assert loss(None) == pytest.approx(plain, rel=1e-4)
    weights[:, :, :, 0, 0] = 5.0  # the erring pixel weighs 5: the loss x5
    assert loss(weights) == pytest.approx(5 * plain, rel=1e-4)
    weights[:, :, :, 0, 0], weights[:, :, :, 1, 1] = 1.0, 5.0  # another pixel: no change
    assert loss(weights) == pytest.approx(plain, rel=1e-4)


def test_stagemesh_train_takes_config_overrides() -> None:
    """`stagemesh train MODEL --set key=value ...` sets fields of the model's training config,
    so a run of any config is one command."""
    args = build_parser().parse_args(["train", "tiny-shapes-video", "--threads", "2",
                                      "--set", "dit_steps=7", "dit_lr=0.5"])
    cfg = train_config(VideoTrainConfig(), args)
    assert (cfg.threads, cfg.dit_steps, cfg.dit_lr) == (2, 7, 0.5)
    assert cfg.dit_batch == VideoTrainConfig().dit_batch  # the rest as given


def test_the_default_config_is_the_shipped_run() -> None:
    """`stagemesh train tiny-shapes-video` with no flags reproduces the shipped folder: its
    training.json records the config it was trained with."""
    shipped = json.loads((SHIPPED_TINY_SHAPES_VIDEO / "training.json").read_text())
    assert shipped["config"] == asdict(VideoTrainConfig())
    assert shipped["seed"] == 0 and shipped["dit_steps_done"] == VideoTrainConfig().dit_steps
