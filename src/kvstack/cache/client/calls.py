"""What passes between the clients' operations and their transports: a `Call` (one request, its payloads
and the reply type it expects) goes out, an `Outcome` (the reply and its payload frames, or a `Failure`)
comes back. An operation is a `Plan`: a generator that yields calls and returns the operation's result.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstack.cache.payload import Payload
from kvstack.cache.protocol import Reply, StoredTail
from kvstack.cache.shm import ClientArena

__all__ = ["NO_PREFIX", "Call", "Failure", "Outcome", "Plan"]

T = TypeVar("T")


@dataclass(slots=True)
class Failure:
    reason: str
    detail: str = ""
    code: str = ""


@dataclass(slots=True)
class Call:
    request: Any
    payloads: Sequence[Payload]
    expect: type[Reply]
    arena: ClientArena | None = None
    """The arena this request lent space of: retired if the request times out."""


Outcome = tuple[Any, list[memoryview]] | Failure
Plan = Generator[Call, Outcome, T]
NO_PREFIX: tuple[int, list[str], list[StoredTail]] = (0, [], [])
"""A lookup's miss."""
