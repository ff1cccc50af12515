"""The Sesame CSM family (`CsmForConditionalGeneration` folders, e.g. `sesame/csm-1b`).

CSM's prompt is a list of segments `<bos>[speaker]text<eos>`; a segment with a reference clip
is followed by one audio placeholder per codec frame and an audio end-of-segment token. Which
tokens these are is the folder's own business: the bos/eos tokens are the tokenizer's
(`<|begin_of_text|>` / `<|end_of_text|>` in the real checkpoint), the audio tokens are what
`CsmProcessor` resolves from that tokenizer (`<|AUDIO|>` / `<|audio_eos|>`). `CsmPromptFormat`
reads them from the folder, so a real checkpoint and the tiny built one take the same path.

stagemesh adds two things to the layout: `voices.json` (named voices -> CSM speaker ids) and
`codec/`, the Mimi weights as a plain `MimiModel` folder (the layout of `kyutai/mimi`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import CsmConfig, CsmProcessor, MimiConfig, PreTrainedTokenizerBase

from stagemesh.models.families import RESERVED_VOICE_NAMES
from stagemesh.models.families.tokens import token_id

CODEC_SUBFOLDER = "codec"
VOICES_FILE = "voices.json"


@dataclass(frozen=True)
class ChatMarkers:
    """The tokens of CSM's prompt markup, as one model folder defines them."""

    segment_start: str  # the tokenizer's bos token
    segment_end: str  # the tokenizer's eos token
    audio: str  # one per reference codec frame
    audio_eos: str  # closes a reference clip


@dataclass(frozen=True)
class CsmFacts:
    """What the talker needs to know about a CSM model, read from its config."""

    num_codebooks: int  # codes per audio frame
    end_of_audio_code: int  # a frame of only this code ends the audio
    codec_vocab: int  # codes the codec can decode (CSM's codebook vocabulary has a few more)
    max_positions: int  # backbone positions: prompt + generated frames
    frame_rate: float  # codec frames per second of audio

    @classmethod
    def of(cls, config: CsmConfig) -> CsmFacts:
        codec = config.codec_config
        eos, codebooks = config.codebook_eos_token_id, config.num_codebooks
        if not (isinstance(codec, MimiConfig) and isinstance(eos, int) and codebooks):
            raise ValueError(
                "a CSM config needs a Mimi codec_config, num_codebooks and one "
                "codebook_eos_token_id"
            )
        return cls(
            num_codebooks=codebooks,
            end_of_audio_code=eos,
            codec_vocab=codec.codebook_size,
            max_positions=config.max_position_embeddings,
            frame_rate=float(codec.frame_rate),
        )


class CsmPromptFormat:
    """CSM's prompt layout over a folder's own tokenizer and markers, as token ids."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, markers: ChatMarkers) -> None:
        self.tokenizer = tokenizer
        self.markers = markers
        self.segment_end_id = token_id(tokenizer, markers.segment_end)
        self.audio_id = token_id(tokenizer, markers.audio)
        self.audio_eos_id = token_id(tokenizer, markers.audio_eos)

    @classmethod
    def from_folder(cls, model_dir: str | Path) -> CsmPromptFormat:
        """The tokenizer and markers of a CSM folder (its CsmProcessor files)."""
        processor = CsmProcessor.from_pretrained(model_dir, local_files_only=True)
        return cls(processor.tokenizer, chat_markers(processor))

    @property
    def text_vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, without the tokenizer's own special tokens."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def segment_ids(self, speaker: int, text_ids: Sequence[int]) -> list[int]:
        """One text segment `<bos>[speaker]text<eos>` as ids (the markup encoded apart from the
        text, so ids from the Tokenizer stage can be spliced in)."""
        head = self.encode(f"{self.markers.segment_start}[{speaker}]")
        return [*head, *text_ids, self.segment_end_id]

    def reference_audio_ids(self, num_frames: int) -> list[int]:
        """The placeholders of a reference clip: one per codec frame, then audio-eos."""
        return [self.audio_id] * num_frames + [self.audio_eos_id]


def chat_markers(processor: CsmProcessor) -> ChatMarkers:
    """The markers a loaded CsmProcessor uses: bos/eos from its tokenizer, the audio tokens as
    the processor resolved them (the tokenizer's `audio_token`s, else CSM's defaults)."""
    tokenizer: PreTrainedTokenizerBase = processor.tokenizer
    special = tokenizer.special_tokens_map
    missing = [name for name in ("bos_token", "eos_token") if name not in special]
    if missing:
        raise ValueError(f"the CSM tokenizer defines no {' or '.join(missing)}")
    audio: str = processor.audio_token
    audio_eos: str = processor.audio_eos_token
    return ChatMarkers(
        segment_start=special["bos_token"],
        segment_end=special["eos_token"],
        audio=audio,
        audio_eos=audio_eos,
    )


def load_voices(model_dir: str | Path) -> dict[str, int]:
    """Voice name (lower case) -> CSM speaker id, in the folder's order (the first is the
    default voice unless the stage is told otherwise)."""
    path = Path(model_dir) / VOICES_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: a CSM folder served by stagemesh names its voices there, "
            'e.g. {"voices": {"alice": 0, "bob": 1}}'
        )
    raw = json.loads(path.read_text())["voices"]
    voices = {str(name).lower(): int(speaker) for name, speaker in raw.items()}
    if not voices or len(voices) != len(raw) or "" in voices:
        raise ValueError(f"{path}: voice names must be non-empty and unique ignoring case")
    reserved = sorted(set(voices) & set(RESERVED_VOICE_NAMES))
    if reserved or min(voices.values()) < 0:
        raise ValueError(
            f"{path}: speaker ids must be >= 0 and no voice may be named {RESERVED_VOICE_NAMES}"
        )
    return voices


def codec_dir(model_dir: str | Path) -> Path:
    """The Mimi folder: `<csm>/codec` for a CSM folder, else `model_dir` itself."""
    root = Path(model_dir)
    sub = root / CODEC_SUBFOLDER
    return sub if (sub / "config.json").is_file() else root
