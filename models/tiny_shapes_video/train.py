"""Trains tiny-shapes-video and writes a stock diffusers Wan text-to-video folder.

`stagemesh train tiny-shapes-video [--proxy | --smoke]` runs it. Three phases, each seeded, as
tiny-shapes' `train`: render the training clips (`data.make_dataset` over the training split),
train the VAE, then the transformer and the text encoder together. The folder holds
model_index.json, transformer/, vae/, text_encoder/, tokenizer/ and scheduler/ and loads with
`WanPipeline.from_pretrained`.

The components are Wan's (`stagemesh.models.wan` builds the UMT5 text encoder, its T5-style
tokenizer - here over the grammar's words - and the `WanTransformer3DModel`); the VAE is
`AutoencoderKLWan` at 4x spatial and 4x temporal downsampling (Wan's is 8x spatial, too coarse
to draw a shape at 32x32): 9 frames of 32x32 are 3 latent frames of 8x8, 48 DiT tokens.

Training follows `WanPipeline`'s conventions: the text path is its `encode_prompt` (zero-padded
to the pipeline's 512 tokens, which the transformer attends to), latents are normalised with the
`latents_mean` / `latents_std` written into the VAE config, and the transformer predicts the flow
(noise - x0) at timestep = 1000 * sigma, what `UniPCMultistepScheduler` with `use_flow_sigmas`
passes it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler

from stagemesh.models.families.wan import PROMPT_MAX_TOKENS
from stagemesh.models.qwen_image import seeded
from stagemesh.models.tiny_shapes import train as base
from stagemesh.models.tiny_shapes.data import IMAGE_SIZE
from stagemesh.models.tiny_shapes_video.data import NUM_FRAMES, all_captions, make_dataset, split
from stagemesh.models.tiny_shapes_video.judge import VERDICTS, judge
from stagemesh.models.wan import (
    WAN_SCHEDULER_CONFIG,
    WanPreset,
    _build_text_encoder,
    _build_transformer,
    build_t5_tokenizer,
)

logger = logging.getLogger(__name__)

#: Latent channels: Wan's (the transformer builder and the mesh's Wan stages assume it).
Z_DIM = 16
#: Tokens the text encoder runs over in training; the embeddings are then zero-padded to the
#: pipeline's PROMPT_MAX_TOKENS exactly as `encode_prompt` pads them (the longest caption is 11).
TEXT_TOKENS = 16


@dataclass(frozen=True)
class VideoTrainConfig:
    """Everything that decides the trained weights besides the seed."""

    n_clips: int = 6000
    # VAE: dim_mult of 3 -> 4x spatial; both downsamples temporal -> 4x temporal
    vae_base_dim: int = 16  # 16 = tiny-shapes' VAE, which `vae_init` needs
    vae_init: bool = True  # start from tiny-shapes' trained image VAE (`init_from_image_vae`)
    vae_steps: int = 600  # ~0.6 s a step of 4 clips (session 8): 8 clips ~12 min
    vae_batch: int = 8
    vae_frames: int = 5  # a training window: the first frame plus one 4-frame causal chunk
    vae_lr: float = 1e-3
    vae_shape_weight: float = 5.0
    vae_kl_weight: float = 1e-5
    # text encoder + transformer
    text_dim: int = 64
    text_layers: int = 2
    text_heads: int = 2
    dit_layers: int = 4
    dit_heads: int = 4
    dit_head_dim: int = 32
    dit_ffn: int = 256
    dit_freq_dim: int = 64
    dit_steps: int = 2400  # ~0.6 s a step of 32 (est. from 16 at 0.74 s, load 3): ~24 min
    dit_batch: int = 32
    dit_lr: float = 6e-4
    dit_warmup: int = 100
    caption_dropout: float = 0.1
    ema_decay: float = 0.998
    flow_shift: float = 2.0
    threads: int = 1
    vae_report_every: int = 0  # > 0: judge the held-out reconstructions every N VAE steps

    @classmethod
    def proxy(cls) -> VideoTrainConfig:
        """The ~10 minute config (quiet machine, one thread; VAE ~0.6 s, DiT ~0.35 s a step) to
        iterate on, with the VAE's curve. From random weights 250 VAE steps of 8 reached 11 dB
        and judged nothing right; from tiny-shapes' VAE, 0 steps judge every clip right."""
        return cls(n_clips=1500, vae_steps=300, vae_batch=4, vae_report_every=100,
                   dit_steps=400, dit_batch=16)

    @classmethod
    def smoke(cls) -> VideoTrainConfig:
        return cls(n_clips=24, vae_steps=2, vae_batch=2, vae_frames=1,
                   text_dim=32, dit_layers=1, dit_heads=2, dit_head_dim=12, dit_ffn=32,
                   dit_freq_dim=32, dit_steps=2, dit_batch=2, dit_warmup=1, vae_report_every=2)

    def preset(self) -> WanPreset:
        return WanPreset(text_dim=self.text_dim, text_layers=self.text_layers,
                         text_heads=self.text_heads, dit_layers=self.dit_layers,
                         dit_heads=self.dit_heads, dit_head_dim=self.dit_head_dim,
                         dit_ffn=self.dit_ffn, dit_freq_dim=self.dit_freq_dim,
                         vae_base_dim=self.vae_base_dim, flow_shift=self.flow_shift,
                         boundary_ratio=None)


