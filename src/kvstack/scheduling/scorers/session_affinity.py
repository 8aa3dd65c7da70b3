"""session-affinity-scorer: keep a session on one engine by consistent hashing.

Formula: each engine of the pool owns ``virtualNodes`` points on a 64-bit ring, at xxh64("<url>#<i>"). A
request's session key hashes to xxh64(key); walking the ring clockwise from there, the first point owned
by a candidate wins: that engine scores 1, every other candidate 0. Without a session key every candidate
scores 0, leaving the decision to the other scorers. An engine filtered out (unroutable, saturated) hands
its sessions to their next engine on the ring and gets them back when it returns.

Parameters:
  virtualNodes (integer in [1, 10000], default 160)  points per engine; more spread sessions more evenly

Cost: O(candidates) plus an O(log(pool * virtualNodes)) bisection and a short walk; the ring is rebuilt
only when the pool's membership changes. Why a ring over the pool: docs/design/scheduling.md.
When to use: multi-turn chat without shared prefix knowledge; the key comes from a session header or the
body's ``user`` (interfaces.extract_session_key). Weight it above the sum of the other scorers' weights so
it decides whenever a key is present, and let saturation-filter move sessions off overloaded engines.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import ClassVar

import xxhash

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, Scorer
from kvstack.scheduling.params import Param


class HashRing:
    """Consistent-hash ring: sorted point hashes with the URL owning each point."""

    __slots__ = ("members", "owners", "points")

    def __init__(self, urls: frozenset[str], virtual_nodes: int) -> None:
        self.members = urls
        entries = sorted(
            (xxhash.xxh64_intdigest(f"{url}#{i}".encode()), url) for url in urls for i in range(virtual_nodes)
        )
        self.points = [h for h, _ in entries]
        self.owners = [url for _, url in entries]

    def owner(self, key: str, allowed: frozenset[str] | set[str]) -> str | None:
        """The first allowed URL clockwise from the key's hash, or None when no allowed URL is on the ring."""
        n = len(self.points)
        start = bisect_right(self.points, xxhash.xxh64_intdigest(key.encode()))
        for step in range(n):
            url = self.owners[(start + step) % n]
            if url in allowed:
                return url
        return None


class SessionAffinityScorer(Scorer):
    type_name: ClassVar[str] = "session-affinity-scorer"
    params: ClassVar[tuple[Param, ...]] = (
        Param(
            "virtualNodes", "virtual_nodes", int, 160, "an integer in [1, 10000]", lambda v: 1 <= v <= 10000
        ),
    )

    def __init__(self, name: str | None = None, *, virtual_nodes: int = 160) -> None:
        super().__init__(name)
        self.virtual_nodes = virtual_nodes
        self._ring: HashRing | None = None

    def ring(self, urls: frozenset[str]) -> HashRing:
        # One cached ring: the pool changes only when discovery adds or removes an engine.
        if self._ring is None or self._ring.members != urls:
            self._ring = HashRing(urls, self.virtual_nodes)
        return self._ring

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        if not request.session_key or not candidates:
            return {}
        allowed = {e.url for e in candidates}
        pool = frozenset(e.url for e in state.pool) | allowed if state.pool else frozenset(allowed)
        chosen = self.ring(pool).owner(request.session_key, allowed)
        return {} if chosen is None else {chosen: 1.0}
