"""Loading Qwen-Image-Edit's `processor/` (a transformers `Qwen2VLProcessor`) without torchvision.

`Qwen2VLProcessor` has three slots: tokenizer, image processor and video processor. transformers
only provides video processors backed by torchvision, which does not match our torch build, and
without one the processor cannot even be constructed (its class check looks the video base class
up in the top-level namespace, which only exports it when torchvision is importable). The edit
pipeline never passes videos, so `install_processor_support()` registers a video processor that
refuses videos and makes the base class findable. The image side is transformers' own
`Qwen2VLImageProcessorPil`: the folder's config names the base `Qwen2VLImageProcessor`, which
transformers resolves to the Pil class where torchvision is missing (`load_vl_processor` checks
that it did), so the stages and the stock pipeline read images the same way here. With
torchvision present the shim does nothing (and transformers would pick its torchvision class).

Call `install_processor_support()` (or `load_vl_processor`) before any `from_pretrained` that
loads such a folder, including the stock `QwenImageEditPipeline.from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import transformers.processing_utils
from transformers import Qwen2_5_VLConfig, Qwen2VLProcessor
from transformers.models.auto.video_processing_auto import AutoVideoProcessor
from transformers.utils.import_utils import is_torchvision_available
from transformers.video_processing_utils import VideoProcessorMixin

#: The subfolder of an edit pipeline folder that holds the processor.
PROCESSOR_FOLDER = "processor"
#: The image processor class the stages must read images with (`load_vl_processor` checks).
IMAGE_PROCESSOR_CLASS = "Qwen2VLImageProcessorPil"


class ImagesOnlyVideoProcessor(VideoProcessorMixin):
    """Fills `Qwen2VLProcessor`'s video slot where torchvision is missing; videos are refused."""

    def preprocess(self, videos: object, **kwargs: object) -> NoReturn:
        raise ValueError("this processor takes images only (no torchvision video processor)")


def install_processor_support() -> None:
    """Make `Qwen2VLProcessor` constructible and loadable without torchvision. Idempotent."""
    if is_torchvision_available():
        return
    namespace = transformers.processing_utils.transformers_module
    if getattr(namespace, VideoProcessorMixin.__name__, None) is not VideoProcessorMixin:
        setattr(namespace, VideoProcessorMixin.__name__, VideoProcessorMixin)
    AutoVideoProcessor.register(Qwen2_5_VLConfig, ImagesOnlyVideoProcessor, exist_ok=True)


def load_vl_processor(model_dir: str | Path) -> Qwen2VLProcessor:
    """The folder's processor, loaded offline, with the Pil image processor."""
    install_processor_support()
    processor = Qwen2VLProcessor.from_pretrained(
        Path(model_dir) / PROCESSOR_FOLDER, local_files_only=True)
    if type(processor.image_processor).__name__ != IMAGE_PROCESSOR_CLASS:
        raise ValueError(f"{model_dir}/{PROCESSOR_FOLDER}: expected {IMAGE_PROCESSOR_CLASS}, got "
                         f"{type(processor.image_processor).__name__}")
    return processor