# ---------------------------------------------------------------------------------------------
# VAE


def build_vae(cfg: VideoTrainConfig) -> AutoencoderKLWan:
    """No attention, one res block, 4x spatial and 4x temporal (both downsamples temporal)."""
    vae: AutoencoderKLWan = AutoencoderKLWan(
        base_dim=cfg.vae_base_dim,
        z_dim=Z_DIM,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[True, True],
        latents_mean=[0.0] * Z_DIM,
        latents_std=[1.0] * Z_DIM,
        scale_factor_temporal=4,
        scale_factor_spatial=4,
    )
    bias = vae.quant_conv.bias
    if bias is None:
        raise RuntimeError("the VAE's quant_conv has no bias to initialise")
    with torch.no_grad():  # with a tiny KL weight the default log-variance is far too large
        bias[Z_DIM:].fill_(-6.0)
    return vae


def init_from_image_vae(vae: AutoencoderKLWan) -> list[str]:
    """Loads tiny-shapes' trained image VAE into `vae` (the same Wan 2.1 architecture: every
    tensor but the temporal convolutions, which it lacks) and makes those start as identity on
    the newest frame (the encoder keeps one frame of two, the decoder repeats each). The image
    VAE only ever trained the newest-frame tap of its causal 3x3x3 kernels (a single frame sees
    zero padding before it), so the older taps start at zero: frame by frame, what it learned.
    Returns the names not loaded."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage

    from stagemesh.models.registry import SHIPPED_TINY_SHAPES

    image = AutoencoderKLQwenImage.from_pretrained(SHIPPED_TINY_SHAPES / "vae").state_dict()
    missing: list[str] = vae.load_state_dict(image, strict=False).missing_keys
    with torch.no_grad():
        for name, module in vae.named_modules():
            if not isinstance(module, torch.nn.Conv3d) or module.weight.shape[2] == 1:
                continue
            weight = module.weight  # (out, in, time, h, w)
            if name.endswith("time_conv"):  # (out, in, time, 1, 1); out = in or 2 * in
                weight.zero_()
                channels = torch.arange(weight.shape[0])
                weight[channels, channels % weight.shape[1], -1, 0, 0] = 1.0
                if module.bias is not None:
                    module.bias.zero_()
            else:
                weight[:, :, :-1].zero_()
    return missing


def to_tensor(clips: np.ndarray) -> torch.Tensor:
    """uint8 (N, T, H, W, 3) -> float (N, 3, T, H, W) in [-1, 1]."""
    return torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float().div(127.5).sub(1.0)


def to_pixels(video: torch.Tensor) -> np.ndarray:
    """float (N, 3, T, H, W) in [-1, 1] -> uint8 (N, T, H, W, 3)."""
    pixels: np.ndarray = (video.clamp(-1.0, 1.0).add(1.0).mul(127.5).round().byte()
                          .permute(0, 2, 3, 4, 1).numpy())
    return pixels


def clip_shape_weights(clips: np.ndarray, weight: float) -> torch.Tensor:
    """tiny-shapes' per-pixel weight, frame by frame, as (N, 1, T, H, W)."""
    n, t = clips.shape[:2]
    frames = base.shape_weights(clips.reshape(n * t, *clips.shape[2:]), weight)
    return frames.reshape(n, t, 1, *frames.shape[2:]).permute(0, 2, 1, 3, 4)


