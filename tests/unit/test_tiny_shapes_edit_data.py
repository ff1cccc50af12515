"""tiny-shapes-edit without a model: the edits, the held-out split, the judge, and the folder's
condition area (the training path and the shipped weights: tests/model/test_tiny_shapes_edit.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stagemesh.models.families.qwen_image import (
    CONDITION_FILE,
    EDIT_IMAGE_AREA,
    condition_area,
    edit_image_size,
    write_condition_area,
)
from stagemesh.models.tiny_shapes.scoring import measure
from stagemesh.models.tiny_shapes_edit.data import (
    KINDS,
    held_out_combinations,
    make_dataset,
    render_pair,
    split,
)
from stagemesh.models.tiny_shapes_edit.judge import judge, judge_accuracy_on_renders


def test_a_fifth_of_each_kinds_combinations_is_held_out_and_never_trained() -> None:
    held = held_out_combinations()
    for kind, values in KINDS.items():
        pairs = len(values) * (len(values) - 1)
        assert sum(1 for k, _, _ in held if k == kind) == max(1, round(0.2 * pairs))
    training, held_out = split()
    assert {e.combination for e in training}.isdisjoint(held)
    assert {e.combination for e in held_out} == held
    assert held_out_combinations() == held  # fixed by its seed


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


def test_balanced_kinds_give_each_kind_a_third_of_the_pairs() -> None:
    training, _ = split()
    kind_of = {e.instruction: e.kind for e in training}
    _, _, instructions = make_dataset(training, 90, seed=3, balance_kinds=True)
    assert [kind_of[i] for i in instructions].count("shape") == 30
    assert {kind_of[i] for i in instructions[:12]} == set(KINDS), "the kinds are interleaved"
    _, _, unbalanced = make_dataset(training, 90, seed=3)
    assert [kind_of[i] for i in unbalanced].count("shape") < 30  # 19% of the edits


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
