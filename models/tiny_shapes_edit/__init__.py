"""tiny-shapes-edit: a tiny Qwen-Image-Edit model trained on edits of the tiny-shapes world.

`data` makes (source, instruction, target) triples and the held-out split, `train` trains the
DiT and text encoder on the shipped tiny-shapes VAE and writes a diffusers folder, `judge`
reads an edit's result off its pixels, `evaluate` runs the held-out edits through a generator.
"""

from stagemesh.models.registry import SHIPPED_TINY_SHAPES_EDIT as SHIPPED_DIR

__all__ = ["SHIPPED_DIR"]