def decode_unclamped(vae: AutoencoderKLWan, z: torch.Tensor) -> torch.Tensor:
    """`AutoencoderKLWan._decode` (frame by frame through the causal cache) without its final
    clamp, which kills the gradient of every pixel at +-1."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map,
                                  feat_idx=vae._conv_idx, first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, dim=2)


def vae_forward(vae: AutoencoderKLWan, x: torch.Tensor, *, sample: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reconstruction, mean, log-variance) of (N, 3, T, H, W) clips."""
    mean, logvar = vae._encode(x).chunk(2, dim=1)
    logvar = logvar.clamp(-30.0, 20.0)
    z = mean + torch.randn_like(mean) * (0.5 * logvar).exp() if sample else mean
    return decode_unclamped(vae, z), mean, logvar


def optimise(params: list[torch.nn.Parameter], loss_at: Callable[[int], torch.Tensor], *,
             steps: int, lr: float, warmup: int, clip: float, desc: str,
             after_step: Callable[[int], None] | None = None) -> list[float]:
    """AdamW on `loss_at(step)` with tiny-shapes' warmup + cosine schedule and gradient clipping;
    returns the 1-minute load average sampled every 50 steps (others may share the machine)."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    load: list[float] = []
    with base._progress(steps, desc) as bar:
        for step in range(steps):
            loss = loss_at(step)
            for group in opt.param_groups:
                group["lr"] = lr * base.cosine_lr(step, steps, warmup)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            if after_step is not None:
                after_step(step)
            bar.update()
            if step % 50 == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}")
                logger.info("%s step %d loss %.4f", desc, step, loss.item())
                load.append(os.getloadavg()[0])
    return load


def train_vae(vae: AutoencoderKLWan, clips: np.ndarray, cfg: VideoTrainConfig,
              gen: torch.Generator, curve: Callable[[int], None] | None = None) -> list[float]:
    """Trains the VAE on `vae_frames`-frame windows of the clips (the causal convolutions are
    the same at every chunk after the first, so 1 + 4 frames teach what 9 need, at ~5/9 of the
    cost); `curve(step)`, if given, runs every `vae_report_every` steps. Returns the load
    average samples."""
    weights = clip_shape_weights(clips, cfg.vae_shape_weight)

    def loss_at(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(clips), (cfg.vae_batch,), generator=gen)
        start = int(torch.randint(0, clips.shape[1] - cfg.vae_frames + 1, (1,), generator=gen))
        window = slice(start, start + cfg.vae_frames)
        x, w = to_tensor(clips[idx.numpy(), window]), weights[idx][:, :, window]
        recon, mean, logvar = vae_forward(vae, x)
        err = recon - x
        rec = (w * (err.pow(2) + 0.5 * err.abs())).mean()
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        return rec + cfg.vae_kl_weight * kl

    def after_step(step: int) -> None:
        if curve is not None and cfg.vae_report_every and (step + 1) % cfg.vae_report_every == 0:
            vae.eval()
            curve(step + 1)
            vae.train()

    vae.train()
    load = optimise(list(vae.parameters()), loss_at, steps=cfg.vae_steps, lr=cfg.vae_lr,
                    warmup=50, clip=0.5, desc="vae", after_step=after_step)
    vae.eval()
    return load


@torch.no_grad()
def encode_latents(vae: AutoencoderKLWan, clips: np.ndarray, batch: int = 64) -> torch.Tensor:
    """Posterior means (N, z, T', h, w) of all clips."""
    return torch.cat([vae._encode(to_tensor(clips[i : i + batch])).chunk(2, dim=1)[0]
                      for i in range(0, len(clips), batch)])


@torch.no_grad()
def vae_report(vae: AutoencoderKLWan, clips: np.ndarray, captions: list[str]
               ) -> dict[str, float]:
    """Held-out PSNR (dB, pixels in [0, 1]) and the judge's verdicts on the reconstructions.

    They bound what the transformer can reach: a shape, colour or motion the VAE cannot
    reproduce from a perfect latent will not be drawn from a generated one either.
    """
    x = to_tensor(clips)
    recon = vae_forward(vae, x, sample=False)[0].clamp(-1.0, 1.0)
    mse = ((recon - x) / 2.0).pow(2).mean().item()
    verdicts = [judge(c, caption) for c, caption in zip(to_pixels(recon), captions, strict=True)]
    report = {"psnr_db": round(10.0 * math.log10(1.0 / max(mse, 1e-12)), 2)}
    for name in VERDICTS:
        report[f"recon_{name}"] = round(float(np.mean([v[name] for v in verdicts])), 4)
    return report


def set_latent_stats(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """Writes per-channel mean/std into the VAE config; returns the normalised latents."""
    mean = latents.mean(dim=(0, 2, 3, 4))
    std = latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-4)
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    shape = (1, Z_DIM, 1, 1, 1)
    return (latents - mean.view(shape)) / std.view(shape)


# ---------------------------------------------------------------------------------------------
# Transformer + text encoder


def prompt_embeds(pipe: WanPipeline, captions: list[str]) -> torch.Tensor:
    """`encode_prompt` over TEXT_TOKENS, zero-padded to PROMPT_MAX_TOKENS: equal to what the
    pipeline computes over 512 tokens (padding is masked in the encoder, zeros after it)."""
    embeds = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                max_sequence_length=TEXT_TOKENS,
                                device=torch.device("cpu"))[0]
    return F.pad(embeds, (0, 0, 0, PROMPT_MAX_TOKENS - TEXT_TOKENS))


