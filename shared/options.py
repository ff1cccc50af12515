"""A stage's recipe `options:` (operator policy), checked once at start-up.

Each stage declares the options it takes as TypedDicts (total=False): one group per consumer,
for example the engine's options and the adapter's keyword arguments. `parse_options` checks
every key and value against them and hands each group back on its own, so it can be passed on
as `**group` (the type checker matches it against the consumer's signature). An absent key
stays absent: its default belongs to the consumer, never restated here.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import TypedDict, TypeVar, Union, get_args, get_origin, get_type_hints, overload

#: A TypedDict class describing one group of options.
GroupA = TypeVar("GroupA", bound=Mapping[str, object])
GroupB = TypeVar("GroupB", bound=Mapping[str, object])
GroupC = TypeVar("GroupC", bound=Mapping[str, object])
GroupD = TypeVar("GroupD", bound=Mapping[str, object])


class EngineOptions(TypedDict, total=False):
    """Options of a stage's StepEngine."""

    max_running: int  # requests that hold state (and share steps) at once


class NoOptions(TypedDict, total=False):
    """For a stage that takes no options: any key is refused."""


@overload
def parse_options(
    stage: str, options: Mapping[str, object], group: type[GroupA], /
) -> GroupA: ...
@overload
def parse_options(
    stage: str, options: Mapping[str, object], group: type[GroupA], other: type[GroupB], /
) -> tuple[GroupA, GroupB]: ...
@overload
def parse_options(
    stage: str,
    options: Mapping[str, object],
    group: type[GroupA],
    other: type[GroupB],
    third: type[GroupC],
    /,
) -> tuple[GroupA, GroupB, GroupC]: ...
@overload
def parse_options(
    stage: str,
    options: Mapping[str, object],
    group: type[GroupA],
    other: type[GroupB],
    third: type[GroupC],
    fourth: type[GroupD],
    /,
) -> tuple[GroupA, GroupB, GroupC, GroupD]: ...
def parse_options(
    stage: str, options: Mapping[str, object], *groups: type[Mapping[str, object]]
) -> Mapping[str, object] | tuple[Mapping[str, object], ...]:
    """Split `options` into one dict per group; raise ValueError naming the stage and the key
    for a key no group declares or a value of the wrong type."""
    hints = [get_type_hints(group) for group in groups]
    for key, value in options.items():
        expected = next((hint[key] for hint in hints if key in hint), None)
        if expected is None:
            known = sorted(name for hint in hints for name in hint)
            raise ValueError(f"stage {stage}: unknown option {key!r}; known: {known}")
        if not _has_type(value, expected):
            raise ValueError(
                f"stage {stage}: option {key!r} must be {_describe(expected)}, got {value!r}"
            )
    parsed = tuple(
        group(**{key: _coerce(value, hint[key]) for key, value in options.items() if key in hint})
        for group, hint in zip(groups, hints, strict=True)
    )
    return parsed[0] if len(parsed) == 1 else parsed


def _alternatives(expected: object) -> tuple[object, ...]:
    """The types of `X | Y` (or Optional[X]) one by one; a plain type on its own."""
    if get_origin(expected) in (Union, types.UnionType):
        return get_args(expected)
    return (expected,)


def _has_type(value: object, expected: object) -> bool:
    """Exact option types: a bool is not an int, an int is a float (YAML writes 20 for 20.0)."""
    for kind in _alternatives(expected):
        if kind is type(None) and value is None:
            return True
        if kind is float and type(value) in (int, float):
            return True
        if isinstance(kind, type) and type(value) is kind:
            return True
    return False


def _coerce(value: object, expected: object) -> object:
    """An int given for a float option becomes a float."""
    if isinstance(value, int) and not isinstance(value, bool) and float in _alternatives(expected):
        return float(value)
    return value


def _describe(expected: object) -> str:
    return " or ".join(
        "null" if kind is type(None) else getattr(kind, "__name__", str(kind))
        for kind in _alternatives(expected)
    )
