"""Trains the tiny-shapes model and writes a stock diffusers Qwen-Image folder.

Three phases, each seeded: render the dataset (`data.make_dataset`), train the VAE, then train the
DiT and the text encoder together. The folder holds model_index.json, transformer/, vae/,
text_encoder/, tokenizer/ and scheduler/ and loads with `QwenImagePipeline.from_pretrained`.

Training follows the pipeline's own conventions exactly (the text path *is* the pipeline's
`encode_prompt`, latents are normalised with the `latents_mean` / `latents_std` written into the
VAE config, packed 2x2, and the DiT sees timestep = sigma), so sampling with the stock pipeline
needs no glue code.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
import torch.nn.functional as F

# Concrete module paths, not `from diffusers import ...`: the package's lazy __init__ makes type
# checkers see the dummy placeholder classes instead of the real ones.
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from stagemesh.models.tiny_shapes import harness
from stagemesh.models.tiny_shapes.data import IMAGE_SIZE, all_specs, make_dataset
from stagemesh.models.tiny_shapes.harness import cosine_lr as cosine_lr  # the LoRA imports it
from stagemesh.models.tiny_shapes.scoring import ATTRIBUTES, score
from stagemesh.services.vae.single_frame import use_single_frame_convs

logger = logging.getLogger(__name__)

# The pipeline wraps every prompt in this template and drops its first 34 tokens (the system
# prefix); the tokenizer must split that prefix into exactly 34 tokens, as Qwen's own does.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity,"
    " text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_PREFIX_TOKENS = 34
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen-Image's own scheduler configuration.
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}


#: Renders the preview projection is fitted on (`fit_preview`).
PREVIEW_FIT_IMAGES = 512


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained weights besides the seed."""

    n_images: int = 12000
    # VAE
    vae_base_dim: int = 16
    vae_dim_mult: tuple[int, ...] = (1, 2, 2)
    z_dim: int = 16
    vae_steps: int = 1400
    vae_batch: int = 32
    vae_lr: float = 1e-3
    vae_shape_weight: float = 5.0
    vae_kl_weight: float = 1e-5
    # DiT + text encoder
    dit_layers: int = 4
    dit_heads: int = 4
    dit_head_dim: int = 32
    text_dim: int = 64
    dit_steps: int = 3000
    dit_batch: int = 64
    dit_lr: float = 6e-4
    dit_warmup: int = 100
    caption_dropout: float = 0.1
    ema_decay: float = 0.998
    threads: int = 1  # 2 was ~10x slower whenever other processes competed for the 2 cores

    @classmethod
    def smoke(cls) -> TrainConfig:
        return cls(n_images=540, vae_steps=8, vae_batch=8, dit_steps=8, dit_batch=8, dit_warmup=2)


# ---------------------------------------------------------------------------------------------
# Components


