"""Trains tiny-shapes-video and writes a stock diffusers Wan text-to-video folder.

`stagemesh train tiny-shapes-video [--proxy | --smoke]` runs it. Three phases, each seeded, as
tiny-shapes' `train`: render the training clips (`data.make_dataset` over the training split),
train the VAE, then the transformer and the text encoder together. The folder holds
model_index.json, transformer/, vae/, text_encoder/, tokenizer/ and scheduler/ and loads with
`WanPipeline.from_pretrained`.

The components are Wan's (`stagemesh.models.wan` builds the UMT5 text encoder, its T5-style
tokenizer - here over the grammar's words - and the `WanTransformer3DModel`); the VAE is
`AutoencoderKLWan` at 4x spatial and 4x temporal downsampling (Wan's is 8x spatial, too coarse
to draw a shape at 32x32): 9 frames of 32x32 are 3 latent frames of 8x8, which the
transformer reads as 64 tokens of one latent pixel in all 3 latent frames each
(`dit_patch_frames`, `dit_patch_side`).

Training follows `WanPipeline`'s conventions: the text path is its `encode_prompt` at
`max_sequence_length=PROMPT_TOKENS` (zero-padded to it; served so by the recipe's tokenizer
option), latents are normalised with the `latents_mean` / `latents_std` written into the VAE
config, and the transformer predicts the flow (noise - x0) at timestep = 1000 * sigma, what
`UniPCMultistepScheduler` with `use_flow_sigmas` passes it.

The VAE is tiny-shapes' image VAE, frozen by default (`vae_steps=0`): untrained on clips it
already judges every held-out reconstruction right, and training it at 1e-3 damaged that. The
transformer's EMA weights are written to the folder every `checkpoint_every` steps, so a run
stopped early leaves a usable model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler

from stagemesh.models.qwen_image import seeded
from stagemesh.models.tiny_shapes import harness
from stagemesh.models.tiny_shapes import train as base
from stagemesh.models.tiny_shapes.data import IMAGE_SIZE
from stagemesh.models.tiny_shapes_video.data import (
    CROSS_RANGE,
    NUM_FRAMES,
    PROMPT_TOKENS,
    all_captions,
    make_dataset,
    split,
)
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
#: The VAE's downsampling (`build_vae`): 4x in space, 4x in time.
SPATIAL_FACTOR = 4
TEMPORAL_FACTOR = 4


@dataclass(frozen=True)
class VideoTrainConfig:
    """Everything that decides the trained weights besides the seed."""

    n_clips: int = 3000
    # pixels (of 32) the training clips' path sits from the middle across its motion
    cross_range: float = CROSS_RANGE
    # VAE: dim_mult of 3 -> 4x spatial; both downsamples temporal -> 4x temporal
    vae_base_dim: int = 16  # 16 = tiny-shapes' VAE, which `vae_init` needs
    vae_init: bool = True  # start from tiny-shapes' trained image VAE (`init_from_image_vae`)
    vae_steps: int = 0  # frozen: the init judges every clip right; 1e-3 for 300 steps hurt it
    vae_batch: int = 8
    vae_frames: int = 5  # a training window: the first frame plus one 4-frame causal chunk
    vae_lr: float = 1e-5
    vae_shape_weight: float = 5.0
    vae_kl_weight: float = 1e-5
    # text encoder + transformer
    text_dim: int = 64
    text_layers: int = 2
    text_heads: int = 2
    dit_layers: int = 4
    dit_heads: int = 4
    # 4 heads of 32 (128 wide) predict a 1x1 token's 3 x 16 values; with 2x2 tokens (192
    # values) 128 wide stalled at loss 0.66 and 256 wide was needed
    dit_head_dim: int = 32
    dit_ffn: int = 512
    dit_freq_dim: int = 64
    # latent frames per transformer token; 3 = the whole clip in one token, so each token holds
    # its frames in order: Wan's RoPE is relative and its text has no position, which leaves a
    # one-frame token no absolute time to tell "moving right" from "moving left" by (at 1 the
    # transformer ignored the motion words: the word probe's motion ratio stayed 1.000)
    dit_patch_frames: int = 3
    # latent pixels per token side (Wan's: 2); 1 = 64 tokens a clip, each 4x4 pixels: with
    # 8x8-pixel tokens squares came out round (held-out squares right 0 of 18; 4 of 18 at 1)
    dit_patch_side: int = 1
    dit_steps: int = 5250  # ~0.46 s a step of 32 at one thread on a quiet host: 40 minutes
    dit_batch: int = 32
    dit_lr: float = 1e-3
    dit_warmup: int = 100
    caption_dropout: float = 0.1
    # > 0: extra weight on the part of the flow error that varies across latent frames (the
    # motion); the plain MSE let the shipped model ignore the motion words entirely
    motion_weight: float = 0.0
    # > 1: the flow error weighs this much where the shape is (in any frame a latent frame
    # covers), as tiny-shapes' VAE weighs its pixels: the background is most of each clip, and
    # the plain MSE let the transformer round a square's corners (a few latent pixels) off
    shape_weight: float = 5.0
    # > 1: the flow error of the first latent frame (frame 1 alone) weighs this much more: a
    # held-out square wrong in that frame alone was 4 of the 9 wrong squares
    first_frame_weight: float = 1.0
    sigma_location: float = 0.0  # logit-normal centre of the training sigmas (> 0: noisier)
    ema_decay: float = 0.998
    flow_shift: float = 2.0
    threads: int = 1
    vae_report_every: int = 0  # > 0: judge the held-out reconstructions every N VAE steps
    checkpoint_every: int = 250  # > 0: write the folder (EMA weights) every N DiT steps

    @classmethod
    def proxy(cls) -> VideoTrainConfig:
        """The ~10 minute config to iterate on (the VAE frozen, as in the shipped run). From
        random weights 250 VAE steps of 8 reached 11 dB and judged nothing right; from
        tiny-shapes' VAE, 0 steps judge every clip right."""
        return cls(n_clips=1500, dit_steps=1500, dit_batch=16)

    @classmethod
    def smoke(cls) -> VideoTrainConfig:
        return cls(n_clips=24, vae_steps=2, vae_batch=2, vae_frames=1,
                   text_dim=32, dit_layers=1, dit_heads=2, dit_head_dim=12, dit_ffn=32,
                   dit_freq_dim=32, dit_steps=2, dit_batch=2, dit_warmup=1, vae_report_every=2,
                   checkpoint_every=1)

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
        scale_factor_temporal=TEMPORAL_FACTOR,
        scale_factor_spatial=SPATIAL_FACTOR,
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


