"""tiny-shapes-edit with a model: the training path and the shipped weights (edits, split and
judge: tests/unit/test_tiny_shapes_edit_data.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stagemesh.models.families.qwen_image import condition_area, stock_condition_area
from stagemesh.models.families.qwen_vl_processor import install_processor_support
from stagemesh.models.tiny_shapes.data import parse_caption
from stagemesh.models.tiny_shapes_edit import SHIPPED_DIR
from stagemesh.models.tiny_shapes_edit.evaluate import (
    evaluate,
    held_out_sample,
    pipeline_generator,
)

#: The shipped model's floors on a 10-per-kind held-out sample, at the guidance it is served at
#: (`EDIT_GUIDANCE`): recolour and move are edited as asked (100% here, and on 60 through the
#: mesh), the held-out reshape (triangle->square) 80% here (87% on 60 through the mesh,
#: docs/edit-and-video.md), and what is kept (100% / 100% / 100% here) has floors.
EDITED_FLOORS = {"colour": 0.9, "position": 0.9, "shape": 0.6}
KEPT_FLOORS = {"colour": 0.8, "position": 0.9, "shape": 0.9}


def _weights(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes()
            for path in sorted(folder.rglob("*.safetensors"))}


@pytest.mark.slow
def test_smoke_training_writes_an_edit_folder_the_stock_pipeline_runs(tmp_path: Path) -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline

    from stagemesh.models.tiny_shapes_edit.train import EditTrainConfig, train

    out = train(tmp_path / "edit", config=EditTrainConfig.smoke())
    assert condition_area(out) == 32 * 32
    report = json.loads((out / "training.json").read_text())
    assert report["seed"] == 0 and report["config"]["steps"] == EditTrainConfig.smoke().steps
    assert report["load_average_1min"]["samples"] >= 1
    # Fixed seeds: the same weights bit for bit.
    again = train(tmp_path / "again", config=EditTrainConfig.smoke())
    assert _weights(out) == _weights(again)
    install_processor_support()
    pipe = QwenImageEditPipeline.from_pretrained(out, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    source = Image.fromarray(np.full((32, 32, 3), 200, dtype=np.uint8))
    with stock_condition_area(condition_area(out)):
        image = pipe(image=source, prompt="make it blue", negative_prompt="", true_cfg_scale=4.0,
                     height=32, width=32, num_inference_steps=2, output_type="np",
                     generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 32, 32, 3) and np.isfinite(image).all()


def test_the_text_encoder_from_base_takes_tiny_shapes_words_and_layers() -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    from stagemesh.models.registry import SHIPPED_TINY_SHAPES
    from stagemesh.models.tiny_shapes import train as base
    from stagemesh.models.tiny_shapes_edit.train import build_edit_tokenizer, text_encoder_from_base

    tokenizer = build_edit_tokenizer()
    torch.manual_seed(0)
    encoder = base.build_text_encoder(tokenizer, 64)
    built = {k: v.clone() for k, v in encoder.state_dict().items()}
    shared = text_encoder_from_base(encoder, tokenizer, SHIPPED_TINY_SHAPES)
    theirs = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        SHIPPED_TINY_SHAPES / "text_encoder").state_dict()
    their_vocab = Qwen2Tokenizer.from_pretrained(SHIPPED_TINY_SHAPES / "tokenizer").get_vocab()
    ours, vocab = encoder.state_dict(), tokenizer.get_vocab()
    assert 0 < shared < len(vocab)
    embedding = "model.language_model.embed_tokens.weight"
    assert torch.equal(ours[embedding][vocab["Ġsquare"]], theirs[embedding][their_vocab["Ġsquare"]])
    assert "Ġcentre" not in their_vocab  # the edit's own word keeps its built row
    assert torch.equal(ours[embedding][vocab["Ġcentre"]], built[embedding][vocab["Ġcentre"]])
    layer = "model.language_model.layers.1.mlp.down_proj.weight"
    assert torch.equal(ours[layer], theirs[layer]) and not torch.equal(ours[layer], built[layer])
    vision = next(k for k in ours if k.startswith("model.visual."))
    assert torch.equal(ours[vision], built[vision])


@pytest.mark.slow
def test_shipped_weights_edit_held_out_combinations(tmp_path: Path) -> None:
    metrics = evaluate(pipeline_generator(SHIPPED_DIR), tmp_path, held_out_sample(10))
    for kind, floor in EDITED_FLOORS.items():
        assert metrics["accuracy"][kind]["edited"] >= floor, metrics["accuracy"]
    for kind, floor in KEPT_FLOORS.items():
        assert metrics["accuracy"][kind]["kept"] >= floor, metrics["accuracy"]
    # The background is never touched by any kind of edit.
    assert all(r["seen"]["background"] == parse_caption(r["source"]).background
               for r in metrics["records"])
