"""A LoRA trained on the frozen tiny-shapes transformer: it draws every prompt at night, on the
palette's black background, whatever background the prompt names.

The style is `data.make_dataset(..., background=STYLE_BACKGROUND)`: the caption's colour, shape
and position with the base renders' jitter, always on STYLE_BACKGROUND. Why this style (the
numbers are in docs/lora.md): the adapter is DiT-only, so the shipped VAE must reconstruct the
style, and the judge must read shape, colour and position on it exactly as on base renders.
Outlined shapes fail the first (the VAE fills the outlines in), and so does a tinted background
(the VAE paints the palette's background back). Larger shapes (`big-shapes`, session 10) pass
both, but every adapter trained on them (1.3x or 1.5x, rank 8 or 16, up to 2,000 steps) drew
most squares round (87-93% where counted): shape 69.6% against the base's 93.3%. A palette
background lies inside what the VAE and the judge were built on, and leaves the geometry to the
base model.

The effect is read off the pixels by the tiny-shapes scorer (scoring.py): an image shows the
style when its measured background is STYLE_BACKGROUND, and `effect` is that share over the
prompts that name another background (on the others the style changes nothing). Colour, shape
and position are scored as for the base model; the caption's background is what the style
overrides.

`train_lora` trains rank-RANK A/B pairs on TARGETS with the base model's own rectified-flow
loss (`train.dit_loss`) on VAE latents of restyled renders, everything else frozen (optionally
keeping an EMA of them), and saves them in diffusers' LoRA layout
(`<out>/pytorch_lora_weights.safetensors`) plus training.json. `evaluate_lora` runs the grammar
through the stock pipeline with and without `load_lora_weights` and writes both scores and a
side-by-side grid.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from stagemesh.models.tiny_shapes import SHIPPED_DIR
from stagemesh.models.tiny_shapes.data import all_specs, make_dataset, parse_caption
from stagemesh.models.tiny_shapes.evaluate import load_pipeline, stock_drawer
from stagemesh.models.tiny_shapes.scoring import ATTRIBUTES, measure, score

if TYPE_CHECKING:
    import torch
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

log = logging.getLogger(__name__)

NAME = "night"
#: The background every image of the style is drawn on (a palette background: the shipped VAE
#: reconstructs only those, and paints a tint of one back to it).
STYLE_BACKGROUND = "black"
RANK = 8
#: The attention projections of both streams, as Qwen-Image LoRAs usually train them.
ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
             "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
#: The image stream's feed-forward Linears and the projection to latent patches: what each
#: image token draws, which LoRA on attention alone reaches only through the other tokens.
FEED_FORWARD = ("img_mlp.net.0.proj", "img_mlp.net.2", "proj_out")
TARGETS = ATTENTION
#: A `lora_dir` for the tiny-shapes DiT; the adapter is its sub-directory NAME.
SHIPPED_LORA_DIR = SHIPPED_DIR.parent / "tiny-shapes-loras"
#: Prompts drawn in one batched pipeline call by `evaluate_lora` (each with its own seeded
#: generator, so each starts from the noise it would alone).
EVAL_BATCH = 30


def shows_style(image: np.ndarray) -> bool:
    """Whether the scorer reads the style's background in `image`."""
    return measure(image).background == STYLE_BACKGROUND


def effect_scores(images: list[np.ndarray], captions: list[str]) -> dict[str, float]:
    """`effect`: share of images showing the style among the prompts naming another background;
    the scorer's accuracy per attribute (`background`: the caption's, which the style
    overrides)."""
    changed = [shows_style(i) for i, c in zip(images, captions, strict=True)
               if parse_caption(c).background != STYLE_BACKGROUND]
    hits = [score(i, c) for i, c in zip(images, captions, strict=True)]
    result = {"effect": float(np.mean(changed)) if changed else 0.0}
    result |= {name: float(np.mean([h[name] for h in hits])) for name in ATTRIBUTES}
    return {k: round(v, 4) for k, v in result.items()}


