"""Seeded LoRA adapter files for a Qwen-Image transformer, as diffusers writes them."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import QwenImagePipeline
from safetensors.torch import save_file

from stagemesh.bench.lora import TARGETS, lora_layers

#: Wan's self- and cross-attention projections and the first feed-forward Linear.
WAN_TARGETS = ("attn1.to_q", "attn1.to_v", "attn2.to_k", "attn2.to_out.0", "ffn.net.0.proj")
__all__ = ["TARGETS", "WAN_TARGETS", "lora_layers", "write_adapter"]


def write_adapter(
    transformer: torch.nn.Module, root: Path, name: str, rank: int, seed: int,
    alpha: int | None = None, bare: bool = False,
) -> None:  # fmt: skip
    """`root/name/pytorch_lora_weights.safetensors` through `save_lora_weights` (with PEFT's
    r/lora_alpha metadata when `alpha` is given), or (bare) `root/name.safetensors` without
    metadata (alpha = rank)."""
    layers = lora_layers(transformer, rank, seed)
    if bare:
        save_file({f"transformer.{k}": v for k, v in layers.items()}, root / f"{name}.safetensors")
        return
    metadata = None
    if alpha is not None:
        targets = sorted({k.split(".lora_")[0] for k in layers})
        metadata = {"r": rank, "lora_alpha": alpha, "target_modules": targets}
    QwenImagePipeline.save_lora_weights(
        root / name, transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata
    )
