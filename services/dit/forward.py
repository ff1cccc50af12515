"""Our own block loop for the DiT transformers (Qwen-Image, Wan): one forward, per-row hooks.

`qwen_image_forward` and `wan_forward` compute exactly what the diffusers transformers' own
`forward` computes for what our adapters pass (no guidance embedding, no controlnet, no image
embeddings, no attention kwargs): the same modules called in the same order with the same
arguments, so with no hooks the result is bit for bit diffusers'. What they add is the loop:
every row of the batch carries its metadata (`RowMeta`: request id and CFG branch), and a
`RowHooks` object may, after the first block, let some rows leave the forward (a step cache
that reuses their cached remainder) while the others run the remaining blocks as a smaller
batch. Block-level interrupts stay forward pre-hooks on the blocks (`BlockInterruptHooks`), so
they fire in this loop exactly as in diffusers' one.

Row selection happens in Python between blocks, outside any compiled region (ARCHITECTURE §10).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from math import prod
from typing import Protocol, TypeVar

import torch
from diffusers.models.transformers.transformer_qwenimage import (
    QwenImageTransformer2DModel,
    compute_text_seq_len_from_mask,
)
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel


class Branch(enum.Enum):
    """Which prompt a row runs under: its own, or (CFG) the negative one."""

    COND = "cond"
    UNCOND = "uncond"


@dataclass(frozen=True)
class SlotUse:
    """A LoRA adapter a row runs under: its resident slot and the request's scale."""

    slot: int
    scale: float


@dataclass(frozen=True)
class RowMeta:
    """What a forward knows of one of its rows: request, CFG branch, LoRA adapters (a guided
    request's unconditional row carries its conditional row's, as in diffusers)."""

    request_id: str
    branch: Branch
    adapters: tuple[SlotUse, ...] = ()


class RowAdapters(Protocol):
    """Per-row module state of one forward (the LoRA slot product, services/dit/lora_slots.py):
    bound to the rows for the whole forward, narrowed to the rows that run a block subset."""

    def bind(self, rows: Sequence[RowMeta]) -> AbstractContextManager[None]: ...

    def narrowed(self, rows: torch.Tensor) -> AbstractContextManager[None]: ...


class RowHooks(Protocol):
    """Per-row decisions inside one forward, called by `run_blocks`."""

    def after_first_block(self, before: torch.Tensor, after: torch.Tensor) -> list[int]:
        """The rows (ascending indices) that run the remaining blocks, given the image hidden
        states [rows, tokens, dim] before and after the first block."""
        ...

    def after_last_block(
        self, head: torch.Tensor, rows: list[int], tail: torch.Tensor | None
    ) -> torch.Tensor:
        """The image hidden states of every row after the last block: `tail` holds those of
        `rows` (None when no row ran), `head` every row's after the first block."""
        ...


StreamT = TypeVar("StreamT", bound="_Stream")


class _Stream(Protocol):
    """A batch's per-row tensors between blocks; `run` advances them through one block."""

    hidden: torch.Tensor

    def run(self, block: torch.nn.Module) -> None: ...

    def select(self: StreamT, rows: torch.Tensor) -> StreamT: ...


def run_blocks(
    blocks: torch.nn.ModuleList | Sequence[torch.nn.Module],
    stream: _Stream,
    hooks: RowHooks | None,
    adapters: RowAdapters | None = None,
) -> torch.Tensor:
    """Every block over the batch, or with `hooks` the first over all rows and the others over
    the rows the hooks keep (and `adapters` narrowed to them); the image hidden states of every
    row after the last block."""
    if hooks is None or len(blocks) < 2:  # a cache needs a head block and a tail
        for block in blocks:
            stream.run(block)
        return stream.hidden
    before = stream.hidden
    stream.run(blocks[0])
    head = stream.hidden
    rows = hooks.after_first_block(before, head)
    if not rows:
        return hooks.after_last_block(head, rows, None)
    rest: _Stream = stream
    narrowed: AbstractContextManager[None] = nullcontext()
    if len(rows) < head.shape[0]:
        kept = torch.tensor(rows, device=head.device)
        rest = stream.select(kept)
        if adapters is not None:
            narrowed = adapters.narrowed(kept)
    with narrowed:
        for block in blocks[1:]:
            rest.run(block)
    return hooks.after_last_block(head, rows, rest.hidden)


