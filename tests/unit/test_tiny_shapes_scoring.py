"""tiny-shapes without a model: grammar, renderer, scorer and the evaluation harness."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFilter

from stagemesh.models.tiny_shapes.data import (
    BACKGROUNDS,
    COLOURS,
    IMAGE_SIZE,
    Spec,
    all_specs,
    make_dataset,
    parse_caption,
    render,
)
from stagemesh.models.tiny_shapes.evaluate import VALUES, all_prompts, evaluate, subset_prompts
from stagemesh.models.tiny_shapes.scoring import (
    ATTRIBUTES,
    measure,
    score,
    scorer_accuracy_on_renders,
)

# --- grammar and renderer ---------------------------------------------------------------------


def test_grammar_has_270_distinct_captions_in_the_documented_form() -> None:
    captions = [spec.caption for spec in all_specs()]
    assert len(captions) == len(set(captions)) == 6 * 3 * 5 * 3
    assert "a red circle" in captions
    assert "a blue square on the left on a black background" in captions
    assert "a purple triangle at the bottom on a gray background" in captions
    assert parse_caption("a green square at the top") == Spec("green", "square", "top", "white")
    with pytest.raises(ValueError, match="not in the tiny-shapes grammar"):
        parse_caption("a pink circle")


def test_dataset_is_deterministic_and_balanced() -> None:
    images, captions = make_dataset(540, seed=0)
    again, again_captions = make_dataset(540, seed=0)
    other, _ = make_dataset(540, seed=1)
    assert images.shape == (540, IMAGE_SIZE, IMAGE_SIZE, 3) and images.dtype == np.uint8
    assert np.array_equal(images, again) and captions == again_captions
    assert not np.array_equal(images, other)
    assert set(Counter(captions).values()) == {2}


def test_render_draws_the_named_colour_on_the_named_background() -> None:
    image = render(Spec("red", "circle", "left", "black")).astype(int)
    assert tuple(image[0, 0]) == BACKGROUNDS["black"]
    assert tuple(image[16, 8]) == COLOURS["red"]
    assert tuple(image[16, 24]) == BACKGROUNDS["black"]


# --- scorer -----------------------------------------------------------------------------------


def test_scorer_is_right_on_every_jittered_ground_truth_render() -> None:
    accuracy = scorer_accuracy_on_renders(n=810, seed=7)
    assert accuracy == dict.fromkeys(ATTRIBUTES, 1.0)


def test_scorer_survives_blur_like_a_vae_reconstruction() -> None:
    images, captions = make_dataset(270, seed=3)
    blurred = [np.asarray(Image.fromarray(i).filter(ImageFilter.GaussianBlur(0.8))) for i in images]
    hits = np.array([[score(b, c)[n] for n in ATTRIBUTES] for b, c in zip(blurred, captions,
                                                                           strict=True)])
    assert hits.mean(axis=0).min() >= 0.98


def test_scorer_reads_wrong_attributes_as_wrong() -> None:
    image = render(Spec("blue", "square", "right", "gray"))
    assert score(image, "a red triangle on the left") == {
        "colour": False, "shape": False, "position": False, "background": False}
    seen = measure(image)
    assert (seen.colour, seen.shape, seen.position, seen.background) == (
        "blue", "square", "right", "gray")


def test_scorer_rejects_non_uint8_images() -> None:
    with pytest.raises(ValueError, match="uint8"):
        measure(np.zeros((32, 32, 3), dtype=np.float32))


# --- evaluation harness -----------------------------------------------------------------------


def test_subset_prompts_is_stable_and_covers_every_value() -> None:
    subset = subset_prompts(12)
    assert subset == subset_prompts(12) and len(subset) == len(set(subset)) == 12
    assert subset_prompts(20)[:12] == subset
    specs = [parse_caption(p) for p in subset]
    for name, values in VALUES.items():
        assert {getattr(s, name) for s in specs} == set(values)
    with pytest.raises(ValueError, match="at least 6"):
        subset_prompts(5)


def test_evaluate_scores_a_perfect_and_a_constant_generator(tmp_path: Path) -> None:
    def perfect(prompt: str, seed: int) -> np.ndarray:
        return render(parse_caption(prompt))

    def always_red_circle(prompt: str, seed: int) -> np.ndarray:
        return render(Spec("red", "circle", "centre", "white"))

    prompts = subset_prompts(18)
    good = evaluate(perfect, tmp_path / "good", prompts)
    assert good["accuracy"] == dict.fromkeys(ATTRIBUTES, 1.0) and good["n"] == 18
    written = json.loads((tmp_path / "good" / "metrics.json").read_text())
    assert written["accuracy"] == good["accuracy"] and set(written["methods"]) == set(ATTRIBUTES)
    # 18 cells of 5x-upscaled 32 px images plus a 52 px label, 15 to a row: 15 x 2 cells.
    assert Image.open(tmp_path / "good" / "grid.png").size == (15 * 160, 2 * (160 + 52))

    bad = evaluate(always_red_circle, tmp_path / "bad", all_prompts())
    assert bad["accuracy"]["colour"] == pytest.approx(1 / 6)
    assert bad["accuracy"]["shape"] == pytest.approx(1 / 3)
    assert bad["confusion"]["colour"]["blue"] == {**dict.fromkeys(COLOURS, 0), "red": 45}


def test_evaluate_rejects_a_generator_returning_floats(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must return uint8"):
        evaluate(lambda p, s: np.zeros((32, 32, 3)), tmp_path, ["a red circle"])


def test_scaled_renders_keep_off_the_border_ring() -> None:
    _, captions = make_dataset(270, seed=5)
    styled, styled_captions = make_dataset(270, seed=5, scale=1.5)
    assert styled_captions == captions
    # larger shapes keep off the border ring the scorer reads the background from
    ring = np.concatenate([styled[:, 0], styled[:, -1], styled[:, :, 0], styled[:, :, -1]], 1)
    backgrounds = np.array([BACKGROUNDS[parse_caption(c).background] for c in captions])
    assert np.abs(ring.astype(int) - backgrounds[:, None]).max() <= 2


def test_the_lora_style_is_scored_as_an_effect_and_keeps_every_other_attribute() -> None:
    from stagemesh.models.tiny_shapes.lora import STYLE_BACKGROUND, effect_scores

    base, captions = make_dataset(270, seed=5)
    styled, styled_captions = make_dataset(270, seed=5, background=STYLE_BACKGROUND)
    assert styled_captions == captions
    asked = [parse_caption(c).background for c in captions]
    # same jitter: the renders whose caption names the style's background are the base's own
    same = np.array([a == STYLE_BACKGROUND for a in asked])
    assert np.array_equal(styled[same], base[same]) and not np.array_equal(styled, base)
    assert effect_scores(list(base), captions)["effect"] == 0.0
    scores = effect_scores(list(styled), captions)
    assert scores["effect"] == 1.0
    assert all(scores[name] == 1.0 for name in ("colour", "shape", "position"))
    assert scores["background"] == round(same.mean(), 4)  # the prompts that asked for it
