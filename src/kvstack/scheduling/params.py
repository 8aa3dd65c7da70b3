"""Declared plugin parameters and their validation.

A plugin lists its parameters as `Param` specs; `check_params` turns the raw ``parameters`` mapping of a
config entry into constructor keywords, or raises `PluginConfigError` naming the plugin, the parameter,
what was expected and what was given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class PluginConfigError(ValueError):
    """A plugin cannot be built from its config entry; the message names the plugin and the bad parameter."""


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter: its YAML key (camelCase, as in llm-d configs) and the constructor keyword it feeds."""

    key: str
    arg: str
    type: type  # int, float, bool, str or list; a float parameter also accepts an integer
    default: Any
    expect: str  # what a valid value looks like, for the error message: "a number >= 0"
    check: Callable[[Any], bool] | None = None


def plugin_label(type_name: str, name: str) -> str:
    return f"plugin '{name}'" if name == type_name else f"plugin '{name}' (type {type_name})"


def check_params(
    type_name: str, name: str, specs: Sequence[Param], raw: Mapping[str, object] | None
) -> dict[str, Any]:
    """Validate ``raw`` against ``specs``; return constructor keywords with defaults filled in."""
    label = plugin_label(type_name, name)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise PluginConfigError(f"{label}: parameters must be a mapping, got {type(raw).__name__}")
    known = {p.key for p in specs}
    for key in raw:
        if key not in known:
            allowed = ", ".join(sorted(known)) if known else "none"
            raise PluginConfigError(f"{label}: unknown parameter {key!r}; known parameters: {allowed}")
    out: dict[str, Any] = {}
    for p in specs:
        if p.key not in raw:
            out[p.arg] = p.default
            continue
        value = _coerce(p.type, raw[p.key])
        if value is None or (p.check is not None and not p.check(value)):
            raise PluginConfigError(f"{label}: parameter {p.key!r} must be {p.expect}, got {raw[p.key]!r}")
        out[p.arg] = value
    return out


def _coerce(kind: type, value: object) -> Any:
    """The value as ``kind``, or None when it has the wrong type (YAML booleans are not numbers)."""
    if isinstance(value, bool):
        return value if kind is bool else None
    if kind is float and isinstance(value, int | float):
        return float(value)
    if isinstance(value, kind):
        return value
    return None
