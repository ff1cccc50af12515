"""tiny-shapes-video without a model: the clips, the held-out split and the judge (the training
path: tests/model/test_tiny_shapes_video.py)."""

from __future__ import annotations

import numpy as np
import pytest

from stagemesh.gateway.recipes import DEFAULT_RECIPES, Task, default_recipe, load_recipes
from stagemesh.models.tiny_shapes.data import BACKGROUNDS, COLOURS, SHAPES
from stagemesh.models.tiny_shapes.evaluate import DEFAULT_GUIDANCE, DEFAULT_STEPS
from stagemesh.models.tiny_shapes_video.data import (
    MOTIONS,
    NUM_FRAMES,
    PROMPT_TOKENS,
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