def latent_shape_weights(clips: np.ndarray, weight: float, first_frame: float = 1.0
                         ) -> torch.Tensor:
    """`weight` on the latent pixels (N, 1, T', h, w) the shape touches in any of the frames
    each latent frame encodes (Wan's causal VAE: frame 0 alone, then 4 frames each), else 1;
    the first latent frame's weights times `first_frame`."""
    n, t = clips.shape[:2]
    frames = base.latent_shape_mask(clips.reshape(n * t, *clips.shape[2:]), SPATIAL_FACTOR)
    touched = frames.reshape(n, t, *frames.shape[2:])  # (N, T, h, w)
    groups = [touched[:, :1], *torch.split(touched[:, 1:], TEMPORAL_FACTOR, dim=1)]
    latent = torch.stack([g.amax(dim=1) for g in groups], dim=1)[:, None]
    weights = 1.0 + (weight - 1.0) * latent
    weights[:, :, 0] *= first_frame
    return weights


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
    load = harness.optimise(list(vae.parameters()), loss_at, steps=cfg.vae_steps,
                            lr=cfg.vae_lr, warmup=50, clip=0.5, desc="vae",
                            after_step=after_step)
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
    """`encode_prompt` at PROMPT_TOKENS: what the pipeline (and the mesh's tokenizer) computes
    at that `max_sequence_length`."""
    embeds: torch.Tensor = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                              max_sequence_length=PROMPT_TOKENS,
                                              device=torch.device("cpu"))[0]
    return embeds


