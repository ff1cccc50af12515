"""Trains tiny-shapes-edit and writes a stock diffusers Qwen-Image-Edit folder.

The VAE is tiny-shapes' own (copied, frozen: same world, same pixels), and the DiT starts from
tiny-shapes' trained transformer (it already draws the world; what it learns here is to read an
instruction and copy the rest of the input). The text encoder (Qwen2.5-VL with its vision tower)
and its tokenizer are built as tiny-shapes builds them, over the edit template and instructions.

Training follows `QwenImageEditPipeline`'s conventions: the text path is its `encode_prompt`
(instruction + input image through the processor), the input image's normalised latents are
packed after the noisy ones with `img_shapes` naming both, the loss is on the first half of the
prediction. The model conditions at its own output size: `condition.json` in the folder
(`stagemesh.models.families.qwen_image.CONDITION_FILE`) says so, where the stock pipeline
resizes every input to ~1 Mpx.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import PIL.Image
import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from stagemesh.models.families.qwen_image import write_condition_area
from stagemesh.models.qwen_image_edit import build_vl_processor
from stagemesh.models.registry import SHIPPED_TINY_SHAPES
from stagemesh.models.tiny_shapes import harness
from stagemesh.models.tiny_shapes import train as base
from stagemesh.models.tiny_shapes.data import IMAGE_SIZE
from stagemesh.models.tiny_shapes_edit.data import all_instructions, make_dataset, split

logger = logging.getLogger(__name__)

def _edit_template() -> tuple[str, int]:
    """The pipeline's own template and drop index, read off an instance with no components."""
    pipe = QwenImageEditPipeline(scheduler=None, vae=None, text_encoder=None,  # type: ignore[arg-type]
                                 tokenizer=None, processor=None, transformer=None)  # type: ignore[arg-type]
    return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx


def build_edit_tokenizer() -> Qwen2Tokenizer:
    """tiny-shapes' BPE built over the edit template and the instructions; the template's
    system prefix is the part the pipeline drops."""
    template, drop = _edit_template()
    return base.build_tokenizer(all_instructions(), template=template,
                                prefix=template.split("<|vision_start|>")[0], prefix_tokens=drop)


@dataclass(frozen=True)
class EditTrainConfig:
    """Everything that decides the trained weights besides the seed."""

    n_pairs: int = 12000
    text_dim: int = 64
    steps: int = 8000
    batch: int = 32
    lr: float = 4e-4
    warmup: int = 100
    caption_dropout: float = 0.2
    ema_decay: float = 0.998
    threads: int = 1
    balance_kinds: bool = True  # pairs drawn per kind, as reshape_share says (`data.pick_edits`)
    #: with balance_kinds, the reshapes' share of the pairs (`data.pick_edits`): the held-out
    #: reshape is the kind learned last (0.45 at 7500 steps: 68% -> 72-78% of it made)
    reshape_share: float = 0.55
    keep_when_dropped: bool = True  # a dropped instruction's target is the source itself
    snapshot: bool = False  # also write <out>-halfway, the EMA weights at half the steps
    #: the input image's tokens modulated as clean (timestep 0) rather than at the noisy
    #: step's timestep (Qwen-Image-Edit-2511's `zero_cond_t`): they tell themselves apart
    #: (at 5000 steps held-out recolours kept the rest 88% of the time, 63% without it at 3000)
    zero_cond_t: bool = True
    #: > 1: the flow error weighs this much on the latent pixels the shape touches in the
    #: source or the target (`base.latent_shape_mask`): the copy's outline is a few of them
    #: (x3 at 7500 steps: recolours kept the rest 92% -> 95%, moves 95% -> 100%)
    shape_weight: float = 3.0
    #: train also on instructions that name what the source already is (`data.no_op_edits`)
    no_op_edits: bool = False
    #: the fraction of pairs whose source is a distractor shape (`data.pick_edits`)
    distractors: float = 0.5
    #: start the text encoder from tiny-shapes' trained one (`text_encoder_from_base`), so the
    #: words the DiT (also tiny-shapes') already draws from ("square", "red") mean that at
    #: step 0, rather than from a random encoder
    text_from_base: bool = True

    @classmethod
    def proxy(cls) -> EditTrainConfig:
        return cls(n_pairs=4000, steps=1000, batch=24)

    @classmethod
    def smoke(cls) -> EditTrainConfig:
        return cls(n_pairs=64, steps=4, batch=4, warmup=2)


def _to_pil(images: np.ndarray) -> list[PIL.Image.Image]:
    return [PIL.Image.fromarray(image) for image in images]


