"""Polling until a condition holds, for state that has no event to wait on.

``wait_until`` (blocking) and ``eventually`` (async) take the same arguments: a predicate, ``what`` is
awaited (for the failure's message; by default the predicate's name, or where a lambda was written), a
timeout and a polling interval. Both return the predicate's first truthy value; ``eventually`` also takes
an async predicate. Failing is an AssertionError: a test that times out failed its check.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar, overload

T = TypeVar("T")


def _failure(predicate: Callable[[], object], what: str, timeout_s: float) -> AssertionError:
    if not what:
        code = getattr(predicate, "__code__", None)
        name = getattr(predicate, "__name__", repr(predicate))
        if name == "<lambda>" and code is not None:
            name = f"the condition at {Path(code.co_filename).name}:{code.co_firstlineno}"
        what = name
    return AssertionError(f"{what}: not reached within {timeout_s:g} s")


def wait_until(
    predicate: Callable[[], T | None], *, what: str = "", timeout_s: float = 10.0, interval_s: float = 0.02
) -> T:
    """Call ``predicate`` every ``interval_s`` until it returns a truthy value; return that value."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise _failure(predicate, what, timeout_s)
        time.sleep(interval_s)
    return value


@overload
async def eventually(
    predicate: Callable[[], Awaitable[T | None]],
    *,
    what: str = "",
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
) -> T: ...


@overload
async def eventually(
    predicate: Callable[[], T | None], *, what: str = "", timeout_s: float = 10.0, interval_s: float = 0.02
) -> T: ...


async def eventually(
    predicate: Callable[[], object], *, what: str = "", timeout_s: float = 10.0, interval_s: float = 0.02
) -> object:
    """``wait_until`` in an event loop; an async predicate is awaited, and cut off at the timeout too."""
    try:
        async with asyncio.timeout(timeout_s) as scope:
            while True:
                value = predicate()
                if inspect.isawaitable(value):
                    value = await value
                if value:
                    return value
                await asyncio.sleep(interval_s)
    except TimeoutError:
        if scope.expired():
            raise _failure(predicate, what, timeout_s) from None
        raise
