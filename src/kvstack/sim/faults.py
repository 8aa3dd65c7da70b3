"""Fault injection for the simulated engine, set by flags and changed at runtime (``/admin/faults``).

Each generation request draws once, in this order: hang (never answers, until the client goes away),
error (an OpenAI error JSON with one of ``error_codes``), then, if it streams, a dropped connection
after ``drop_after_chunks`` chunks (0: after the 200 and headers; a chat stream's role chunk is chunk 1).
``first_token_delay`` (wall seconds) is added before the first byte of every generation response.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError

INJECTED_ERRORS = {
    429: lambda: errors.rate_limited("Too many requests (fault injected by kvstack sim)"),
    500: lambda: errors.internal_error("Internal server error (fault injected by kvstack sim)"),
    503: lambda: errors.service_unavailable("Service unavailable (fault injected by kvstack sim)"),
}


def injected_error(code: int) -> OpenAIError:
    return INJECTED_ERRORS[code]()


@dataclass(frozen=True, slots=True)
class FaultConfig:
    error_rate: float = 0.0
    error_codes: tuple[int, ...] = (500,)
    drop_rate: float = 0.0
    drop_after_chunks: int = 1
    first_token_delay: float = 0.0
    hang_rate: float = 0.0

    def validate(self) -> FaultConfig:
        for name in ("error_rate", "drop_rate", "hang_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if not self.error_codes or any(c not in INJECTED_ERRORS for c in self.error_codes):
            raise ValueError(f"error_codes must be a non-empty subset of {sorted(INJECTED_ERRORS)}")
        if self.drop_after_chunks < 0 or self.first_token_delay < 0:
            raise ValueError("drop_after_chunks and first_token_delay must be non-negative")
        return self

    def updated(self, changes: dict[str, Any]) -> FaultConfig:
        """A copy with ``changes`` applied; unknown keys and bad values raise ValueError."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown fault fields {sorted(unknown)}; known: {sorted(known)}")
        values = dict(changes)
        if "error_codes" in values:
            codes = values["error_codes"]
            if not isinstance(codes, list | tuple) or not all(isinstance(c, int) for c in codes):
                raise ValueError("error_codes must be a list of integers")
            values["error_codes"] = tuple(codes)
        for key, value in values.items():
            if key != "error_codes" and (not isinstance(value, int | float) or isinstance(value, bool)):
                raise ValueError(f"{key} must be a number")
        return replace(self, **values).validate()

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["error_codes"] = list(self.error_codes)
        return out


@dataclass(frozen=True, slots=True)
class FaultDraw:
    """What happens to one request."""

    hang: bool = False
    error_code: int | None = None
    drop_after: int | None = None
    first_token_delay: float = 0.0


def draw(config: FaultConfig, rng: random.Random, *, stream: bool) -> FaultDraw:
    if config.hang_rate and rng.random() < config.hang_rate:
        return FaultDraw(hang=True)
    if config.error_rate and rng.random() < config.error_rate:
        return FaultDraw(error_code=rng.choice(config.error_codes))
    drop = None
    if stream and config.drop_rate and rng.random() < config.drop_rate:
        drop = config.drop_after_chunks
    return FaultDraw(drop_after=drop, first_token_delay=config.first_token_delay)
