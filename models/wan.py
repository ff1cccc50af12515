"""Seeded random-weight Wan video models in the real diffusers folder layouts.

Two folders, both loaded by the stock pipelines' `from_pretrained` like a real checkpoint:

  t2v  Wan 2.1-style `WanPipeline`: UMT5 text encoder, one `WanTransformer3DModel`,
       `AutoencoderKLWan`, `UniPCMultistepScheduler` configured as Wan's (flow prediction,
       flow_shift).
  i2v  Wan 2.2 A14B-style `WanImageToVideoPipeline`: no image encoder; a high-noise
       `transformer` and a low-noise `transformer_2` split at `boundary_ratio`; the transformers
       take noise + first-frame mask + condition latents (2 * z_dim + 4 channels).

The tokenizer is T5-style (a Unigram model over a small built-in corpus, `</s>` appended), built
here because no UMT5 vocabulary ships offline; it loads with `AutoTokenizer` like the real one.
Everything is small enough that a 4-step, 5-frame 32x32 video takes well under a second on CPU.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

from stagemesh.models.cache import build_into_cache
from stagemesh.models.families.wan import PROMPT_MAX_TOKENS
from stagemesh.models.qwen_image import BUILD_STAMP, seeded, stamp_matches

logger = logging.getLogger(__name__)

WanVariant = Literal["t2v", "i2v"]

#: Bump when the builder's code changes its output, so cached folders are rebuilt.
BUILDER_VERSION = 1

#: Wan 2.1 T2V's scheduler/scheduler_config.json, minus the fields equal to the defaults.
WAN_SCHEDULER_CONFIG: dict[str, object] = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "solver_order": 2,
    "final_sigmas_type": "zero",
}

#: The text the tokenizer's vocabulary is counted from: prompt-like phrases for the tests.
_CORPUS = """
a red square slides across a blue background
a small green circle bounces on a white floor
the camera pans slowly over a quiet sea at sunset
a cat walks along a wooden fence in the rain
a yellow triangle spins in front of black mountains
two birds fly over a field of tall grass
an orange ball rolls down a hill toward a river
waves crash against the rocks under a grey sky
a person rides a bicycle through a busy city street
snow falls on a dark forest at night
make the sky purple and add a moon
turn the square into a star and keep the background
"""
#: Every printable ASCII character is a piece too, so no text maps to <unk>.
_CHARACTERS = "".join(chr(c) for c in range(33, 127))


@dataclass(frozen=True)
class WanPreset:
    """Sizes of the tiny Wan models; the layout follows Wan's."""

    text_dim: int  # UMT5 d_model = the transformer's text_dim
    text_layers: int
    text_heads: int
    dit_layers: int
    dit_heads: int
    dit_head_dim: int
    dit_ffn: int
    dit_freq_dim: int
    vae_base_dim: int
    flow_shift: float
    boundary_ratio: float | None  # i2v only: the Wan 2.2 A14B high/low-noise split


PRESETS: dict[WanVariant, WanPreset] = {
    "t2v": WanPreset(
        text_dim=32, text_layers=2, text_heads=2,
        dit_layers=2, dit_heads=2, dit_head_dim=12, dit_ffn=48, dit_freq_dim=32,
        vae_base_dim=8, flow_shift=3.0, boundary_ratio=None,
    ),
    "i2v": WanPreset(
        text_dim=32, text_layers=2, text_heads=2,
        dit_layers=2, dit_heads=2, dit_head_dim=12, dit_ffn=48, dit_freq_dim=32,
        vae_base_dim=8, flow_shift=5.0, boundary_ratio=0.9,
    ),
}  # fmt: skip

#: Wan's VAE latent channels; the VAE's default latents_mean / latents_std are the real model's.
_Z_DIM = 16
#: Channels of the I2V first-frame mask = the VAE's temporal factor (4).
_MASK_CHANNELS = 4