def shape_errors(images: list[np.ndarray], captions: list[str]) -> dict[str, int]:
    """How often each wrong shape call happened ("square->circle": asked a square, saw a
    circle): where shape accuracy goes."""
    errors: dict[str, int] = {}
    for image, caption in zip(images, captions, strict=True):
        wanted, seen = parse_caption(caption).shape, measure(image).shape
        if wanted != seen:
            errors[f"{wanted}->{seen}"] = errors.get(f"{wanted}->{seen}", 0) + 1
    return dict(sorted(errors.items()))


# ---------------------------------------------------------------------------------------------
# Checking the style on the VAE, and training


def reconstruct(pipe: QwenImagePipeline, images: np.ndarray) -> np.ndarray:
    """uint8 images through the VAE's encode (posterior mean) and decode."""
    import torch

    from stagemesh.models.tiny_shapes.train import to_tensor, vae_forward

    with torch.no_grad():
        recon = vae_forward(pipe.vae, to_tensor(images), sample=False)[0].clamp(-1.0, 1.0)
    pixels: np.ndarray = recon.add(1.0).mul(127.5).round().byte().permute(0, 2, 3, 1).numpy()
    return pixels


def validate_style(pipe: QwenImagePipeline, n: int = 540, seed: int = 7) -> dict[str, object]:
    """Effect and attribute scores of base and restyled renders and of their VAE
    reconstructions: the style must already pass on `styled_vae` for a DiT-only LoRA to learn it.
    """
    from stagemesh.services.vae.single_frame import use_single_frame_convs

    use_single_frame_convs(pipe.vae)
    report: dict[str, object] = {}
    for name, background in (("base", None), ("styled", STYLE_BACKGROUND)):
        images, captions = make_dataset(n, seed=seed, background=background)
        report[name] = effect_scores(list(images), captions)
        report[f"{name}_vae"] = effect_scores(list(reconstruct(pipe, images)), captions)
    return report


@dataclass(frozen=True)
class LoraConfig:
    """Everything that decides the adapter's weights besides the seed."""

    n_images: int = 2700
    steps: int = 900
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 20
    rank: int = RANK
    targets: tuple[str, ...] = TARGETS
    caption_dropout: float = 0.1
    #: > 0: the saved weights are this EMA of the trained ones, as the base model's (train.py);
    #: 0: the trained weights themselves (the shipped adapter). On `big-shapes` (session 10),
    #: neither EMA 0.998 over 2000 steps nor rank 16 with ATTENTION + FEED_FORWARD kept its
    #: squares square (docs/lora.md).
    ema_decay: float = 0.0
    threads: int = 1

    @classmethod
    def smoke(cls) -> LoraConfig:
        return cls(n_images=64, steps=3, batch=4, warmup=1)


def _add_lora(pipe: QwenImagePipeline, cfg: LoraConfig) -> list[torch.nn.Parameter]:
    """Freezes every weight and injects PEFT LoRA layers on `cfg.targets`; the trainable
    params."""
    from peft import LoraConfig as PeftConfig

    for module in (pipe.transformer, pipe.text_encoder, pipe.vae):
        module.requires_grad_(False)
    pipe.transformer.add_adapter(PeftConfig(r=cfg.rank, lora_alpha=cfg.rank,
                                            init_lora_weights="gaussian",
                                            target_modules=list(cfg.targets)))
    return [p for p in pipe.transformer.parameters() if p.requires_grad]


def _save_adapter(pipe: QwenImagePipeline, out: Path, cfg: LoraConfig) -> None:
    """The transformer's LoRA layers in diffusers' layout (`out/pytorch_lora_weights...`)."""
    from peft.utils import get_peft_model_state_dict

    layers = get_peft_model_state_dict(pipe.transformer)
    pipe.save_lora_weights(out, transformer_lora_layers=layers, transformer_lora_adapter_metadata={
        "r": cfg.rank, "lora_alpha": cfg.rank, "target_modules": list(cfg.targets)})