def build_tokenizer(captions: list[str], template: str = PROMPT_TEMPLATE,
                    prefix: str | None = None,
                    prefix_tokens: int = TEMPLATE_PREFIX_TOKENS) -> Qwen2Tokenizer:
    """A byte-level BPE over the captions and the template, wrapped in the stock Qwen2Tokenizer.

    `prefix` (default: the template up to the caption) must come out as exactly `prefix_tokens`
    tokens: the part of the template the pipeline drops."""
    bpe = Tokenizer(BPE(unk_token=None))
    bpe.pre_tokenizer = Qwen2Tokenizer().backend_tokenizer.pre_tokenizer
    trainer = BpeTrainer(
        vocab_size=1000,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    template_text = template
    for special in SPECIAL_TOKENS:  # learned as whole tokens, never merged into words
        template_text = template_text.replace(special, "")
    corpus = [template_text.format(c) for c in sorted(set(captions))] + [template_text.format("")]
    bpe.train_from_iterator(corpus * 4, trainer=trainer)
    with tempfile.TemporaryDirectory() as tmp:
        bpe.model.save(tmp)
        vocab = json.loads(Path(tmp, "vocab.json").read_text())
        lines = Path(tmp, "merges.txt").read_text().splitlines()
    merges = [_merge(line) for line in lines if line and not line.startswith("#")]
    # Qwen2Tokenizer annotates `merges` as strings but hands them to tokenizers' BPE, which takes
    # (left, right) pairs, as passed here.
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges,  # type: ignore[arg-type]
                               padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    prefix = template.split("{}")[0] if prefix is None else prefix
    n_prefix = len(tokenizer(prefix).input_ids)
    if n_prefix != prefix_tokens:
        raise RuntimeError(f"template prefix is {n_prefix} tokens, the pipeline drops "
                           f"{prefix_tokens}")
    return tokenizer


def _merge(line: str) -> tuple[str, str]:
    """One line of a BPE merges.txt ("left right") as the pair tokenizers' BPE takes."""
    left, right = line.split(" ")
    return left, right


def _token_id(tokenizer: Qwen2Tokenizer, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise TypeError(f"{token!r} is not a single token")
    return token_id


def build_text_encoder(tokenizer: Qwen2Tokenizer, dim: int) -> Qwen2_5_VLForConditionalGeneration:
    """A 2-layer Qwen2.5-VL text model (and a 1-layer vision tower the pipeline never calls)."""
    def ids(token: str) -> int:
        return _token_id(tokenizer, token)

    heads = 4
    half_head = dim // heads // 2
    section = [half_head // 4, (half_head - half_head // 4) // 2]
    section.append(half_head - sum(section))  # mrope sections must sum to half the head dim
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": dim,
            "intermediate_size": dim * 2,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": section},
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "tie_word_embeddings": True,
        },
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": dim, "fullatt_block_indexes": [0]},
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def build_vae(cfg: TrainConfig) -> AutoencoderKLQwenImage:
    """No attention, one res block, spatial-only downsampling (factor 2 ** (len(dim_mult) - 1))."""
    vae: AutoencoderKLQwenImage = AutoencoderKLQwenImage(
        base_dim=cfg.vae_base_dim,
        z_dim=cfg.z_dim,
        dim_mult=list(cfg.vae_dim_mult),
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False] * (len(cfg.vae_dim_mult) - 1),
        latents_mean=[0.0] * cfg.z_dim,
        latents_std=[1.0] * cfg.z_dim,
    )
    bias = vae.quant_conv.bias
    if bias is None:
        raise RuntimeError("the VAE's quant_conv has no bias to initialise")
    with torch.no_grad():  # with a tiny KL weight the default log-variance is far too large
        bias[cfg.z_dim :].fill_(-6.0)
    return vae


def build_transformer(cfg: TrainConfig) -> QwenImageTransformer2DModel:
    head_dim = cfg.dit_head_dim
    rope = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    transformer: QwenImageTransformer2DModel = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=cfg.z_dim * 4,
        out_channels=cfg.z_dim,
        num_layers=cfg.dit_layers,
        attention_head_dim=head_dim,
        num_attention_heads=cfg.dit_heads,
        joint_attention_dim=cfg.text_dim,
        guidance_embeds=False,
        axes_dims_rope=rope,
    )
    return transformer


def build_scheduler() -> FlowMatchEulerDiscreteScheduler:
    scheduler: FlowMatchEulerDiscreteScheduler = FlowMatchEulerDiscreteScheduler.from_config(
        SCHEDULER_CONFIG)
    return scheduler


