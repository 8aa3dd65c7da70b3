"""max-score-picker: the highest total score wins; ties are broken at random, or by hashing the request.

Rule: candidates in order of total score, highest first; the full order is returned, so retries go to the
next best. Among equal scores:
- ``random``: shuffle, then stable-sort, so every tied candidate is equally likely to come first and equal
  scores (all metrics stale, identical engines) spread traffic instead of always choosing the first engine.
- ``hash``: rendezvous (highest-random-weight) hashing, weight = xxh64(url, seed = the request key), highest
  first. The key is the session key when there is one, else xxh64 of the first ``hashPrefixTokens`` prompt
  token ids, else the request id. Ties still spread over engines, request by request, but every picker
  instance (every replica of an Envoy endpoint picker) orders the same request identically, fallbacks
  included; removing an engine moves only the requests it was first for. With ``tieTolerance`` t > 0, each
  place goes to the highest weight among the remaining candidates scoring within t of the best remaining
  one, so differences smaller than t (one request's KV blocks in a scrape) do not decide.

Parameters:
  tieBreak (random | hash, default random)
  hashPrefixTokens (integer >= 1, default 256)  prompt tokens in the ``hash`` key
  tieTolerance (number >= 0, default 0)         ``hash`` only: totals this close count as tied
Cost: O(candidates * log candidates); with a tolerance, O(candidates^2) at worst.
When to use: the default picker, after scorers that express preference; ``hash`` when several pickers that
see the same engine state must decide alike (preset kv-aware-replicas, docs/design/scheduling.md).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from typing import ClassVar

import xxhash

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, ScoredEngine
from kvstack.scheduling.params import Param
from kvstack.scheduling.pickers.randomized import RandomizedPicker

TIE_BREAKS = ("random", "hash")


def order_by_score(scored: Sequence[ScoredEngine], rng: random.Random) -> list[EngineState]:
    """Highest score first, ties in random order."""
    shuffled = list(scored)
    rng.shuffle(shuffled)
    shuffled.sort(key=lambda s: s.score, reverse=True)  # list.sort is stable, even with reverse=True
    return [s.engine for s in shuffled]


def request_key(request: SchedulingRequest, prefix_tokens: int = 256) -> int:
    """The 64-bit key of ``hash`` tie-breaks: session key, else the prompt's first tokens, else the id."""
    if request.session_key:
        return xxhash.xxh64_intdigest(b"session\0" + request.session_key.encode())
    tokens = request.prompt_token_ids
    if tokens:
        return xxhash.xxh64_intdigest(b"tokens\0" + array("q", tokens[:prefix_tokens]).tobytes())
    return xxhash.xxh64_intdigest(b"request\0" + request.request_id.encode())


def order_by_score_and_hash(
    scored: Sequence[ScoredEngine], key: int, tolerance: float = 0.0
) -> list[EngineState]:
    """Highest score first, ties (within ``tolerance``) by rendezvous weight for ``key``, then by URL (a
    64-bit collision)."""
    weight = {s.engine.url: xxhash.xxh64_intdigest(s.engine.url.encode(), seed=key) for s in scored}
    ranked = sorted(scored, key=lambda s: (-s.score, -weight[s.engine.url], s.engine.url))
    if tolerance <= 0:
        return [s.engine for s in ranked]
    out = []
    while ranked:
        floor = ranked[0].score - tolerance
        tied = 1
        while tied < len(ranked) and ranked[tied].score >= floor:
            tied += 1
        chosen = max(ranked[:tied], key=lambda s: (weight[s.engine.url], s.engine.url))
        ranked.remove(chosen)
        out.append(chosen.engine)
    return out


class MaxScorePicker(RandomizedPicker):
    type_name: ClassVar[str] = "max-score-picker"
    params: ClassVar[tuple[Param, ...]] = (
        Param("tieBreak", "tie_break", str, "random", "random or hash", lambda v: v in TIE_BREAKS),
        Param("hashPrefixTokens", "hash_prefix_tokens", int, 256, "an integer >= 1", lambda v: v >= 1),
        Param("tieTolerance", "tie_tolerance", float, 0.0, "a number >= 0", lambda v: v >= 0),
    )

    def __init__(
        self,
        name: str | None = None,
        *,
        rng: random.Random | None = None,
        tie_break: str = "random",
        hash_prefix_tokens: int = 256,
        tie_tolerance: float = 0.0,
    ) -> None:
        super().__init__(name, rng=rng)
        if tie_break not in TIE_BREAKS:
            raise ValueError(f"tie_break {tie_break!r}: choose one of {', '.join(TIE_BREAKS)}")
        self.tie_break = tie_break
        self.hash_prefix_tokens = hash_prefix_tokens
        self.tie_tolerance = tie_tolerance

    def pick(
        self, request: SchedulingRequest, state: CycleState, scored: Sequence[ScoredEngine]
    ) -> list[EngineState]:
        if self.tie_break == "hash":
            key = request_key(request, self.hash_prefix_tokens)
            return order_by_score_and_hash(scored, key, self.tie_tolerance)
        return order_by_score(scored, self.rng)
