"""Which recipes `stagemesh serve` can serve: those whose stages have the optional extras they
need (`stagemesh.shared.extras`) installed.

A recipe with a stage whose extra is missing is skipped, with one warning per extra naming the
recipes it skips and the install command; so is a chat recipe whose `speech:` names a skipped
recipe (it would answer text but fail every spoken answer; without the extra, chat goes with
its voice). The gateway then lists only what is served (/v1/models, /health). `--strict` makes
a missing extra fatal instead: before any model is prepared where the recipes' models are
built-in (`stagemesh.models.registry.builtin_stage_extras`), so that it refuses in seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from stagemesh.gateway.recipes import Recipe
from stagemesh.shared.extras import Extra

log = logging.getLogger(__name__)


class MissingExtra(RuntimeError):
    """An optional extra a recipe needs is not installed, and serve must not skip it."""


def servable_recipes(recipes: Mapping[str, Recipe],
                     extras: Mapping[str, Mapping[str, Extra]],
                     strict: bool = False) -> dict[str, Recipe]:
    """`recipes` without those that need a missing extra (see the module docstring), given
    model spec -> stage -> the extra it needs (a spec not in `extras`: none); MissingExtra when
    `strict`, or when nothing is left to serve."""
    lacking: dict[str, tuple[Extra, str]] = {}  # recipe -> the extra it lacks, and why
    for name, recipe in recipes.items():
        needs = extras.get(recipe.model, {})
        stage = next((s for s in recipe.stages if s in needs and not needs[s].installed()), None)
        if stage is not None:
            lacking[name] = (needs[stage], f"its {stage} stage")
    for name, recipe in recipes.items():
        if recipe.speech in lacking and name not in lacking:
            lacking[name] = (lacking[recipe.speech][0], f"it speaks through {recipe.speech}")
    skipped: dict[Extra, list[str]] = {}  # extra -> the recipes it skips, with why
    for name, (extra, why) in lacking.items():
        skipped.setdefault(extra, []).append(f"{name} ({why})")
    for extra, reasons in skipped.items():
        several = len(reasons) > 1
        message = (f"recipe{'s' if several else ''} {', '.join(reasons)}: the {extra.name} extra "
                   f"({extra.what}) is not installed; to serve {'them' if several else 'it'}: "
                   f"{extra.install_hint}")
        if strict:
            raise MissingExtra(f"{message}; without --strict, serve skips "
                               f"{'them' if several else 'it'}")
        log.warning("skipping %s", message)
    served = {name: recipe for name, recipe in recipes.items() if name not in lacking}
    if not served:
        raise MissingExtra("no recipe left to serve: "
                           + "; ".join(extra.install_hint for extra in skipped))
    return served