@dataclass
class _QwenStream:
    hidden: torch.Tensor
    encoder: torch.Tensor
    mask: torch.Tensor | None
    temb: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]
    modulate_index: torch.Tensor | None

    def run(self, block: torch.nn.Module) -> None:
        self.encoder, self.hidden = block(
            hidden_states=self.hidden,
            encoder_hidden_states=self.encoder,
            encoder_hidden_states_mask=self.mask,
            temb=self.temb,
            image_rotary_emb=self.rotary,
            joint_attention_kwargs=None,
            modulate_index=self.modulate_index,
        )

    def select(self, rows: torch.Tensor) -> _QwenStream:
        temb = self.temb
        if self.modulate_index is not None:  # zero_cond_t: temb holds [rows..., rows at t=0...]
            temb = temb[torch.cat([rows, rows + self.hidden.shape[0]])]
        else:
            temb = temb[rows]
        return replace(
            self,
            hidden=self.hidden[rows],
            encoder=self.encoder[rows],
            mask=None if self.mask is None else self.mask[rows],
            temb=temb,
            modulate_index=None if self.modulate_index is None else self.modulate_index[rows],
        )


def qwen_image_forward(
    transformer: QwenImageTransformer2DModel,
    *,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    timestep: torch.Tensor,
    img_shapes: list[list[tuple[int, int, int]]],
    rows: Sequence[RowMeta],
    hooks: RowHooks | None = None,
    adapters: RowAdapters | None = None,
) -> torch.Tensor:
    """`QwenImageTransformer2DModel.forward(..., guidance=None, return_dict=False)[0]`, with
    each row's LoRA adapters when `adapters` is given."""
    _check_rows(rows, hidden_states)
    with _bound(adapters, rows):
        t = transformer
        hidden = t.img_in(hidden_states)
        timestep = timestep.to(hidden.dtype)
        modulate_index = None
        if t.zero_cond_t:
            timestep = torch.cat([timestep, timestep * 0], dim=0)
            modulate_index = torch.tensor(
                [[0] * prod(s[0]) + [1] * sum(prod(x) for x in s[1:]) for s in img_shapes],
                device=timestep.device,
                dtype=torch.int,
            )
        encoder = t.txt_in(t.txt_norm(encoder_hidden_states))
        text_seq_len, _, mask = compute_text_seq_len_from_mask(encoder, encoder_hidden_states_mask)
        temb = t.time_text_embed(timestep, hidden, None)
        rotary = t.pos_embed(img_shapes, max_txt_seq_len=text_seq_len, device=hidden.device)
        stream = _QwenStream(hidden, encoder, mask, temb, rotary, modulate_index)
        hidden = run_blocks(t.transformer_blocks, stream, hooks, adapters)
        if t.zero_cond_t:
            temb = temb.chunk(2, dim=0)[0]
        output: torch.Tensor = t.proj_out(t.norm_out(hidden, temb))
        return output


@dataclass
class _WanStream:
    hidden: torch.Tensor
    encoder: torch.Tensor
    timestep_proj: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]

    def run(self, block: torch.nn.Module) -> None:
        self.hidden = block(self.hidden, self.encoder, self.timestep_proj, self.rotary)

    def select(self, rows: torch.Tensor) -> _WanStream:
        return replace(
            self,
            hidden=self.hidden[rows],
            encoder=self.encoder[rows],
            timestep_proj=self.timestep_proj[rows],
        )


def wan_forward(
    transformer: WanTransformer3DModel,
    *,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    rows: Sequence[RowMeta],
    hooks: RowHooks | None = None,
    adapters: RowAdapters | None = None,
) -> torch.Tensor:
    """`WanTransformer3DModel.forward(..., return_dict=False)[0]` for one timestep per row and
    no image embeddings (the Wan models we serve), with each row's LoRA adapters when
    `adapters` is given."""
    _check_rows(rows, hidden_states)
    if timestep.ndim != 1:
        raise ValueError("one timestep per row (Wan 2.2 TI2V's per-token timesteps are not served)")
    with _bound(adapters, rows):
        t = transformer
        batch, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = t.config["patch_size"]
        rotary = t.rope(hidden_states)
        hidden = t.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
        temb, timestep_proj, encoder, _ = t.condition_embedder(
            timestep, encoder_hidden_states, None
        )
        timestep_proj = timestep_proj.unflatten(1, (6, -1))
        hidden = run_blocks(
            t.blocks, _WanStream(hidden, encoder, timestep_proj, rotary), hooks, adapters
        )
        shift, scale = (t.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
        shift, scale = shift.to(hidden.device), scale.to(hidden.device)
        hidden = (t.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = t.proj_out(hidden)
        hidden = hidden.reshape(
            batch, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1
        )
        hidden = hidden.permute(0, 7, 1, 4, 2, 5, 3, 6)
        output: torch.Tensor = hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)
        return output


def _bound(adapters: RowAdapters | None, rows: Sequence[RowMeta]) -> AbstractContextManager[None]:
    return nullcontext() if adapters is None else adapters.bind(rows)


def _check_rows(rows: Sequence[RowMeta], hidden_states: torch.Tensor) -> None:
    if len(rows) != hidden_states.shape[0]:
        raise ValueError(f"{len(rows)} row metadata for a batch of {hidden_states.shape[0]}")
