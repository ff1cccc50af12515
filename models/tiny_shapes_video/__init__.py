"""tiny-shapes-video: a tiny Wan text-to-video model trained on clips of moving shapes.

`data` renders the clips and the held-out split, `train` trains the VAE (4x spatial, 4x temporal)
and the transformer + text encoder and writes a diffusers Wan folder, `judge` reads shape, colour
and motion off a clip's pixels, `evaluate` runs the held-out prompts through any generator.
"""

from stagemesh.models.registry import SHIPPED_TINY_SHAPES_VIDEO as SHIPPED_DIR

__all__ = ["SHIPPED_DIR"]