class _Ema:
    """An exponential moving average of `params`, with the base model's warm-up of the decay."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float) -> None:
        self.params, self.decay = params, decay
        self.average = [p.detach().clone() for p in params]

    def update(self, step: int) -> None:
        import torch

        decay = min(self.decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for average, p in zip(self.average, self.params, strict=True):
                average.lerp_(p, 1.0 - decay)

    def swap(self) -> None:
        """Exchanges the live weights and the average (twice restores both)."""
        import torch

        with torch.no_grad():
            for average, p in zip(self.average, self.params, strict=True):
                live = p.detach().clone()
                p.copy_(average)
                average.copy_(live)


def train_lora(folder: Path, out: Path, *, seed: int = 0, config: LoraConfig | None = None,
               snapshots: Path | None = None, snapshot_every: int = 500) -> dict[str, object]:
    """Trains the adapter on `folder`'s frozen model and writes it (its EMA with
    `config.ema_decay`) to `out`; the report. With `snapshots`, the weights so far are also
    saved every `snapshot_every` steps to `snapshots/step-N` (to evaluate a long run early)."""
    import torch

    from stagemesh.models.tiny_shapes.train import cosine_lr, dit_train_step, encode_latents

    cfg = config or LoraConfig()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        start, cpu_start = time.perf_counter(), time.process_time()
        pipe = load_pipeline(folder)
        images, captions = make_dataset(cfg.n_images, seed=seed + 1, background=STYLE_BACKGROUND)
        mean = torch.tensor(pipe.vae.config.latents_mean)[None, :, None, None]
        std = torch.tensor(pipe.vae.config.latents_std)[None, :, None, None]
        latents = (encode_latents(pipe.vae, images) - mean) / std
        params = _add_lora(pipe, cfg)
        ema = _Ema(params, cfg.ema_decay)
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        pipe.transformer.train()
        losses: list[float] = []
        loads: list[float] = []  # the 1-minute load average: how busy the shared CPU was
        for step in range(cfg.steps):
            loss = dit_train_step(pipe, latents, captions, opt, params, gen, batch=cfg.batch,
                                  caption_dropout=cfg.caption_dropout,
                                  lr=cfg.lr * cosine_lr(step, cfg.steps, cfg.warmup))
            ema.update(step)
            losses.append(loss.item())
            if step % 25 == 0:
                loads.append(os.getloadavg()[0])
                log.info("step %d/%d loss %.4f", step, cfg.steps, np.mean(losses[-25:]))
            done = step + 1
            if snapshots is not None and done % snapshot_every == 0 and done < cfg.steps:
                ema.swap()
                _save_adapter(pipe, snapshots / f"step-{done}", cfg)
                ema.swap()
        pipe.transformer.eval()
        ema.swap()
        _save_adapter(pipe, out, cfg)
        report: dict[str, object] = {
            "name": out.name, "base": folder.name, "config": asdict(cfg), "seed": seed,
            "style_background": STYLE_BACKGROUND,
            "final_loss": round(float(np.mean(losses[-25:])), 4),
            "seconds": round(time.perf_counter() - start, 1),
            "cpu_seconds": round(time.process_time() - cpu_start, 1),
            "load_average": {"mean": round(float(np.mean(loads)), 2),
                             "max": round(max(loads), 2)},
        }
        (out / "training.json").write_text(json.dumps(report, indent=2))
        log.info("wrote %s: %s", out, report)
        return report
    finally:
        torch.set_num_threads(previous_threads)


# ---------------------------------------------------------------------------------------------
# Evaluation


def write_side_by_side(base: list[np.ndarray], styled: list[np.ndarray], path: Path,
                       columns: int = 9, scale: int = 4) -> None:
    """Pairs (base | adapter), upscaled `scale`x, `columns` pairs a row, titled on top."""
    size = base[0].shape[0] * scale
    pair_w, gap, title = 2 * size + 2, 6, 14
    rows = -(-len(base) // columns)
    grid = Image.new("RGB", (columns * (pair_w + gap), title + rows * (size + gap)), "white")
    ImageDraw.Draw(grid).text((2, 1), f"each pair: base | with the {NAME} LoRA",
                              fill="black", font=ImageFont.load_default())
    for i, (b, s) in enumerate(zip(base, styled, strict=True)):
        x, y = (i % columns) * (pair_w + gap), title + (i // columns) * (size + gap)
        for j, image in enumerate((b, s)):
            grid.paste(Image.fromarray(image).resize((size, size), Image.Resampling.NEAREST),
                       (x + j * (size + 2), y))
    grid.save(path)


def evaluate_lora(folder: Path, adapter: Path, out_dir: Path, *, n: int = 0, seed: int = 0,
                  steps: int = 16, guidance: float = 4.0, grid: Path | None = None
                  ) -> dict[str, object]:
    """Base vs adapter on the grammar (or the first `n` prompts of a fixed shuffle), same seeds;
    writes `out_dir/lora-metrics.json` and a side-by-side grid (default out_dir/lora-grid.png).
    """
    prompts = [s.caption for s in all_specs()]
    if n:
        prompts = [prompts[i] for i in np.random.default_rng(20261202).permutation(270)[:n]]
    pipe = load_pipeline(folder)
    draw = stock_drawer(pipe, steps=steps, guidance=guidance)

    def draw_all() -> list[np.ndarray]:
        return [image for i in range(0, len(prompts), EVAL_BATCH)
                for image in draw(prompts[i : i + EVAL_BATCH], seed)]

    base = draw_all()
    pipe.load_lora_weights(adapter, adapter_name=NAME)
    styled = draw_all()
    report: dict[str, object] = {
        "adapter": adapter.name, "n": len(prompts), "seed": seed, "steps": steps,
        "guidance": guidance, "style_background": STYLE_BACKGROUND,
        "base": effect_scores(base, prompts), "adapter_scores": effect_scores(styled, prompts),
        "shape_errors": {"base": shape_errors(base, prompts),
                         "adapter": shape_errors(styled, prompts)},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lora-metrics.json").write_text(json.dumps(report, indent=2))
    # every 10th prompt: all colours, shapes and backgrounds in 27 pairs
    write_side_by_side(base[::10][:27], styled[::10][:27], grid or out_dir / "lora-grid.png")
    log.info("base %s / adapter %s", report["base"], report["adapter_scores"])
    return report


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=("validate", "train", "evaluate"))
    parser.add_argument("--folder", default=None, help="base model (default: shipped)")
    parser.add_argument("--out", default=None, help="adapter folder (default: shipped)")
    parser.add_argument("--eval-dir", default="eval-results/tiny-shapes-lora")
    parser.add_argument("--n", type=int, default=0, help="evaluate: prompts (0 = all 270)")
    parser.add_argument("--steps", type=int, default=LoraConfig.steps)
    parser.add_argument("--grid", default=None)
    parser.add_argument("--snapshots", default=None,
                        help="train: also save the weights every --snapshot-every steps to "
                             "SNAPSHOTS/step-N")
    parser.add_argument("--snapshot-every", type=int, default=500)
    parser.add_argument("--set", nargs="*", default=[],
                        help="train: LoraConfig overrides, key=value (value as JSON)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    folder = Path(args.folder) if args.folder else SHIPPED_DIR
    out = Path(args.out) if args.out else SHIPPED_LORA_DIR / NAME
    import torch

    from stagemesh.models.tiny_shapes.harness import with_overrides

    torch.set_num_threads(1)  # a second thread is ~10x slower on a busy 2-core machine
    if args.action == "validate":
        log.info("%s", json.dumps(validate_style(load_pipeline(folder)), indent=1))
    elif args.action == "train":
        config = with_overrides(LoraConfig(steps=args.steps), args.set)
        train_lora(folder, out, config=config, snapshot_every=args.snapshot_every,
                   snapshots=Path(args.snapshots) if args.snapshots else None)
    else:
        evaluate_lora(folder, out, Path(args.eval_dir), n=args.n,
                      grid=Path(args.grid) if args.grid else None)


if __name__ == "__main__":
    main()