def flow_loss(pipe: WanPipeline, x0: torch.Tensor, captions: list[str],
              gen: torch.Generator) -> torch.Tensor:
    """Rectified flow: x_t = (1-s) x0 + s noise, target noise - x0, timestep 1000 s."""
    noise = torch.randn(x0.shape, generator=gen)
    sigma = base.sample_sigmas(len(x0), gen)
    s = sigma.view(-1, 1, 1, 1, 1)
    pred = pipe.transformer(hidden_states=(1.0 - s) * x0 + s * noise,
                            timestep=sigma * pipe.scheduler.config.num_train_timesteps,
                            encoder_hidden_states=prompt_embeds(pipe, captions),
                            return_dict=False)[0]
    return F.mse_loss(pred, noise - x0)


def train_dit(pipe: WanPipeline, latents: torch.Tensor, captions: list[str],
              cfg: VideoTrainConfig, gen: torch.Generator) -> list[float]:
    """Trains transformer + text encoder jointly and leaves their EMA weights in; returns the
    load average samples."""
    modules = torch.nn.ModuleDict({"transformer": pipe.transformer,
                                   "text_encoder": pipe.text_encoder})
    ema = {k: v.detach().clone() for k, v in modules.state_dict().items()}

    def loss_at(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(latents), (cfg.dit_batch,), generator=gen).tolist()
        drop = (torch.rand(cfg.dit_batch, generator=gen) < cfg.caption_dropout).tolist()
        text = ["" if d else captions[i] for i, d in zip(idx, drop, strict=True)]
        return flow_loss(pipe, latents[idx], text, gen)

    @torch.no_grad()
    def update_ema(step: int) -> None:
        decay = min(cfg.ema_decay, (1 + step) / (10 + step))
        for k, v in modules.state_dict().items():
            ema[k].lerp_(v, 1.0 - decay)

    modules.train()
    load = optimise([p for p in modules.parameters() if p.requires_grad], loss_at,
                    steps=cfg.dit_steps, lr=cfg.dit_lr, warmup=cfg.dit_warmup, clip=1.0,
                    desc="dit", after_step=update_ema)
    modules.load_state_dict(ema)
    modules.eval()
    return load


