"""What every config key is made of: a help text, allowed values, a numeric domain, and one check.

A key is declared with :func:`key_field`; a numeric key also declares its :class:`Domain`. Every
section calls :func:`check_fields` first thing after construction: it coerces YAML scalars to the
declared type, checks closed value sets (``choices``), rejects every non-finite float, and enforces
the domain, each error naming the key. Section rules that relate several keys run after it, so they
only ever see values of the right type and range. Nothing here imports Paddle.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "ABOVE_ONE",
    "NON_NEGATIVE",
    "POSITIVE",
    "Domain",
    "Section",
    "at_least",
    "check_fields",
    "coerce",
    "fail",
    "interval",
    "key_field",
    "not_yet",
]


def fail(key: str, value: Any, allowed: str, fix: str) -> typing.NoReturn:
    """Raise the one error shape of the config: key, value given, what is allowed, how to fix it."""
    raise ValueError(f"config key `{key}` = {value!r} is invalid: allowed {allowed}. Fix: {fix}")


def not_yet(key: str, value: Any, what: str, fix: str) -> typing.NoReturn:
    """Raise for a declared feature that is not built yet, so a YAML never asks for it silently."""
    raise ValueError(f"config key `{key}` = {value!r}: {what} is not supported yet in fleet_ext. Fix: {fix}")


def _bound(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Domain:
    """The finite numbers (or integers) a numeric key accepts: an interval, each end open or closed."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self, integer: bool) -> str:
        """Human words for the domain, e.g. 'a positive integer', 'a finite number in [0, 1)'."""
        noun = "an integer" if integer else "a finite number"
        if self.low == 0 and self.low_open and self.high is None:
            return "a positive integer" if integer else "a finite positive number"
        if self.high is None and self.low is None:
            return noun
        if self.high is None:
            return f"{noun} {'>' if self.low_open else '>='} {_bound(self.low)}"
        if self.low is None:
            return f"{noun} {'<' if self.high_open else '<='} {_bound(self.high)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{noun} in {left}{_bound(self.low)}, {_bound(self.high)}{right}"


POSITIVE = Domain(low=0, low_open=True)
NON_NEGATIVE = Domain(low=0)
ABOVE_ONE = Domain(low=1, low_open=True)


def at_least(low: float) -> Domain:
    return Domain(low=low)


def interval(low: float, high: float, *, high_open: bool = False, low_open: bool = False) -> Domain:
    return Domain(low=low, high=high, low_open=low_open, high_open=high_open)


def key_field(
    default: Any,
    help: str,
    choices: tuple | None = None,
    domain: Domain | None = None,
    fix: str | None = None,
) -> Any:
    """A config field: help text, and where they apply the closed set of values or the numeric domain.

    ``fix`` replaces the generic fix hint of a choices or domain error (say what a good value is).
    """
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if domain is not None:
        meta["domain"] = domain
    if fix is not None:
        meta["fix"] = fix
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _split_optional(annotation: Any) -> tuple[Any, bool]:
    """(base type, whether None is allowed) of an annotation such as ``int | None``."""
    args = typing.get_args(annotation)
    if not args or typing.get_origin(annotation) is list:
        return annotation, False
    optional = type(None) in args
    return next(a for a in args if a is not type(None)), optional


def _to_float(key: str, value: Any) -> float:
    """A YAML number (or a numeric string: YAML 1.1 reads ``1e-6`` as one; shipped JSONs quote bases)."""
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except (ValueError, OverflowError):  # OverflowError: an int beyond the float range
            pass
    fail(key, value, "a number", f"write `{key}` as a finite number, e.g. 1.0e-6")


def _containers(annotation: Any) -> tuple[type, ...]:
    """The container types of a union such as ``list | dict | None`` (empty for any other annotation)."""
    args = tuple(a for a in typing.get_args(annotation) if a is not type(None))
    if len(args) < 2 or typing.get_origin(annotation) in (list, dict):
        return ()
    bare = tuple(typing.get_origin(a) or a for a in args)
    if not set(bare) <= {list, dict}:
        raise TypeError(f"config key annotation {annotation!r}: a union may only combine list and dict")
    return bare


def _coerce_container(key: str, value: Any, containers: tuple[type, ...]) -> Any:
    """A YAML list (a tuple becomes a list) or mapping (copied), where the key's union allows it."""
    if list in containers and isinstance(value, (list, tuple)):
        return list(value)
    if dict in containers and isinstance(value, dict):
        return dict(value)
    words = " or ".join("a list" if c is list else "a mapping" for c in containers)
    fail(key, value, words, f"write `{key}` as {words.replace('a ', 'a YAML ')}")


def coerce(key: str, value: Any, annotation: Any) -> Any:
    """Coerce a YAML scalar to the declared type; raise naming the key otherwise."""
    base, optional = _split_optional(annotation)
    if value is None:
        if optional:
            return None
        fail(key, value, f"a value of type {getattr(base, '__name__', base)}", f"give `{key}` a value")
    containers = _containers(annotation)
    if containers:
        return _coerce_container(key, value, containers)
    if base is bool:
        if isinstance(value, bool):
            return value
        fail(key, value, "true or false", f"write `{key}: true` or `{key}: false`")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        fail(key, value, "an integer", f"write `{key}` as an integer")
    if base is float:
        return _to_float(key, value)
    if base is str:
        if isinstance(value, str):
            return value
        fail(key, value, "a string", f"quote the value of `{key}`")
    if base is list or typing.get_origin(base) is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        fail(key, value, "a list", f"write `{key}` as a YAML list")
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_number(key: str, value: Any, base: Any, optional: bool, meta: typing.Mapping[str, Any]) -> None:
    domain: Domain | None = meta.get("domain")
    integer = base is int
    allowed = (domain or Domain()).describe(integer)
    allowed = f"null or {allowed}" if optional else allowed
    fix = meta.get("fix") or f"give `{key}` {allowed}"
    if isinstance(value, float) and not math.isfinite(value):
        fail(key, value, allowed, fix)
    if domain is not None and not domain.contains(value):
        fail(key, value, allowed, fix)


def check_fields(section: Any) -> None:
    """Type, choices, finiteness and domain of every key of ``section``, in declaration order.

    Values are coerced in place (a direct ``ModelConfig(rotary_base=10000)`` holds the float a YAML
    would give), so constructing a section in code validates exactly like ``load_config``.
    """
    hints = _hints(type(section))
    for f in fields(section):
        value = coerce(f.name, getattr(section, f.name), hints[f.name])
        setattr(section, f.name, value)
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            fix = f.metadata.get("fix") or f"pick one of {list(choices)}"
            fail(f.name, value, f"one of {list(choices)}", fix)
        base, optional = _split_optional(hints[f.name])
        if value is not None and base in (int, float):
            _check_number(f.name, value, base, optional, f.metadata)


class Section:
    """Base of every config section: the per-key checks first, then the section's own cross-key rules."""

    def __post_init__(self) -> None:
        check_fields(self)
        self.validate()

    def validate(self) -> None:
        """Rules that relate keys of this section; each raises ``ValueError`` naming a key."""
