"""What the cache clients hand to callers: `Chunks` (a get's payloads), `Reservation` (arena regions for a
one-copy put) and `ClientStats` (counters).

- `Chunks` are read-only views into the client's arena or the reply frames, valid until ``Chunks.release()``
  (or the end of its ``with`` block, or its garbage collection), which gives the arena space back: copy
  what you keep longer.
- `Reservation` holds writable views of arena regions (``reserve`` gives None when shared memory is off or
  the arena is full). Write each chunk into its view and pass the views themselves (the same objects) as
  ``put`` payloads: they travel as offsets, without a copy on the client. A put frees the reserved regions
  among its payloads, whatever its outcome (the views must not be used after it); free the others with
  ``Reservation.release()`` (unreleased ones stay taken until the arena is retired). Any other payload, a
  slice of a reserved view included, is copied.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["Chunks", "ClientStats", "Reservation"]


@dataclass(slots=True)
class ClientStats:
    requests: int = 0
    """Round trips attempted (hello included)."""
    failures: dict[str, int] = field(default_factory=dict)
    """Round trips that failed, by reason: down (not sent: server considered down), timeout, unreachable,
    error:<code> (error reply), bad_reply, reset (connection reset under it), bug, too_large (not sent: a
    chunk alone over the server's message size limit)."""
    chunks_hit: int = 0
    """Chunks ``get`` returned."""
    chunks_missed: int = 0
    """Chunks ``get`` asked for and did not return (failures included)."""
    shm_bytes: int = 0
    socket_bytes: int = 0
    connects: int = 0
    stale_replies: int = 0


class Chunks(Sequence[memoryview]):
    """The payloads a ``get`` returned, in key order (a consecutive prefix of the keys asked for)."""

    def __init__(self, views: list[memoryview], release: Callable[[], None] | None = None) -> None:
        self._views = views
        self._finalizer = None if release is None else weakref.finalize(self, release)

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]
        return self._views[i]

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self._views)

    def release(self) -> None:
        """Give the arena space back; the views must not be used after this."""
        for view in self._views:
            with contextlib.suppress(BufferError):  # a view of a view: the space is still returned
                view.release()
        self._views = []
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Reservation(Sequence[memoryview]):
    """Writable arena regions from ``reserve``, one per size; pass the views to ``put`` as they are."""

    def __init__(self, views: list[memoryview], release: Callable[[list[memoryview]], None]) -> None:
        self._views = views
        self._release = release

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]
        return self._views[i]

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self._views)

    def release(self) -> None:
        """Give back the regions no ``put`` has sent yet; the views must not be used after this."""
        views, self._views = self._views, []
        self._release(views)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
