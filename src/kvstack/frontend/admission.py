"""Admission control: at most ``max_in_flight`` proxied requests, then a bounded FIFO queue.

A request that finds the queue full, or waits longer than ``queue_timeout``, is refused with
``AdmissionRejected`` (the router answers 429 with ``Retry-After``). Slots are handed directly to the
next waiter on release, so a burst cannot overtake requests already queued. ``max_in_flight`` 0 means
unlimited.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque


class AdmissionRejected(Exception):
    def __init__(self, reason: str, retry_after: float) -> None:
        super().__init__(reason)
        self.reason = reason  # "queue_full" or "queue_timeout"
        self.retry_after = retry_after

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))


class AdmissionController:
    def __init__(self, max_in_flight: int = 0, max_queue: int = 1024, queue_timeout: float = 10.0) -> None:
        if max_in_flight < 0 or max_queue < 0 or queue_timeout < 0:
            raise ValueError("admission limits must be non-negative")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        """Take a slot if one is free now and nobody waits for one (``acquire`` without the wait)."""
        if not self.max_in_flight or (self.in_flight < self.max_in_flight and not self._waiters):
            self.in_flight += 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        if len(self._waiters) >= self.max_queue:
            raise AdmissionRejected("queue_full", self.queue_timeout / 2 or 1.0)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # the slot arrived just as the wait timed out: keep it
            waiter.cancel()
            raise AdmissionRejected("queue_timeout", self.queue_timeout) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # we were handed a slot but our caller went away
            else:
                waiter.cancel()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; in_flight is unchanged
                return
        self.in_flight -= 1