def flow_loss(pipe: WanPipeline, x0: torch.Tensor, captions: list[str],
              gen: torch.Generator, cfg: VideoTrainConfig,
              weights: torch.Tensor | None = None) -> torch.Tensor:
    """Rectified flow: x_t = (1-s) x0 + s noise, target noise - x0, timestep 1000 s, the
    squared error weighted per latent pixel by `weights` (N, 1, T', h, w) if given; plus
    `motion_weight` x the error's deviation from its mean over latent frames (the motion: a
    shape held still in the middle of every frame costs the plain MSE little)."""
    noise = torch.randn(x0.shape, generator=gen)
    sigma = base.sample_sigmas(len(x0), gen, cfg.sigma_location)
    s = sigma.view(-1, 1, 1, 1, 1)
    pred = pipe.transformer(hidden_states=(1.0 - s) * x0 + s * noise,
                            timestep=sigma * pipe.scheduler.config.num_train_timesteps,
                            encoder_hidden_states=prompt_embeds(pipe, captions),
                            return_dict=False)[0]
    err: torch.Tensor = pred - (noise - x0)  # (N, C, T, h, w)
    loss = (err.pow(2) if weights is None else weights * err.pow(2)).mean()
    if cfg.motion_weight:
        loss = loss + cfg.motion_weight * (err - err.mean(dim=2, keepdim=True)).pow(2).mean()
    return loss


def train_dit(pipe: WanPipeline, latents: torch.Tensor, captions: list[str],
              cfg: VideoTrainConfig, gen: torch.Generator,
              checkpoint: Callable[[int], None] | None = None,
              weights: torch.Tensor | None = None) -> list[float]:
    """Trains transformer + text encoder jointly and leaves their EMA weights in (the flow
    error weighted by `weights`, one (1, T', h, w) per latent, if given);
    `checkpoint(steps_done)`, if given, runs with the EMA weights in every `checkpoint_every`
    steps. Returns the load average samples."""
    modules = torch.nn.ModuleDict({"transformer": pipe.transformer,
                                   "text_encoder": pipe.text_encoder})
    ema = harness.Ema(modules, cfg.ema_decay)

    def loss_at(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(latents), (cfg.dit_batch,), generator=gen).tolist()
        drop = (torch.rand(cfg.dit_batch, generator=gen) < cfg.caption_dropout).tolist()
        text = ["" if d else captions[i] for i, d in zip(idx, drop, strict=True)]
        return flow_loss(pipe, latents[idx], text, gen, cfg,
                         None if weights is None else weights[idx])

    def after_step(step: int) -> None:
        ema.update(step)
        done = step + 1
        if (checkpoint is not None and cfg.checkpoint_every and done % cfg.checkpoint_every == 0
                and done < cfg.dit_steps):
            with ema.swapped_in():
                checkpoint(done)

    modules.train()
    load = harness.optimise([p for p in modules.parameters() if p.requires_grad], loss_at,
                            steps=cfg.dit_steps, lr=cfg.dit_lr, warmup=cfg.dit_warmup,
                            clip=1.0, desc="dit", after_step=after_step)
    ema.finish()
    return load


# ---------------------------------------------------------------------------------------------
# Entry point


def build_pipeline(cfg: VideoTrainConfig, seed: int) -> WanPipeline:
    """The untrained pipeline: every component from its own seed, as `wan.build_tiny_wan`."""
    preset = cfg.preset()
    tokenizer = build_t5_tokenizer("\n".join(all_captions()))
    longest = max(len(tokenizer(c).input_ids) for c in all_captions())
    if longest > PROMPT_TOKENS:
        raise RuntimeError(f"a caption is {longest} tokens, the model reads {PROMPT_TOKENS}")
    return WanPipeline(
        tokenizer=tokenizer,  # type: ignore[arg-type]
        text_encoder=seeded(seed, 2, lambda: _build_text_encoder(preset, len(tokenizer))),
        vae=seeded(seed, 1, lambda: build_vae(cfg)),
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG, flow_shift=cfg.flow_shift),
        transformer=seeded(seed, 3, lambda: _build_transformer(
            preset, Z_DIM, cfg.dit_patch_frames, cfg.dit_patch_side)),
    )


def train(out_dir: str | Path, *, seed: int = 0, config: VideoTrainConfig | None = None) -> Path:
    """Renders the training clips, trains VAE then transformer + text encoder, writes the folder
    and its training.json (also at every checkpoint). Returns the folder."""
    cfg = config or VideoTrainConfig()
    return harness.with_threads(cfg.threads, lambda: _train(Path(out_dir), cfg, seed))


