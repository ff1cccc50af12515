"""tiny-shapes-edit without a model: the edits, the held-out split, the judge, and the folder's
condition area (the training path and the shipped weights: tests/model/test_tiny_shapes_edit.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline

from stagemesh.models.families.qwen_image import (
    CONDITION_FILE,
    EDIT_IMAGE_AREA,
    condition_area,
    edit_image_size,
    write_condition_area,
)
from stagemesh.models.tiny_shapes.data import DISTRACTOR_SHAPES, SHAPES
from stagemesh.models.tiny_shapes.scoring import measure
from stagemesh.models.tiny_shapes_edit.data import (
    KINDS,
    held_out_combinations,
    make_dataset,
    pick_edits,
    render_pair,
    split,
    with_distractor,
)
from stagemesh.models.tiny_shapes_edit.judge import judge, judge_accuracy_on_renders
from stagemesh.models.tiny_shapes_edit.train import edit_loss, pair_shape_weights


def test_a_fifth_of_each_kinds_combinations_is_held_out_and_never_trained() -> None:
    held = held_out_combinations()
    for kind, values in KINDS.items():
        pairs = len(values) * (len(values) - 1)
        assert sum(1 for k, _, _ in held if k == kind) == max(1, round(0.2 * pairs))
    training, held_out = split()
    assert {e.combination for e in training}.isdisjoint(held)
    assert {e.combination for e in held_out} == held
    assert held_out_combinations() == held  # fixed by its seed


def test_no_op_edits_add_one_instruction_per_kind_whose_target_is_the_source() -> None:
    plain, held_out = split()
    training, held_out_too = split(no_ops=True)
    assert held_out_too == held_out
    added = training[len(plain):]
    assert training[:len(plain)] == plain and len(added) == 270 * len(KINDS)
    assert all(edit.target == edit.source for edit in added)
    assert {e.combination for e in added}.isdisjoint(held_out_combinations())
    source, target = render_pair(added[0], np.random.default_rng(2))
    np.testing.assert_array_equal(source, target)


def test_a_pair_differs_only_in_the_edited_attribute() -> None:
    rng = np.random.default_rng(0)
    training, _ = split()
    for edit in training[::97]:
        source, target = (measure(image).as_spec() for image in render_pair(edit, rng))
        assert source == edit.source and target == edit.target, edit


def test_the_dataset_cycles_through_training_edits_only() -> None:
    training, _ = split()
    sources, targets, instructions = make_dataset(training, 40, seed=3)
    assert sources.shape == targets.shape == (40, 32, 32, 3)
    assert set(instructions) <= {e.instruction for e in training}


def test_distractor_sources_keep_their_shape_unless_reshaped_and_hold_nothing_out() -> None:
    training, _ = split()
    by_kind = {kind: next(e for e in training if e.kind == kind) for kind in KINDS}
    for kind, edit in by_kind.items():
        moved = with_distractor(edit, "plus")
        assert moved.source.shape == "plus" and moved.instruction == edit.instruction
        assert moved.target.shape == (edit.value if kind == "shape" else "plus")
        assert moved.combination not in held_out_combinations()
    source, target = render_pair(with_distractor(by_kind["colour"], "diamond"),
                                 np.random.default_rng(0))
    assert measure(target).colour == by_kind["colour"].value
    assert not np.array_equal(source, render_pair(by_kind["colour"], np.random.default_rng(0))[0])
    assert set(DISTRACTOR_SHAPES).isdisjoint(SHAPES)


def test_a_distractor_fraction_swaps_that_share_of_sources_and_nothing_else() -> None:
    training, _ = split()
    world = pick_edits(training, 600, np.random.default_rng(4), balance_kinds=True)
    mixed = pick_edits(training, 600, np.random.default_rng(4), balance_kinds=True,
                       distractors=0.5)
    swapped = [m for w, m in zip(world, mixed, strict=True) if m != w]
    assert 0.4 < len(swapped) / 600 < 0.6
    assert {m.source.shape for m in swapped} == set(DISTRACTOR_SHAPES)
    assert all(with_distractor(w, m.source.shape) == m
               for w, m in zip(world, mixed, strict=True) if m != w), "only the source's shape"


def test_balanced_kinds_give_each_kind_a_third_of_the_pairs() -> None:
    training, _ = split()
    kind_of = {e.instruction: e.kind for e in training}
    _, _, instructions = make_dataset(training, 90, seed=3, balance_kinds=True)
    assert [kind_of[i] for i in instructions].count("shape") == 30
    assert {kind_of[i] for i in instructions[:12]} == set(KINDS), "the kinds are interleaved"
    _, _, unbalanced = make_dataset(training, 90, seed=3)
    assert [kind_of[i] for i in unbalanced].count("shape") < 30  # 19% of the edits


def test_a_reshape_share_gives_the_reshapes_that_share_and_splits_the_rest() -> None:
    training, _ = split()
    picked = pick_edits(training, 200, np.random.default_rng(0), balance_kinds=True,
                        reshape_share=0.45)
    counts = {kind: [e.kind for e in picked].count(kind) for kind in KINDS}
    assert counts == {"colour": 55, "position": 55, "shape": 90}
    with pytest.raises(ValueError, match="reshape_share"):
        pick_edits(training, 200, np.random.default_rng(0), reshape_share=0.45)
    with pytest.raises(ValueError, match="reshape_share"):
        pick_edits(training, 200, np.random.default_rng(0), balance_kinds=True, reshape_share=1.0)


def test_the_judge_passes_true_targets_and_fails_an_unedited_source() -> None:
    assert all(v == 1.0 for kind in judge_accuracy_on_renders(30).values() for v in kind.values())
    _, held_out = split()
    edit = held_out[0]
    source, target = render_pair(edit, np.random.default_rng(1))
    assert judge(edit, target) == {"edited": True, "kept": True}
    assert judge(edit, source)["edited"] is False


def test_a_folder_without_a_condition_file_conditions_at_the_stock_area(tmp_path: Path) -> None:
    assert condition_area(tmp_path) == EDIT_IMAGE_AREA
    write_condition_area(tmp_path, 32 * 32)
    assert condition_area(tmp_path) == 1024
    assert edit_image_size(40, 30, condition_area(tmp_path)) == (32, 32)
    (tmp_path / CONDITION_FILE).write_text('{"condition_area": "big"}')
    with pytest.raises(ValueError, match="condition_area"):
        condition_area(tmp_path)


def test_the_shape_weight_covers_the_source_and_the_target_shape() -> None:
    sources = np.zeros((1, 32, 32, 3), np.uint8)
    targets = sources.copy()
    sources[0, 0:4, 0:4] = 255  # latent pixel (0, 0) at 4x
    targets[0, 28:32, 24:28] = 255  # latent pixel (7, 6)
    weights = pair_shape_weights(sources, targets, 3.0, factor=4)
    expected = torch.ones(1, 1, 8, 8)
    expected[0, 0, 0, 0] = expected[0, 0, 7, 6] = 3.0
    assert torch.equal(weights, expected)


class _PackedTruth(torch.nn.Module):
    """An edit transformer that predicts the packed flow target exactly, plus `offset`."""

    def __init__(self, x0: torch.Tensor, offset: torch.Tensor) -> None:
        super().__init__()
        self.x0, self.offset = _pack(x0), _pack(offset)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                **_: object) -> tuple[torch.Tensor]:
        n, s = self.x0.shape[1], timestep.view(-1, 1, 1)
        noise = (hidden_states[:, :n] - (1.0 - s) * self.x0) / s
        return (torch.cat([noise - self.x0 + self.offset, hidden_states[:, n:]], dim=1),)


def _pack(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    packed: torch.Tensor = QwenImageEditPipeline._pack_latents(latents, b, c, h, w)
    return packed


def test_the_edit_loss_weighs_each_latent_pixel_as_asked() -> None:
    x0 = torch.randn(1, 16, 4, 4)
    error = torch.zeros_like(x0)
    error[:, :, 0, 0] = 0.1  # wrong only at one latent pixel
    pipe: Any = SimpleNamespace(  # what edit_loss reads of a QwenImageEditPipeline
        transformer=_PackedTruth(x0, error), _pack_latents=QwenImageEditPipeline._pack_latents,
        encode_prompt=lambda *_, **__: (torch.zeros(1, 4, 8), torch.ones(1, 4)))
    weights = torch.ones(1, 1, 4, 4)

    def loss(w: torch.Tensor | None) -> float:
        return float(edit_loss(pipe, x0, torch.zeros_like(x0), [], [""],
                               torch.Generator().manual_seed(0), w))

    plain = 0.01 / 16
    assert loss(None) == pytest.approx(plain, rel=1e-4)
    weights[:, :, 0, 0] = 5.0  # the erring pixel weighs 5 (as packed): the loss x5
    assert loss(weights) == pytest.approx(5 * plain, rel=1e-4)
    weights[:, :, 0, 0], weights[:, :, 3, 3] = 1.0, 5.0  # another pixel: no change
    assert loss(weights) == pytest.approx(plain, rel=1e-4)