# ---------------------------------------------------------------------------------------------
# VAE


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> float (N, 3, H, W) in [-1, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def shape_mask(images: np.ndarray) -> torch.Tensor:
    """(N, 1, H, W): 1.0 on pixels that differ from the border colour (the shape), else 0."""
    border = np.concatenate([images[:, 0], images[:, -1], images[:, :, 0], images[:, :, -1]], 1)
    background = np.median(border.astype(np.float32), axis=1)[:, None, None]
    distance = np.linalg.norm(images.astype(np.float32) - background, axis=-1)
    return torch.from_numpy(distance > 20.0).float()[:, None]


def shape_weights(images: np.ndarray, weight: float) -> torch.Tensor:
    """Per-pixel loss weight: `weight` on the shape's pixels (`shape_mask`), else 1."""
    return 1.0 + (weight - 1.0) * shape_mask(images)


def latent_shape_mask(images: np.ndarray, factor: int) -> torch.Tensor:
    """(N, 1, H / factor, W / factor): 1.0 on the latent pixels the shape touches. The flow
    loss of a transformer weighs the shape by it: the background is most of each image, and
    under the plain MSE a few latent pixels of a square's corners cost little to round off."""
    return F.max_pool2d(shape_mask(images), kernel_size=factor)


def vae_forward(vae: AutoencoderKLQwenImage, x: torch.Tensor, *, sample: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reconstruction, mean, log-variance) without `decode`'s clamp, which kills the gradient."""
    moments = vae.quant_conv(vae.encoder(x[:, :, None]))
    mean, logvar = moments.chunk(2, dim=1)
    logvar = logvar.clamp(-30.0, 20.0)
    z = mean + torch.randn_like(mean) * (0.5 * logvar).exp() if sample else mean
    return vae.decoder(vae.post_quant_conv(z))[:, :, 0], mean[:, :, 0], logvar[:, :, 0]


def train_vae(vae: AutoencoderKLQwenImage, images: np.ndarray, cfg: TrainConfig,
              gen: torch.Generator) -> None:
    x_all, w_all = to_tensor(images), shape_weights(images, cfg.vae_shape_weight)
    use_single_frame_convs(vae)

    def loss_at(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(x_all), (cfg.vae_batch,), generator=gen)
        x, w = x_all[idx], w_all[idx]
        recon, mean, logvar = vae_forward(vae, x)
        err = recon - x
        rec = (w * (err.pow(2) + 0.5 * err.abs())).mean()
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        return rec + cfg.vae_kl_weight * kl

    vae.train()
    harness.optimise(list(vae.parameters()), loss_at, steps=cfg.vae_steps, lr=cfg.vae_lr,
                     warmup=50, clip=0.5, desc="vae")
    vae.eval()


@torch.no_grad()
def encode_latents(vae: AutoencoderKLQwenImage, images: np.ndarray, batch: int = 256
                   ) -> torch.Tensor:
    """Posterior means (N, z, h, w) of the whole dataset."""
    use_single_frame_convs(vae)
    return torch.cat([vae_forward(vae, to_tensor(images[i : i + batch]), sample=False)[1]
                      for i in range(0, len(images), batch)])


@torch.no_grad()
def vae_report(vae: AutoencoderKLQwenImage, images: np.ndarray, captions: list[str]
               ) -> dict[str, float]:
    """Held-out PSNR (dB, pixels in [0, 1]) and the scorer's accuracy on the reconstructions.

    The accuracies bound what the DiT can reach: an attribute the VAE cannot reproduce from a
    perfect latent will not be drawn from a generated one either.
    """
    x = to_tensor(images)
    use_single_frame_convs(vae)
    recon = vae_forward(vae, x, sample=False)[0].clamp(-1.0, 1.0)
    mse = ((recon - x) / 2.0).pow(2).mean().item()
    pixels = recon.add(1.0).mul(127.5).round().byte().permute(0, 2, 3, 1).numpy()
    hits = [score(p, c) for p, c in zip(pixels, captions, strict=True)]
    report = {"psnr_db": round(10.0 * math.log10(1.0 / max(mse, 1e-12)), 2)}
    for name in ATTRIBUTES:
        report[f"recon_{name}"] = round(float(np.mean([h[name] for h in hits])), 4)
    return report


def set_latent_stats(vae: AutoencoderKLQwenImage, latents: torch.Tensor) -> torch.Tensor:
    """Writes per-channel mean/std into the VAE config and returns the normalised latents."""
    mean = latents.mean(dim=(0, 2, 3))
    std = latents.std(dim=(0, 2, 3)).clamp_min(1e-4)
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    return (latents - mean[None, :, None, None]) / std[None, :, None, None]


# ---------------------------------------------------------------------------------------------
# DiT + text encoder


def sample_sigmas(n: int, gen: torch.Generator, location: float = 0.0) -> torch.Tensor:
    """Logit-normal sigmas (centred on sigmoid(`location`)), with 10% drawn uniformly so the ends
    of the schedule are covered."""
    logit_normal = torch.sigmoid(torch.randn(n, generator=gen) + location)
    uniform = torch.rand(n, generator=gen)
    pick_uniform = torch.rand(n, generator=gen) < 0.1
    return torch.where(pick_uniform, uniform, logit_normal).clamp(1e-3, 1.0)


def dit_loss(pipe: QwenImagePipeline, x0: torch.Tensor, captions: list[str],
             gen: torch.Generator) -> torch.Tensor:
    """Rectified flow in the pipeline's conventions: x_t = (1-s) x0 + s noise, v = noise - x0."""
    b, c, h, w = x0.shape
    noise = torch.randn(x0.shape, generator=gen)
    sigma = sample_sigmas(b, gen)
    s = sigma[:, None, None, None]
    xt = (1.0 - s) * x0 + s * noise
    embeds, mask = pipe.encode_prompt(captions, device=torch.device("cpu"))
    pred = pipe.transformer(
        hidden_states=pipe._pack_latents(xt, b, c, h, w),
        timestep=sigma,
        encoder_hidden_states=embeds,
        encoder_hidden_states_mask=mask,
        img_shapes=[[(1, h // 2, w // 2)]] * b,
        return_dict=False,
    )[0]
    return F.mse_loss(pred, pipe._pack_latents(noise - x0, b, c, h, w))


def dit_batch_loss(pipe: QwenImagePipeline, latents: torch.Tensor, captions: list[str],
                   gen: torch.Generator, *, batch: int, caption_dropout: float) -> torch.Tensor:
    """`dit_loss` on a random batch, captions dropped to "" at `caption_dropout`."""
    idx = torch.randint(0, len(latents), (batch,), generator=gen)
    drop = torch.rand(batch, generator=gen) < caption_dropout
    batch_captions = ["" if d else captions[i] for i, d in zip(idx.tolist(), drop.tolist(),
                                                              strict=True)]
    return dit_loss(pipe, latents[idx], batch_captions, gen)


def dit_train_step(pipe: QwenImagePipeline, latents: torch.Tensor, captions: list[str],
                   opt: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                   gen: torch.Generator, *, batch: int, caption_dropout: float, lr: float
                   ) -> torch.Tensor:
    """One optimiser step of `dit_batch_loss`; the loss. The LoRA's training step."""
    loss = dit_batch_loss(pipe, latents, captions, gen, batch=batch,
                          caption_dropout=caption_dropout)
    harness.optimiser_step(opt, params, loss, lr=lr, clip=1.0)
    return loss


def train_dit(pipe: QwenImagePipeline, latents: torch.Tensor, captions: list[str],
              cfg: TrainConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Trains transformer + text encoder jointly; returns the EMA weights of both."""
    modules = torch.nn.ModuleDict({"transformer": pipe.transformer,
                                   "text_encoder": pipe.text_encoder.model.language_model})
    ema = harness.Ema(modules, cfg.ema_decay)
    modules.train()
    harness.optimise([p for p in modules.parameters() if p.requires_grad],
                     lambda step: dit_batch_loss(pipe, latents, captions, gen,
                                                 batch=cfg.dit_batch,
                                                 caption_dropout=cfg.caption_dropout),
                     steps=cfg.dit_steps, lr=cfg.dit_lr, warmup=cfg.dit_warmup, clip=1.0,
                     desc="dit", after_step=ema.update)
    ema.finish()
    return ema.state


def fit_preview(out: Path, images: np.ndarray) -> None:
    """The folder's step-preview projection (`vae/preview.json`), fitted on the first
    PREVIEW_FIT_IMAGES of its own renders: the DiT's fallback when it does not decode previews
    with the VAE itself (services/dit/preview_decode.py)."""
    from stagemesh.services.dit.preview_fit import fit_folder_projection

    fit_folder_projection(out, images[:PREVIEW_FIT_IMAGES])


# ---------------------------------------------------------------------------------------------
# Entry point


def train(out_dir: str | Path, *, smoke: bool = False, seed: int = 0,
          config: TrainConfig | None = None) -> Path:
    """Renders the dataset, trains VAE then DiT + text encoder, and writes a diffusers folder.

    `smoke` runs the whole path on a tiny dataset for a few steps (for CI); `config` overrides the
    hyperparameters (default: `TrainConfig()`, or `TrainConfig.smoke()` when `smoke`).
    Returns the output folder.
    """
    cfg = config or (TrainConfig.smoke() if smoke else TrainConfig())
    return harness.with_threads(cfg.threads, lambda: _train(Path(out_dir), cfg, seed))


def _train(out: Path, cfg: TrainConfig, seed: int) -> Path:
    gen = harness.seeded_generator(seed)
    timings: dict[str, float] = {}
    cpu_start = time.process_time()

    images, captions = harness.phase("render", lambda: make_dataset(cfg.n_images, seed=seed),
                                     timings)
    tokenizer = build_tokenizer([s.caption for s in all_specs()])
    pipe = QwenImagePipeline(
        # diffusers annotates `scheduler` with the placeholder class its lazy __init__ defines
        # for installs without torch, not the real scheduler passed here.
        scheduler=build_scheduler(),  # type: ignore[arg-type]
        vae=build_vae(cfg),
        text_encoder=build_text_encoder(tokenizer, cfg.text_dim),
        tokenizer=tokenizer,
        transformer=build_transformer(cfg),
    )
    n_held = min(256, len(images) // 4)
    harness.phase("vae", lambda: train_vae(pipe.vae, images[:-n_held], cfg, gen), timings)
    vae_metrics = vae_report(pipe.vae, images[-n_held:], captions[-n_held:])
    logger.info("VAE on held-out renders: %s", vae_metrics)
    latents = set_latent_stats(pipe.vae, encode_latents(pipe.vae, images))
    harness.phase("dit", lambda: train_dit(pipe, latents, captions, cfg, gen), timings)

    pipe.save_pretrained(out, safe_serialization=True)
    fit_preview(out, images)
    report = {"config": asdict(cfg), "seed": seed, "vae": vae_metrics,
              "seconds": timings, "cpu_seconds": round(time.process_time() - cpu_start, 1),
              "image_size": IMAGE_SIZE}
    (out / "training.json").write_text(json.dumps(report, indent=2))
    logger.info("wrote %s (%s)", out, report["seconds"])
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="TrainConfig overrides, key=value")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = TrainConfig.smoke() if args.smoke else TrainConfig()
    cfg = harness.with_overrides(cfg, args.set)
    train(args.out_dir, smoke=args.smoke, seed=args.seed, config=cfg)


if __name__ == "__main__":
    main()