def store_half(folder: Path) -> None:
    """Rewrites the safetensors of `folder` (a component's folder) in float16. The transformer
    is 15.3 MB in float32, over the 15 MB the shipped folder may weigh; the stock pipeline and
    the mesh load it back as float32 (the evaluation judged the same clips either way)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata()
        tensors = {name: tensor.to(torch.float16) if tensor.is_floating_point() else tensor
                   for name, tensor in load_file(path).items()}
        save_file(tensors, path, metadata=metadata)


def write_folder(pipe: WanPipeline, out: Path, report: dict[str, object]) -> None:
    """The pipeline and its training.json, replacing `out` whole (a reader never sees half);
    the transformer's weights in float16 (`store_half`)."""
    staging = out.with_name(out.name + ".writing")
    shutil.rmtree(staging, ignore_errors=True)
    pipe.save_pretrained(staging, safe_serialization=True)
    store_half(staging / "transformer")
    (staging / "training.json").write_text(json.dumps(report, indent=2))
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _train(out: Path, cfg: VideoTrainConfig, seed: int) -> Path:
    gen = harness.seeded_generator(seed)
    timings: dict[str, float] = {}
    cpu_start = time.process_time()
    training_specs, held_out = split()
    clips, captions = harness.phase(
        "render", lambda: make_dataset(training_specs, cfg.n_clips, seed=seed,
                                       cross_range=cfg.cross_range), timings)
    pipe = build_pipeline(cfg, seed)
    if cfg.vae_init:
        logger.info("VAE from tiny-shapes' except %s", init_from_image_vae(pipe.vae))
    n_held = min(64, len(clips) // 4)
    vae_curve: dict[int, dict[str, float]] = {}

    def curve(step: int) -> None:  # the VAE's progress, to tune its steps without the DiT
        vae_curve[step] = vae_report(pipe.vae, clips[-n_held:], captions[-n_held:])
        logger.info("VAE at step %d: %s", step, vae_curve[step])

    if cfg.vae_steps:
        load = harness.phase("vae", lambda: train_vae(pipe.vae, clips[:-n_held], cfg, gen,
                                                      curve), timings)
    else:
        pipe.vae.requires_grad_(False)
        load = []
    pipe.vae.eval()
    vae_metrics = vae_report(pipe.vae, clips[-n_held:], captions[-n_held:])
    logger.info("VAE on held-out clips: %s", vae_metrics)
    latents = harness.phase(
        "encode", lambda: set_latent_stats(pipe.vae, encode_latents(pipe.vae, clips)), timings)

    def report(dit_steps_done: int) -> dict[str, object]:
        return {"config": asdict(cfg), "seed": seed, "dit_steps_done": dit_steps_done,
                "vae": vae_metrics, "vae_curve": vae_curve, "seconds": dict(timings),
                "cpu_seconds": round(time.process_time() - cpu_start, 1),
                "load_average_1min": harness.load_summary(load),
                "image_size": IMAGE_SIZE, "num_frames": NUM_FRAMES,
                "prompt_tokens": PROMPT_TOKENS, "held_out_prompts": len(held_out),
                "training_prompts": len(training_specs)}

    def checkpoint(done: int) -> None:
        timings["dit"] = round(time.perf_counter() - dit_start, 1)
        load.append(os.getloadavg()[0])  # the DiT's own samples arrive only when it ends
        write_folder(pipe, out, report(done))
        logger.info("checkpoint at DiT step %d written to %s", done, out)

    weights = (latent_shape_weights(clips, cfg.shape_weight, cfg.first_frame_weight)
               if (cfg.shape_weight, cfg.first_frame_weight) != (1.0, 1.0) else None)
    dit_start = time.perf_counter()
    load += harness.phase("dit", lambda: train_dit(pipe, latents, captions, cfg, gen,
                                                   checkpoint, weights), timings)
    write_folder(pipe, out, report(cfg.dit_steps))
    logger.info("wrote %s (%s)", out, timings)
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--proxy", action="store_true", help="the <= 10 minute config")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="VideoTrainConfig overrides, k=v")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = (VideoTrainConfig.smoke() if args.smoke else
           VideoTrainConfig.proxy() if args.proxy else VideoTrainConfig())
    train(args.out_dir, seed=args.seed, config=harness.with_overrides(cfg, args.set))


if __name__ == "__main__":
    main()