def edit_loss(pipe: QwenImageEditPipeline, x0: torch.Tensor, cond: torch.Tensor,
              sources: list[PIL.Image.Image], instructions: list[str],
              gen: torch.Generator, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Rectified flow on the target latents, the source latents appended as the pipeline does;
    the squared error weighted per latent pixel by `weights` (N, 1, h, w) if given."""
    b, c, h, w = x0.shape
    noise = torch.randn(x0.shape, generator=gen)
    sigma = base.sample_sigmas(b, gen)
    s = sigma[:, None, None, None]
    xt = (1.0 - s) * x0 + s * noise
    embeds, mask = pipe.encode_prompt(instructions, image=sources,  # type: ignore[arg-type]
                                      device=torch.device("cpu"))
    packed = pipe._pack_latents(xt, b, c, h, w)
    hidden = torch.cat([packed, pipe._pack_latents(cond, b, c, h, w)], dim=1)
    pred = pipe.transformer(
        hidden_states=hidden,
        timestep=sigma,
        encoder_hidden_states=embeds,
        encoder_hidden_states_mask=mask,
        img_shapes=[[(1, h // 2, w // 2), (1, h // 2, w // 2)]] * b,
        return_dict=False,
    )[0][:, : packed.shape[1]]
    err: torch.Tensor = (pred - pipe._pack_latents(noise - x0, b, c, h, w)).pow(2)
    if weights is not None:
        err = err * pipe._pack_latents(weights.expand(-1, c, -1, -1), b, c, h, w)
    return err.mean()


def pair_shape_weights(sources: np.ndarray, targets: np.ndarray, weight: float, factor: int
                       ) -> torch.Tensor:
    """(N, 1, H / factor, W / factor): `weight` on the latent pixels the shape touches in the
    source or the target of each pair, else 1."""
    touched = torch.maximum(base.latent_shape_mask(sources, factor),
                            base.latent_shape_mask(targets, factor))
    return 1.0 + (weight - 1.0) * touched


def train_edit(pipe: QwenImageEditPipeline, targets: torch.Tensor, conds: torch.Tensor,
               sources: list[PIL.Image.Image], instructions: list[str], cfg: EditTrainConfig,
               gen: torch.Generator, halfway: Callable[[], None] | None = None,
               weights: torch.Tensor | None = None) -> list[float]:
    """Trains transformer + text encoder (vision tower included); leaves the EMA weights in.
    `weights` (N, 1, h, w), if given, weigh each pair's flow error per latent pixel.

    `halfway`, if given, runs once with the EMA weights loaded at half the steps (a snapshot to
    judge early). Returns the 1-minute load average sampled every 50 steps (others share this
    machine)."""
    modules = torch.nn.ModuleDict({"transformer": pipe.transformer,
                                   "text_encoder": pipe.text_encoder})
    ema = harness.Ema(modules, cfg.ema_decay)

    def loss_at(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(targets), (cfg.batch,), generator=gen).tolist()
        drop = (torch.rand(cfg.batch, generator=gen) < cfg.caption_dropout).tolist()
        batch_text = ["" if d else instructions[i] for i, d in zip(idx, drop, strict=True)]
        x0 = targets[idx]
        if cfg.keep_when_dropped:
            # "" reads as "change nothing": the guidance's negative (the recipe's "") is then
            # the source copied, and true CFG amplifies only what the instruction changes.
            x0 = torch.where(torch.tensor(drop)[:, None, None, None], conds[idx], x0)
        return edit_loss(pipe, x0, conds[idx], [sources[i] for i in idx], batch_text, gen,
                         None if weights is None else weights[idx])

    def after_step(step: int) -> None:
        ema.update(step)
        if halfway is not None and step + 1 == cfg.steps // 2:
            with ema.swapped_in():
                halfway()

    modules.train()
    load = harness.optimise([p for p in modules.parameters() if p.requires_grad], loss_at,
                            steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, clip=1.0,
                            desc="edit", after_step=after_step)
    ema.finish()
    return load


def text_encoder_from_base(encoder: torch.nn.Module, tokenizer: Qwen2Tokenizer,
                           base_dir: Path) -> int:
    """Loads `base_dir`'s text model into `encoder` (same sizes; the vision tower, which the
    text-to-image pipeline never calls, stays as built): every weight but the embedding, and
    the embedding row of every token whose text both vocabularies share. Returns that count."""
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(base_dir / "text_encoder")
    base_vocab = Qwen2Tokenizer.from_pretrained(base_dir / "tokenizer").get_vocab()
    theirs, ours = base.state_dict(), encoder.state_dict()
    embedding = "model.language_model.embed_tokens.weight"
    for name, value in theirs.items():
        if name.startswith("model.language_model.") and name != embedding:
            ours[name] = value
    shared = [(i, base_vocab[token]) for token, i in tokenizer.get_vocab().items()
              if token in base_vocab]
    rows = torch.tensor(shared)
    ours[embedding][rows[:, 0]] = theirs[embedding][rows[:, 1]]
    encoder.load_state_dict(ours)  # lm_head is tied to the embedding
    return len(shared)


def normalised_latents(vae: AutoencoderKLQwenImage, images: np.ndarray) -> torch.Tensor:
    """What the pipeline's `_encode_vae_image` gives (posterior mode, normalised)."""
    latents = base.encode_latents(vae, images)
    mean = torch.tensor(vae.config["latents_mean"])[None, :, None, None]
    std = torch.tensor(vae.config["latents_std"])[None, :, None, None]
    return (latents - mean) / std


