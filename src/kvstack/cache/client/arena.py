"""The cache client's shared-memory regions: bookkeeping over its `ClientArena` (``kvstack.cache.shm``).

- `lend_region`: the region a get lends the server for its payloads (per key, the largest payload seen so
  far, else a quarter of the arena; never more than the largest free block);
- `place_payloads`: the payload views of a get reply, each checked to lie in the region the get lent (or
  to come in a frame of its announced size); the region shrinks to what the payloads use;
- `reserve_regions`: regions for a one-copy put, all or none.

No sockets, no failure counting: a reply that does not add up comes back as a `Failure`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstack.cache.client.calls import Failure
from kvstack.cache.client.results import ClientStats
from kvstack.cache.protocol import IN_FRAME, GetReply
from kvstack.cache.shm import ALIGN, ClientArena

__all__ = ["Reserved", "free_regions", "lend_region", "place_payloads", "reserve_regions"]


@dataclass(slots=True)
class Reserved:
    """A region `reserve_regions` handed out: its writable view, and where it was allocated."""

    view: memoryview
    arena: ClientArena
    offset: int


def free_regions(regions: list[tuple[ClientArena, int]]) -> None:
    for arena, offset in regions:
        if not arena.retired:
            arena.allocator.free(offset)


def lend_region(arena: ClientArena, n_keys: int, chunk_hint: int) -> tuple[int, int] | None:
    """(offset, size) of the region a get of ``n_keys`` keys lends, or None when the arena has no room."""
    allocator = arena.allocator
    want = n_keys * (chunk_hint + ALIGN) if chunk_hint else allocator.capacity // 4
    size = min(want, allocator.largest_free())
    offset = allocator.alloc(size) if size >= ALIGN else None
    if offset is None:
        return None
    return offset, size


def place_payloads(
    reply: GetReply,
    frames: list[memoryview],
    asked: int,
    arena: ClientArena | None,
    offset: int,
    size: int,
    regions: list[tuple[ClientArena, int]],
    stats: ClientStats,
) -> tuple[list[memoryview] | Failure, int]:
    """The views of a get reply's payloads, or the `Failure` when the reply does not add up; and the size of
    the largest payload placed. The lent region is shrunk to what the payloads use and, if they use any,
    added to ``regions`` (freed again on a failure)."""
    used_end = offset
    largest = 0
    views: list[memoryview] = []
    frame_iter = iter(frames)
    problem = ""
    if arena is not None and arena.retired and any(at != IN_FRAME for at in reply.offsets):
        # Another request timed out meanwhile and retired the arena: its bytes may be gone.
        return Failure("reset", "the arena was retired while this get ran"), largest
    if len(reply.sizes) != len(reply.offsets) or len(reply.sizes) > asked:
        problem = f"{len(reply.sizes)} sizes, {len(reply.offsets)} offsets for {asked} keys"
    elif sum(1 for o in reply.offsets if o == IN_FRAME) != len(frames):
        problem = f"{len(frames)} payload frames for {reply.offsets.count(IN_FRAME)} framed payloads"
    else:
        for n, at in zip(reply.sizes, reply.offsets, strict=True):
            if at == IN_FRAME:
                view = next(frame_iter).toreadonly()
                if len(view) != n:
                    problem = f"a {len(view)}-byte frame for a {n}-byte payload"
                    break
                stats.socket_bytes += n
            elif arena is None or n < 0 or at < offset or at + n > offset + size:
                problem = f"payload at [{at}, {at + n}) outside the lent region [{offset}, {offset + size})"
                break
            else:
                view = arena.view[at : at + n].toreadonly()
                used_end = max(used_end, at + n)
                stats.shm_bytes += n
            views.append(view)
            largest = max(largest, n)
    if arena is not None and not arena.retired:
        arena.allocator.shrink(offset, used_end - offset)
        if used_end > offset:
            regions.append((arena, offset))
    if problem:
        if arena is not None and used_end > offset:
            free_regions([regions.pop()])
        return Failure("bad_reply", problem), largest
    return views, largest


def reserve_regions(arena: ClientArena, sizes: Sequence[int]) -> list[Reserved] | None:
    """Writable regions of ``sizes`` bytes (each > 0), or None when they do not all fit."""
    if any(n <= 0 for n in sizes):
        raise ValueError(f"reserve: sizes must be > 0, got {list(sizes)}")
    offsets: list[int] = []
    for n in sizes:
        at = arena.allocator.alloc(n)
        if at is None:
            for done in offsets:
                arena.allocator.free(done)
            return None
        offsets.append(at)
    return [Reserved(arena.view[at : at + n], arena, at) for n, at in zip(sizes, offsets, strict=True)]
