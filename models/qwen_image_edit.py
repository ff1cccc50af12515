"""A seeded random-weight Qwen-Image-Edit model in the real diffusers folder layout.

`QwenImageEditPipeline` is Qwen-Image plus a `processor/` (Qwen2.5-VL's): the text encoder reads
the prompt together with the input image through its vision tower, and the transformer attends
to the VAE latents of the same image. So the folder is the `tiny` Qwen-Image components (same
builders, same seeds: `stagemesh.models.qwen_image.tiny_components`) plus a processor made of the
same Qwen tokenizer and transformers' Pil image processor.

The processor caps the image it gives the vision tower at `VL_MAX_PIXELS` (the real checkpoint
allows ~12.8 MP), which keeps a CPU edit cheap; the VAE still sees the pipeline's ~1 MP resize.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from transformers import PreTrainedTokenizerBase, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stagemesh.models.cache import build_into_cache
from stagemesh.models.families.qwen_vl_processor import (
    ImagesOnlyVideoProcessor,
    install_processor_support,
)
from stagemesh.models.qwen_image import (
    BUILD_STAMP,
    PRESETS,
    QWEN_IMAGE_SCHEDULER_CONFIG,
    stamp_matches,
    tiny_components,
)
from stagemesh.models.qwen_image import BUILDER_VERSION as QWEN_BUILDER_VERSION

logger = logging.getLogger(__name__)

#: Bump when this builder's output changes (the Qwen-Image builder's version counts too).
BUILDER_VERSION = 1
#: The components' preset (`stagemesh.models.qwen_image.PRESETS`).
PRESET = "edit"
#: The processor's bounds on the image given to the vision tower, in pixels (28x28 is one
#: merged vision token); the real checkpoint's minimum, and a 384x384-area maximum.
VL_MIN_PIXELS = 56 * 56
VL_MAX_PIXELS = 384 * 384


def build_tiny_qwen_image_edit(out_dir: Path, *, seed: int = 0) -> Path:
    """Write a loadable QwenImageEditPipeline folder with seeded random weights to `out_dir`."""
    components = tiny_components(PRESET, seed)
    processor = build_vl_processor(components["tokenizer"])
    pipe = QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        processor=processor,
        **components,
    )
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir)
    (out_dir / BUILD_STAMP).write_text(json.dumps(build_stamp(seed), indent=2))
    return out_dir


def build_vl_processor(tokenizer: PreTrainedTokenizerBase) -> Qwen2VLProcessor:
    """Qwen2.5-VL's processor over `tokenizer`, with the Pil image processor bounded to
    [VL_MIN_PIXELS, VL_MAX_PIXELS]."""
    install_processor_support()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=VL_MIN_PIXELS, max_pixels=VL_MAX_PIXELS)
    # transformers leaves the processor's __init__ unannotated.
    processor: Qwen2VLProcessor = Qwen2VLProcessor(  # type: ignore[no-untyped-call]
        image_processor=image_processor, tokenizer=tokenizer,
        video_processor=ImagesOnlyVideoProcessor())
    return processor


def build_stamp(seed: int) -> dict[str, object]:
    """What a folder was built from; a cached folder is reused only if its stamp is equal."""
    spec = json.loads(json.dumps(asdict(PRESETS[PRESET])))
    return {"builder_version": BUILDER_VERSION, "qwen_image_builder": QWEN_BUILDER_VERSION,
            "preset": PRESET, "seed": seed, "spec": spec,
            "vl_pixels": [VL_MIN_PIXELS, VL_MAX_PIXELS]}


def is_current(folder: Path, seed: int) -> bool:
    """Whether `folder` holds a complete build of exactly this seed and builder."""
    return stamp_matches(folder, build_stamp(seed))


def ensure_edit_model(*, seed: int = 0, root: Path | None = None) -> Path:
    """The cached folder `builtin:qwen-image-edit-tiny`, built once; concurrent callers never
    see a half-written folder and a stale build is replaced."""
    suffix = f"-seed{seed}" if seed else ""

    def build(folder: Path) -> None:
        logger.info("building qwen-image-edit-tiny into %s", folder)
        build_tiny_qwen_image_edit(folder, seed=seed)
        folder.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every stage

    return build_into_cache(f"qwen-image-edit-tiny{suffix}", build,
                            lambda folder: is_current(folder, seed), root)
