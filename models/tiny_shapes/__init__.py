"""tiny-shapes: a tiny text-to-image model built from the stock Qwen-Image classes.

`data` renders the synthetic world, `train` trains and writes a diffusers folder, `scoring`
reads attributes off generated pixels, `evaluate` runs the whole grammar through any generator.
"""

from stagemesh.models.registry import SHIPPED_TINY_SHAPES as SHIPPED_DIR

__all__ = ["SHIPPED_DIR"]
