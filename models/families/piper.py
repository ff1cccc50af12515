"""The Piper family (VITS voices run on ONNX Runtime), split at the latent z into two graphs.

A Piper voice is one ONNX graph: phoneme ids -> text encoder, duration predictor and flow ->
z [B, 192, frames] -> HiFi-GAN decoder -> waveform (256 samples per frame). `stagemesh model
prepare builtin:piper-joe` (`stagemesh.models.piper`) cuts it at z into a talker graph and a
codec graph, and writes this folder layout (ours):

    piper-joe/
      stagemesh.json       {"family": "piper", "talker": ..., "codec": ..., "voices": [...],
                            "output_gain": ..., "latent_channels": 192, "hop_samples": 256,
                            "noise_inputs": {...}, "version": ...}
      talker.onnx          phoneme ids, lengths, scales, and the noise inputs -> z, z's mask
      codec.onnx           z -> waveform
      voice.onnx.json      the voice's own Piper config (phoneme map, espeak voice, sample
                           rate, noise scales), copied verbatim

The stock graph draws its noise with two `RandomNormalLike` nodes, which keep their generator
state inside the ONNX Runtime session (the same request would sound different every time).
The talker graph takes that noise as inputs instead (`noise_inputs`: input name -> channels,
each [B, length, channels] of standard normal samples), so the talker stage draws it from the
request's seed: same seed, same audio, with the stock voice's distribution.

This module reads the folder; it never builds one (see `stagemesh.models.piper`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import onnxruntime  # type: ignore[import-untyped]  # ships no type information

from stagemesh.models.families import CONFIG_FILE, PIPER_FAMILY, RESERVED_VOICE_NAMES

FAMILY = PIPER_FAMILY
VOICE_CONFIG_FILE = "voice.onnx.json"
TALKER_FILE = "talker.onnx"
CODEC_FILE = "codec.onnx"
#: Graph tensor names of the split (inputs of the talker, its outputs, the codec's).
PHONEMES_INPUT, LENGTHS_INPUT, SCALES_INPUT = "input", "input_lengths", "scales"
LATENT_OUTPUT, MASK_OUTPUT = "z", "z_mask"
CODEC_INPUT, CODEC_OUTPUT = "z", "audio"
#: The noise inputs, in the order the talker draws them from a sentence's generator.
DURATION_NOISE, PRIOR_NOISE = "duration_noise", "prior_noise"


@dataclass(frozen=True)
class NoiseScales:
    """Piper's synthesis scales (the voice config's `inference`)."""

    noise_scale: float  # prior sample: z = mean + noise * noise_scale * std
    length_scale: float  # > 1 speaks slower
    noise_w: float  # duration predictor noise


@dataclass(frozen=True)
class PiperVoiceFolder:
    """A prepared Piper folder: its graphs and the facts both stages need."""

    root: Path
    talker_graph: Path
    codec_graph: Path
    voices: tuple[str, ...]  # lower case; a Piper voice file holds one speaker
    sample_rate: int
    hop_samples: int  # waveform samples per z frame
    latent_channels: int  # z channels
    output_gain: float  # fixed gain on the decoder's output (no per-sentence peak normalisation)
    scales: NoiseScales
    espeak_voice: str  # the espeak-ng voice that phonemizes text for this model
    phoneme_id_map: dict[str, list[int]]
    noise_channels: dict[str, int]  # noise input name -> channels

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop_samples

    @classmethod
    def load(cls, model_dir: str | Path) -> PiperVoiceFolder:
        root = Path(model_dir)
        # JSON written by stagemesh.models.piper and by Piper; every value is converted below.
        config = json.loads((root / CONFIG_FILE).read_text())
        if config.get("family") != FAMILY:
            raise ValueError(f"{root} is not a Piper folder (family {config.get('family')!r})")
        voice = json.loads((root / VOICE_CONFIG_FILE).read_text())
        inference = voice["inference"]
        voices = tuple(str(v).lower() for v in config["voices"])
        if not voices or set(voices) & set(RESERVED_VOICE_NAMES) or len(set(voices)) != len(voices):
            raise ValueError(f"{root / CONFIG_FILE}: voices must be unique, non-empty and none "
                             f"named {RESERVED_VOICE_NAMES}")
        return cls(
            root=root, talker_graph=root / str(config["talker"]),
            codec_graph=root / str(config["codec"]), voices=voices,
            sample_rate=int(voice["audio"]["sample_rate"]),
            hop_samples=int(config["hop_samples"]),
            latent_channels=int(config["latent_channels"]),
            output_gain=float(config["output_gain"]),
            scales=NoiseScales(noise_scale=float(inference["noise_scale"]),
                               length_scale=float(inference["length_scale"]),
                               noise_w=float(inference["noise_w"])),
            espeak_voice=str(voice["espeak"]["voice"]),
            phoneme_id_map={str(k): [int(i) for i in v]
                            for k, v in voice["phoneme_id_map"].items()},
            noise_channels={str(k): int(v) for k, v in config["noise_inputs"].items()},
        )


def open_session(graph: Path, threads: int = 1) -> onnxruntime.InferenceSession:
    """An ONNX Runtime CPU session for one of the folder's graphs.

    `threads` intra-op threads (a stage process gets its share of cores, as for torch), no
    inter-op pool, and no spinning: stages share cores, so an idle thread must sleep at once.
    """
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
