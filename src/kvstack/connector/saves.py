"""The worker half's asynchronous saves: one background thread per worker copies each step's newly
computed chunks out of vLLM's KV blocks and sends them, so the forward pass never waits on the server.

A step's `RequestSave` is one job. `SaveQueue` runs jobs in order on its thread in two phases: ``gather``
(reads the request's KV blocks into payloads) and ``send`` (puts the payloads; blocks no longer needed).
It never blocks the caller: a job that finds the queue full (``capacity`` jobs waiting) is dropped and
counted, and a failed gather or send is counted, never raised; either way the chunks are a future miss.
vLLM must not reuse blocks while a gather reads them: `SaveQueue` tracks, per request, the jobs not done
reading and says when a request's blocks are free again. ``close`` sends what is queued for up to
``timeout_s`` and drops the rest.

No torch, no vLLM: the two phases are passed in (`kvstack.connector.worker.BlockMover` provides them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstack.connector.plan import RequestSave
from kvstack.logs import ThrottledLog

__all__ = ["SaveQueue", "SaveStats"]

T = TypeVar("T")


@dataclass(slots=True)
class SaveStats:
    """Jobs (one request's saves of one step) by outcome."""

    queued: int = 0
    saved: int = 0
    failed: int = 0
    """The gather or the put failed (the put's reasons are in the cache client's stats)."""
    dropped_full: int = 0
    """The queue was full: the forward pass does not wait."""
    cancelled: int = 0
    """Still queued when their request was preempted (its blocks are reused)."""
    abandoned: int = 0
    """Queued at shutdown after the drain bound, or submitted after it."""
    skipped: int = 0
    """Never queued: the worker cannot read the KV cache (the connector is off)."""


class SaveQueue(Generic[T]):
    """Save jobs run in order on one background thread (see the module docstring). Thread-safe.

    A job may come with ``ready``, called on the thread before its gather: for a KV cache on a device, it
    waits until the forward pass that wrote the blocks has finished (the caller's thread does not wait).
    What the queue reports about blocks (vLLM 0.32's contract), per request:

    - `take_acks`: jobs done reading since the last call, per request (the scheduler half frees a finished
      request's blocks at once when every planned job of it is acknowledged);
    - `hold` / `take_released`: a finished request whose blocks vLLM keeps for us is released (reported
      once, as vLLM's ``finished_sending``) when its last job is done reading, or at once if none is left;
    - `cancel`: a preempted request's blocks are freed without notice and reused in the coming step, so its
      queued jobs are dropped and a gather in progress is waited for.
    """

    def __init__(
        self,
        gather: Callable[[RequestSave], T],
        send: Callable[[RequestSave, T], bool],
        *,
        capacity: int,
        on_exit: Callable[[], None] | None = None,
        log: logging.Logger | None = None,
        name: str = "kvstack-saves",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.stats = SaveStats()
        self._gather = gather
        self._send = send
        self._capacity = capacity
        self._on_exit = on_exit
        self._log = log or logging.getLogger(__name__)
        self._warn = ThrottledLog(self._log, 10.0)  # used under _cond only
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[RequestSave, Callable[[], None] | None]] = deque()
        self._reading: RequestSave | None = None
        self._unread: dict[str, int] = {}
        """Jobs per request not done reading its blocks (queued or gathering)."""
        self._held: set[str] = set()
        self._released: set[str] = set()
        self._acks: dict[str, int] = {}
        self._closing = False
        self._drain_until = 0.0
        self._thread: threading.Thread | None = None

    # -- the forward pass's side (never blocks, except `cancel` for a gather in progress)

    def submit(self, save: RequestSave, ready: Callable[[], None] | None = None) -> bool:
        """Queue ``save`` (``ready`` is called on the save thread before its gather); False when it is
        dropped (queue full, or closed)."""
        with self._cond:
            if self._closing:
                self.stats.abandoned += 1
                self._acknowledge(save.req_id)
                return False
            if len(self._queue) >= self._capacity:
                self.stats.dropped_full += 1
                self._acknowledge(save.req_id)
                self._warn.warning(
                    "kvstack connector: save queue full (%d jobs): request %s's %d chunks not saved",
                    self._capacity,
                    save.req_id,
                    len(save.chunks),
                )
                return False
            self._queue.append((save, ready))
            self._unread[save.req_id] = self._unread.get(save.req_id, 0) + 1
            self.stats.queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def skip(self, save: RequestSave) -> None:
        """Acknowledge a save that will never run (the worker cannot read the KV cache)."""
        with self._cond:
            self.stats.skipped += 1
            self._acknowledge(save.req_id)

    def cancel(self, req_ids: Collection[str]) -> int:
        """Drop the queued jobs of ``req_ids`` and wait until no gather reads their blocks; the number
        dropped."""
        if not req_ids:
            return 0
        with self._cond:
            keep: deque[tuple[RequestSave, Callable[[], None] | None]] = deque()
            dropped = 0
            for job in self._queue:
                if job[0].req_id in req_ids:
                    dropped += 1
                    self._done_reading(job[0].req_id)
                else:
                    keep.append(job)
            self._queue = keep
            self.stats.cancelled += dropped
            # A gather is a memory copy after one bounded reserve round trip: this wait is short.
            while self._reading is not None and self._reading.req_id in req_ids:
                self._cond.wait()
            return dropped

    def hold(self, req_id: str) -> None:
        """vLLM keeps ``req_id``'s blocks until `take_released` returns it."""
        with self._cond:
            if self._unread.get(req_id):
                self._held.add(req_id)
            else:
                self._released.add(req_id)

    def take_released(self) -> set[str]:
        """Held requests whose jobs are all done reading since the last call (each returned once)."""
        with self._cond:
            released, self._released = self._released, set()
            return released

    def take_acks(self) -> dict[str, int]:
        """Jobs done reading (or never run) since the last call, per request."""
        with self._cond:
            acks, self._acks = self._acks, {}
            return acks

    @property
    def num_tracked(self) -> int:
        """Requests with jobs in flight, held or released but not taken (bounded by vLLM's requests)."""
        with self._cond:
            return len(self._unread.keys() | self._held | self._released)

    def close(self, timeout_s: float) -> bool:
        """Run what is queued for up to ``timeout_s``, then drop the rest; True when the thread ended."""
        with self._cond:
            self._closing = True
            self._drain_until = time.monotonic() + timeout_s
            thread = self._thread
            self._cond.notify_all()
        if thread is None:
            if self._on_exit is not None:
                self._on_exit()
            return True
        # A send in progress ends within the cache client's timeout; the thread is a daemon past that.
        thread.join(timeout_s)
        return not thread.is_alive()

    # -- the background thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closing:
                        self._cond.wait()
                    if self._closing and (not self._queue or time.monotonic() > self._drain_until):
                        self._abandon_queued()
                        return
                    save, ready = self._queue.popleft()
                    self._reading = save
                try:
                    if ready is not None:
                        ready()
                    payload = self._gather(save)
                except Exception as e:
                    self._failed(save, "gathering", e)
                    continue
                finally:
                    with self._cond:
                        self._reading = None
                        self._done_reading(save.req_id)
                try:
                    sent = self._send(save, payload)
                except Exception as e:
                    self._failed(save, "sending", e)
                    continue
                with self._cond:
                    if sent:
                        self.stats.saved += 1
                    else:
                        self.stats.failed += 1
                        self._warn.warning(
                            "kvstack connector: request %s: %d chunks not saved (the cache server refused "
                            "or did not answer)",
                            save.req_id,
                            len(save.chunks),
                        )
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def _failed(self, save: RequestSave, doing: str, error: Exception) -> None:
        with self._cond:
            self.stats.failed += 1
            self._warn.warning(
                "kvstack connector: request %s: %s %d chunks failed (%r); not saved",
                save.req_id,
                doing,
                len(save.chunks),
                error,
            )
        self._log.debug("kvstack connector: save of %s failed", save.req_id, exc_info=error)

    # -- bookkeeping (under _cond)

    def _abandon_queued(self) -> None:
        for save, _ in self._queue:
            self.stats.abandoned += 1
            self._done_reading(save.req_id)
        self._queue.clear()

    def _done_reading(self, req_id: str) -> None:
        left = self._unread.get(req_id, 0) - 1
        if left > 0:
            self._unread[req_id] = left
        else:
            self._unread.pop(req_id, None)
            if req_id in self._held:
                self._held.discard(req_id)
                self._released.add(req_id)
        self._acknowledge(req_id)
        self._cond.notify_all()

    def _acknowledge(self, req_id: str) -> None:
        self._acks[req_id] = self._acks.get(req_id, 0) + 1