def build_tiny_wan(out_dir: Path, *, variant: WanVariant, seed: int = 0) -> Path:
    """Write a loadable Wan pipeline folder of `variant` with seeded weights to `out_dir`."""
    spec = PRESETS[variant]
    tokenizer = build_t5_tokenizer()
    scheduler = UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG, flow_shift=spec.flow_shift)
    vae = seeded(seed, 1, lambda: _build_vae(spec))
    text_encoder = seeded(seed, 2, lambda: _build_text_encoder(spec, len(tokenizer)))
    # The pipelines annotate `tokenizer` as the AutoTokenizer factory, not a tokenizer class.
    if variant == "t2v":
        pipe: WanPipeline | WanImageToVideoPipeline = WanPipeline(
            tokenizer=tokenizer,  # type: ignore[arg-type]
            text_encoder=text_encoder, vae=vae, scheduler=scheduler,
            transformer=seeded(seed, 3, lambda: _build_transformer(spec, _Z_DIM)),
        )
    else:
        in_channels = 2 * _Z_DIM + _MASK_CHANNELS  # noise + mask + condition
        pipe = WanImageToVideoPipeline(
            tokenizer=tokenizer,  # type: ignore[arg-type]
            text_encoder=text_encoder, vae=vae, scheduler=scheduler,
            transformer=seeded(seed, 3, lambda: _build_transformer(spec, in_channels)),
            transformer_2=seeded(seed, 4, lambda: _build_transformer(spec, in_channels)),
            boundary_ratio=spec.boundary_ratio,
        )
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir)
    (out_dir / BUILD_STAMP).write_text(json.dumps(build_stamp(variant, seed), indent=2))
    return out_dir


def build_t5_tokenizer(corpus: str = _CORPUS) -> T5Tokenizer:
    """A T5-style Unigram tokenizer (`<pad>`=0, `</s>`=1, `<unk>`=2) whose pieces are the
    corpus' words (scored by log frequency) and single characters (scored below every word)."""
    words = Counter(re.findall(r"\S+", corpus))
    total = sum(words.values())
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(f"▁{word}", math.log(count / total)) for word, count in sorted(words.items())]
    floor = math.log(1 / total) - 1.0
    vocab += [(char, floor) for char in _CHARACTERS]
    vocab += [(f"▁{char}", floor) for char in _CHARACTERS]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=PROMPT_MAX_TOKENS)


def _build_text_encoder(spec: WanPreset, vocab_size: int) -> UMT5EncoderModel:
    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=spec.text_dim,
        d_kv=spec.text_dim // spec.text_heads,
        d_ff=spec.text_dim * 2,
        num_layers=spec.text_layers,
        num_heads=spec.text_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return UMT5EncoderModel(config)


def _build_transformer(spec: WanPreset, in_channels: int, patch_frames: int = 1,
                       patch_side: int = 2) -> WanTransformer3DModel:
    """`patch_frames` latent frames of `patch_side` x `patch_side` latent pixels per token
    (Wan's: 1 of 2 x 2)."""
    transformer: WanTransformer3DModel = WanTransformer3DModel(
        patch_size=(patch_frames, patch_side, patch_side),
        num_attention_heads=spec.dit_heads,
        attention_head_dim=spec.dit_head_dim,
        in_channels=in_channels,
        out_channels=_Z_DIM,
        text_dim=spec.text_dim,
        freq_dim=spec.dit_freq_dim,
        ffn_dim=spec.dit_ffn,
        num_layers=spec.dit_layers,
    )
    return transformer


def _build_vae(spec: WanPreset) -> AutoencoderKLWan:
    vae: AutoencoderKLWan = AutoencoderKLWan(
        base_dim=spec.vae_base_dim,
        z_dim=_Z_DIM,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # Wan's: 4x in time, 8x in space
    )
    return vae


def build_stamp(variant: WanVariant, seed: int) -> dict[str, object]:
    """What a folder was built from; a cached folder is reused only if its stamp is equal."""
    spec = json.loads(json.dumps(asdict(PRESETS[variant])))
    return {"builder_version": BUILDER_VERSION, "variant": variant, "seed": seed, "spec": spec}


def is_current(folder: Path, variant: WanVariant, seed: int) -> bool:
    """Whether `folder` holds a complete build of exactly this variant, seed and builder."""
    return stamp_matches(folder, build_stamp(variant, seed))


def ensure_wan_model(variant: WanVariant, *, seed: int = 0, root: Path | None = None) -> Path:
    """The cached folder of `variant` (`builtin:wan-<variant>-tiny`), built once; concurrent
    callers never see a half-written folder and a stale build is replaced."""
    if variant not in PRESETS:
        raise ValueError(f"unknown Wan variant {variant!r}; expected one of {sorted(PRESETS)}")
    suffix = f"-seed{seed}" if seed else ""

    def build(folder: Path) -> None:
        logger.info("building wan-%s-tiny into %s", variant, folder)
        build_tiny_wan(folder, variant=variant, seed=seed)
        folder.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every stage

    return build_into_cache(f"wan-{variant}-tiny{suffix}", build,
                            lambda folder: is_current(folder, variant, seed), root)