def train(out_dir: str | Path, *, seed: int = 0, config: EditTrainConfig | None = None) -> Path:
    """Renders training edits, trains, writes the folder and its training.json."""
    cfg = config or EditTrainConfig()
    return harness.with_threads(cfg.threads, lambda: _train(Path(out_dir), cfg, seed))


def _train(out: Path, cfg: EditTrainConfig, seed: int) -> Path:
    gen = harness.seeded_generator(seed)
    timings: dict[str, float] = {}
    cpu_start = time.process_time()
    training_edits, held_out = split(no_ops=cfg.no_op_edits)
    sources, targets, instructions = harness.phase(
        "render", lambda: make_dataset(training_edits, cfg.n_pairs, seed=seed,
                                       balance_kinds=cfg.balance_kinds,
                                       reshape_share=cfg.reshape_share,
                                       distractors=cfg.distractors), timings)

    tokenizer = build_edit_tokenizer()
    vae = AutoencoderKLQwenImage.from_pretrained(SHIPPED_TINY_SHAPES / "vae")
    vae.requires_grad_(False)
    transformer = QwenImageTransformer2DModel.from_pretrained(
        SHIPPED_TINY_SHAPES / "transformer", zero_cond_t=cfg.zero_cond_t)
    if transformer.config.joint_attention_dim != cfg.text_dim:
        raise ValueError("text_dim must be tiny-shapes' joint_attention_dim")
    text_encoder = base.build_text_encoder(tokenizer, cfg.text_dim)
    if cfg.text_from_base:
        shared = text_encoder_from_base(text_encoder, tokenizer, SHIPPED_TINY_SHAPES)
        logger.info("text encoder from tiny-shapes': %d of %d tokens shared", shared,
                    len(tokenizer))
    pipe = QwenImageEditPipeline(
        scheduler=base.build_scheduler(),  # type: ignore[arg-type]
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=build_vl_processor(tokenizer),
        transformer=transformer,
    )
    conds = normalised_latents(vae, sources)
    x0 = normalised_latents(vae, targets)
    weights = None
    if cfg.shape_weight != 1.0:
        weights = pair_shape_weights(sources, targets, cfg.shape_weight,
                                     factor=sources.shape[1] // x0.shape[-1])

    def save(folder: Path) -> None:
        pipe.save_pretrained(folder, safe_serialization=True)
        write_condition_area(folder, IMAGE_SIZE * IMAGE_SIZE)
        base.fit_preview(folder, targets)

    snapshot = out.with_name(out.name + "-halfway")
    load = harness.phase("dit", lambda: train_edit(
        pipe, x0, conds, _to_pil(sources), instructions, cfg, gen,
        halfway=lambda: save(snapshot) if cfg.snapshot else None, weights=weights), timings)
    save(out)
    report = {"config": asdict(cfg), "seed": seed, "seconds": timings,
              "cpu_seconds": round(time.process_time() - cpu_start, 1),
              "load_average_1min": harness.load_summary(load),
              "image_size": IMAGE_SIZE, "base_model": "tiny-shapes (vae, transformer init)",
              "held_out_edits": len(held_out), "training_edits": len(training_edits)}
    (out / "training.json").write_text(json.dumps(report, indent=2))
    logger.info("wrote %s (%s)", out, report["seconds"])
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--proxy", action="store_true", help="the <= 10 minute config")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="EditTrainConfig overrides, k=v")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = (EditTrainConfig.smoke() if args.smoke else
           EditTrainConfig.proxy() if args.proxy else EditTrainConfig())
    cfg = harness.with_overrides(cfg, args.set)
    train(args.out_dir, seed=args.seed, config=cfg)


if __name__ == "__main__":
    main()