# ---------------------------------------------------------------------------------------------
# Entry point


def build_pipeline(cfg: VideoTrainConfig, seed: int) -> WanPipeline:
    """The untrained pipeline: every component from its own seed, as `wan.build_tiny_wan`."""
    preset = cfg.preset()
    tokenizer = build_t5_tokenizer("\n".join(all_captions()))
    longest = max(len(tokenizer(c).input_ids) for c in all_captions())
    if longest > TEXT_TOKENS:
        raise RuntimeError(f"a caption is {longest} tokens, training encodes {TEXT_TOKENS}")
    return WanPipeline(
        tokenizer=tokenizer,  # type: ignore[arg-type]
        text_encoder=seeded(seed, 2, lambda: _build_text_encoder(preset, len(tokenizer))),
        vae=seeded(seed, 1, lambda: build_vae(cfg)),
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG, flow_shift=cfg.flow_shift),
        transformer=seeded(seed, 3, lambda: _build_transformer(preset, Z_DIM)),
    )


def train(out_dir: str | Path, *, seed: int = 0, config: VideoTrainConfig | None = None) -> Path:
    """Renders the training clips, trains VAE then transformer + text encoder, writes the folder
    and its training.json. Returns the folder."""
    cfg = config or VideoTrainConfig()
    previous = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _train(Path(out_dir), cfg, seed)
    finally:
        torch.set_num_threads(previous)


def _train(out: Path, cfg: VideoTrainConfig, seed: int) -> Path:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    timings: dict[str, float] = {}
    cpu_start = time.process_time()
    training_specs, held_out = split()
    clips, captions = base._phase(
        "render", lambda: make_dataset(training_specs, cfg.n_clips, seed=seed), timings)
    pipe = build_pipeline(cfg, seed)
    if cfg.vae_init:
        logger.info("VAE from tiny-shapes' except %s", init_from_image_vae(pipe.vae))
    n_held = min(64, len(clips) // 4)
    vae_curve: dict[int, dict[str, float]] = {}

    def curve(step: int) -> None:  # the VAE's progress, to tune its steps without the DiT
        vae_curve[step] = vae_report(pipe.vae, clips[-n_held:], captions[-n_held:])
        logger.info("VAE at step %d: %s", step, vae_curve[step])

    load = base._phase("vae", lambda: train_vae(pipe.vae, clips[:-n_held], cfg, gen, curve),
                       timings)
    vae_metrics = vae_report(pipe.vae, clips[-n_held:], captions[-n_held:])
    logger.info("VAE on held-out clips: %s", vae_metrics)
    latents = set_latent_stats(pipe.vae, encode_latents(pipe.vae, clips))
    load += base._phase("dit", lambda: train_dit(pipe, latents, captions, cfg, gen), timings)

    pipe.save_pretrained(out, safe_serialization=True)
    report = {"config": asdict(cfg), "seed": seed, "vae": vae_metrics, "vae_curve": vae_curve,
              "seconds": timings,
              "cpu_seconds": round(time.process_time() - cpu_start, 1),
              "load_average_1min": {"mean": round(float(np.mean(load)), 2),
                                    "max": round(max(load), 2), "samples": len(load)},
              "image_size": IMAGE_SIZE, "num_frames": NUM_FRAMES,
              "held_out_prompts": len(held_out), "training_prompts": len(training_specs)}
    (out / "training.json").write_text(json.dumps(report, indent=2))
    logger.info("wrote %s (%s)", out, report["seconds"])
    return out

