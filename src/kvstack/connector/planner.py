"""The scheduler half's decisions, free of vLLM types: how many prompt tokens the store can supply, and
each step's `StepPlan` (see ``kvstack.connector.plan`` for the rules).

`ChunkPlanner` follows vLLM's calls one for one: ``match`` (get_num_new_matched_tokens: a lookup, no
other effect than remembering its answer), ``allocated`` (update_state_after_alloc), ``schedule_new`` /
``schedule_cached`` / ``preempted`` and ``take_plan`` (build_connector_meta), ``acknowledged``
(update_connector_output: save jobs the workers are done reading), ``finished`` (request_finished).
``stored_end``, ``chunk_key`` and ``handed_off`` answer P/D disaggregation's questions
(``kvstack.connector.handoff``), in full chunks only. The lookup and the key function are passed in, so
tests drive it with a dict for a store.

Partial tails (with ``tail_keys_for`` and ``locate_tails``): the lookup also returns the tails stored right
after the found prefix; the planner computes its own tail key for each offered length (longest first, at
most up to the prompt's last token) and the first equal to the offered one extends the hit into the tail.
Once the whole prompt is computed, its own tail is saved after its last full chunk.

Saves are asynchronous: each planned save job must be acknowledged by every worker before a request's
blocks may be freed. ``finished`` answers whether vLLM must keep them (some job not acknowledged yet);
if so, the request goes into the next plan's ``held``, and the workers report it to vLLM once their jobs
are done. Acknowledgements that arrive late are ignored: the workers handle a held request themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstack.cache.keys import ChunkKey, KVLayout, chunk_keys, pack_token_ids
from kvstack.cache.protocol import StoredTail
from kvstack.connector.plan import (
    RankKeys,
    RequestLoad,
    RequestSave,
    StepPlan,
    loadable_end,
    plan_load,
    plan_save,
)

__all__ = ["ChunkPlanner", "keys_by_rank", "tail_keys_by_rank"]

Locate = Callable[[Sequence[ChunkKey]], list[str]]
"""The tier of each chunk of the longest consecutive prefix of the keys the store holds (a miss: [])."""
KeysFor = Callable[[Sequence[int]], list[RankKeys]]
"""The chunk keys (one per tensor-parallel rank) of every full chunk of some token ids."""
LocateTails = Callable[[Sequence[ChunkKey], ChunkKey | None], tuple[list[str], Sequence[StoredTail]]]
"""`Locate`, and the partial tails stored right after that prefix (the second argument: the key before the
first key, None at the prompt's start)."""
TailKeysFor = Callable[[Sequence[int], RankKeys | None], RankKeys]
"""The partial-tail key (one per rank) of token ids shorter than a chunk after the chunk with the given keys
(None: at the prompt's start)."""


def keys_by_rank(layouts: Sequence[KVLayout], chunk_size: int) -> KeysFor:
    """A `KeysFor` over ``layouts`` (one per tensor-parallel rank, in rank order)."""

    def keys_for(token_ids: Sequence[int]) -> list[RankKeys]:
        if len(layouts) > 1:
            token_ids = pack_token_ids(token_ids)  # packed once, hashed once per rank
        return list(zip(*(chunk_keys(token_ids, layout, chunk_size) for layout in layouts), strict=True))

    return keys_for


def tail_keys_by_rank(layouts: Sequence[KVLayout], chunk_size: int) -> TailKeysFor:
    """A `TailKeysFor` over ``layouts`` (one per tensor-parallel rank, in rank order)."""

    def tail_keys_for(token_ids: Sequence[int], parent: RankKeys | None) -> RankKeys:
        if not 0 < len(token_ids) < chunk_size:
            raise ValueError(f"a partial tail has 1 to {chunk_size - 1} tokens, got {len(token_ids)}")
        return tuple(
            chunk_keys(token_ids, layout, chunk_size, True, None if parent is None else parent[rank])[-1]
            for rank, layout in enumerate(layouts)
        )

    return tail_keys_for


# Lookups remembered for requests not scheduled yet; vLLM reports every request's end (request_finished),
# this only bounds the memory if that ever fails to happen.
_MAX_PENDING = 4096


@dataclass(frozen=True, slots=True)
class _Tail:
    """A stored partial tail the prompt continues with: its ``length`` tokens after the stored prefix."""

    length: int
    keys: RankKeys
    tier: str


@dataclass(slots=True)
class _Match:
    keys: list[RankKeys]
    num_tokens: int
    local: int
    """Tokens of the local prefix hit vLLM told ``match`` (block-aligned)."""
    first_chunk: int
    """The chunk holding token ``local``: where the lookup started."""
    tiers: list[str]
    """Tier of each stored chunk from ``first_chunk`` on."""
    tail: _Tail | None = None
    """The stored tail right after those chunks, when the prompt continues with it."""
    external: int = 0
    """Tokens vLLM agreed to load (``allocated``)."""


@dataclass(slots=True)
class _Tracked:
    token_ids: list[int]
    keys: list[RankKeys]
    block_ids: list[int]
    next_save: int
    """The first chunk not saved yet (nor known to be stored, nor a local hit)."""
    tail_saved: bool = False


@dataclass(slots=True)
class ChunkPlanner:
    chunk_size: int
    block_size: int
    keys_for: KeysFor
    locate: Locate
    load: bool = True
    save: bool = True
    workers: int = 1
    """Worker processes that acknowledge each save job (one per tensor-parallel rank)."""
    log: logging.Logger = field(default_factory=lambda: logging.getLogger(__name__))
    disabled: str | None = None
    """Why the connector is off (then nothing is looked up, loaded or saved)."""
    tail_keys_for: TailKeysFor | None = None
    locate_tails: LocateTails | None = None
    """Both set: partial tails are looked up, loaded and saved (else full chunks only)."""
    num_tail_loads: int = 0
    num_tail_tokens: int = 0
    """Tail loads planned, and the tail tokens they fill."""
    num_tail_saves: int = 0
    num_finished: int = 0
    num_held: int = 0
    """Finished requests whose blocks vLLM kept for saves in flight."""
    _matches: dict[str, _Match] = field(default_factory=dict)
    _requests: dict[str, _Tracked] = field(default_factory=dict)
    _ignored: set[str] = field(default_factory=set)
    _unacked: dict[str, int] = field(default_factory=dict)
    """Save jobs times workers not acknowledged yet, per request (entries end in ``finished``)."""
    _plan: StepPlan = field(default_factory=StepPlan)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size {self.chunk_size} is not a multiple of block size {self.block_size}"
            )
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    def enable(self, keys_for: KeysFor, tail_keys_for: TailKeysFor | None = None) -> None:
        """Start looking up, loading and saving with chunk keys from ``keys_for`` and ``tail_keys_for`` (a
        planner built with ``disabled`` set waits for this: the key namespace is known only once the workers
        report their KV cache layout)."""
        self.keys_for = keys_for
        self.tail_keys_for = tail_keys_for
        self.disabled = None

    @property
    def tails(self) -> bool:
        """Whether partial tails are looked up, loaded and saved."""
        return self.tail_keys_for is not None and self.locate_tails is not None

    def disable(self, reason: str) -> None:
        """Stop looking up, loading and saving (e.g. the workers refused the KV cache layout). Saves
        already planned are still tracked until acknowledged."""
        self.disabled = reason
        self._matches.clear()
        self._requests.clear()

    # -- get_num_new_matched_tokens / update_state_after_alloc

    def match(self, req_id: str, token_ids: Sequence[int] | None, num_computed_tokens: int) -> int:
        """Prompt tokens past the local hit ``num_computed_tokens`` that can be loaded; ``token_ids`` None
        marks a request whose KV the store must not serve or keep (multimodal, LoRA, cache salt)."""
        if self.disabled is not None:
            return 0
        if token_ids is None:
            self._ignored.add(req_id)
            self._matches.pop(req_id, None)
            return 0
        self._ignored.discard(req_id)
        previous = self._matches.get(req_id)
        if previous is not None and previous.num_tokens == len(token_ids):
            keys = previous.keys  # asked again while waiting: same prompt, same keys
        else:
            keys = self.keys_for(token_ids)
        first_chunk = num_computed_tokens // self.chunk_size
        tiers: list[str] = []
        tail: _Tail | None = None
        if self.load and self.locate_tails is not None and self.tail_keys_for is not None:
            # Even with every full chunk a local hit: a tail may follow the last one.
            parent = keys[first_chunk - 1][0] if first_chunk else None
            tiers, offers = self.locate_tails([k[0] for k in keys[first_chunk:]], parent)
            tail = self._tail(token_ids, keys, first_chunk + len(tiers), offers)
        elif self.load and first_chunk < len(keys):
            tiers = self.locate([k[0] for k in keys[first_chunk:]])
        if len(self._matches) >= _MAX_PENDING and req_id not in self._matches:
            self._matches.pop(next(iter(self._matches)))
        self._matches[req_id] = _Match(keys, len(token_ids), num_computed_tokens, first_chunk, tiers, tail)
        stored_end = (first_chunk + len(tiers)) * self.chunk_size
        end = loadable_end(len(token_ids), stored_end, self.block_size, 0 if tail is None else tail.length)
        return max(0, end - num_computed_tokens)

    def _tail(
        self, token_ids: Sequence[int], keys: list[RankKeys], chunks: int, offers: Sequence[StoredTail]
    ) -> _Tail | None:
        """The offered tail the prompt continues with after its first ``chunks`` chunks: the longest whose
        key this planner computes too, and that ends before the prompt's last token."""
        assert self.tail_keys_for is not None
        start = chunks * self.chunk_size
        room = min(len(token_ids) - 1 - start, self.chunk_size - 1)
        parent = keys[chunks - 1] if chunks else None
        for offer in sorted(offers, key=lambda o: o.length, reverse=True):
            if not 0 < offer.length <= room:
                continue
            mine = self.tail_keys_for(token_ids[start : start + offer.length], parent)
            if mine[0] == offer.key:
                return _Tail(offer.length, mine, offer.tier)
        return None

    def allocated(self, req_id: str, num_external_tokens: int) -> None:
        match = self._matches.get(req_id)
        if match is not None:
            match.external = num_external_tokens

    def sources(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """The external tokens split by the tier that holds them (what vLLM labels its hit metrics with)."""
        match = self._matches.get(req_id)
        if match is None or num_external_tokens <= 0:
            return {}
        start, end = match.local, match.local + num_external_tokens
        split: dict[str, int] = {}
        for i, tier in enumerate(match.tiers):
            lo = max(start, (match.first_chunk + i) * self.chunk_size)
            hi = min(end, (match.first_chunk + i + 1) * self.chunk_size)
            if hi > lo:
                split[tier] = split.get(tier, 0) + hi - lo
        if match.tail is not None:
            lo = max(start, (match.first_chunk + len(match.tiers)) * self.chunk_size)
            hi = min(end, lo + match.tail.length)
            if hi > lo:
                split[match.tail.tier] = split.get(match.tail.tier, 0) + hi - lo
        return split

    def stored_end(self, req_id: str) -> int | None:
        """Prompt tokens from its start that the last ``match`` found in the local hit or the store (a chunk
        multiple); None when it looked nothing up."""
        match = self._matches.get(req_id)
        if match is None or not self.load:
            return None
        return (match.first_chunk + len(match.tiers)) * self.chunk_size

    def chunk_key(self, req_id: str, chunk: int) -> ChunkKey | None:
        """Rank 0's key of full chunk ``chunk`` of a prompt ``match`` saw (None if there is no such chunk)."""
        match = self._matches.get(req_id)
        if match is None or not 0 <= chunk < len(match.keys):
            return None
        return match.keys[chunk][0]

    # -- build_connector_meta

    def schedule_new(
        self,
        req_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_computed_tokens: int,
        num_scheduled_tokens: int,
    ) -> None:
        """A request scheduled for the first time (or again, from scratch): ``num_computed_tokens`` counts
        the local hit and the tokens to load."""
        match = self._matches.pop(req_id, None)
        if self.disabled is not None or req_id in self._ignored:
            return
        if match is None or match.num_tokens != len(token_ids):
            first_chunk = num_computed_tokens // self.chunk_size
            match = _Match(self.keys_for(token_ids), len(token_ids), num_computed_tokens, first_chunk, [])
        tracked = _Tracked(list(token_ids), match.keys, list(block_ids), match.first_chunk + len(match.tiers))
        self._requests[req_id] = tracked
        if match.external > 0:
            self._plan_load(req_id, tracked, match, num_computed_tokens)
        self._plan_save(req_id, tracked, num_computed_tokens + num_scheduled_tokens)

    def schedule_cached(
        self,
        req_id: str,
        new_block_ids: Sequence[int] | None,
        resumed: bool,
        num_computed_tokens: int,
        num_scheduled_tokens: int,
    ) -> None:
        """A request scheduled before: ``new_block_ids`` are appended blocks, or all of them if resumed
        after a preemption."""
        tracked = self._requests.get(req_id)
        if tracked is None:
            return
        if resumed:
            tracked.block_ids = list(new_block_ids or ())
            match = self._matches.pop(req_id, None)
            if match is not None:
                # Saves cancelled at the preemption are planned again; stored chunks are not.
                tracked.next_save = match.first_chunk + len(match.tiers)
                tracked.tail_saved = False
                if match.external > 0:
                    self._plan_load(req_id, tracked, match, num_computed_tokens)
        elif new_block_ids:
            tracked.block_ids += new_block_ids
        self._plan_save(req_id, tracked, num_computed_tokens + num_scheduled_tokens)

    def preempted(self, req_ids: Iterable[str]) -> None:
        """vLLM freed these requests' blocks without finishing them: workers must stop reading them."""
        self._plan.preempted += [r for r in req_ids if r in self._unacked]

    def take_plan(self) -> StepPlan:
        """This step's plan; the next step starts a new one."""
        plan, self._plan = self._plan, StepPlan()
        return plan

    # -- update_connector_output / request_finished

    def acknowledged(self, acks: Mapping[str, int]) -> None:
        """Save jobs (summed over workers) that no longer read their request's blocks."""
        for req_id, n in acks.items():
            left = self._unacked.get(req_id)
            if left is None:
                continue  # finished already: held, and the workers report it
            if left > n:
                self._unacked[req_id] = left - n
            else:
                del self._unacked[req_id]

    def handed_off(self, req_id: str) -> tuple[int, ChunkKey | None]:
        """Before ``finished``: the prompt tokens from its start whose chunks the store holds or is being sent
        (a chunk multiple; a local prefix hit's chunks count as stored), and rank 0's key of the last one."""
        tracked = self._requests.get(req_id)
        chunks = 0 if tracked is None else min(tracked.next_save, len(tracked.keys))
        if tracked is None or chunks == 0:
            return 0, None
        return chunks * self.chunk_size, tracked.keys[chunks - 1][0]

    def finished(self, req_id: str) -> bool:
        """Forget the request; True when vLLM must keep its blocks (saves in flight) until the workers
        report it (it is in the next plan's ``held``)."""
        self._matches.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._ignored.discard(req_id)
        self.num_finished += 1
        if self._unacked.pop(req_id, None) is None:
            return False
        self.num_held += 1
        self._plan.held.append(req_id)
        return True

    @property
    def num_tracked(self) -> int:
        return len(self._requests) + len(self._matches) + len(self._ignored) + len(self._unacked)

    # -- planning

    def _plan_load(self, req_id: str, tracked: _Tracked, match: _Match, end: int) -> None:
        start = end - match.external
        stored = match.first_chunk + len(match.tiers)
        tail = match.tail if match.tail is not None and end > stored * self.chunk_size else None
        try:
            chunks = plan_load(
                tracked.keys[:stored] if tail is not None else tracked.keys,
                start,
                end,
                chunk_size=self.chunk_size,
                block_size=self.block_size,
                block_ids=tracked.block_ids,
                tail=None if tail is None else tail.keys,
            )
        except ValueError as e:
            # vLLM counts these tokens as computed: report their blocks as failed so it recomputes them.
            lo, hi = start // self.block_size, -(-end // self.block_size)
            self._plan.failed_block_ids += tracked.block_ids[max(lo, 0) : hi]
            self.log.warning("kvstack connector: request %s: cannot load (%s); recomputing", req_id, e)
            return
        self._plan.loads.append(RequestLoad(req_id, chunks))
        if tail is not None:
            self.num_tail_loads += 1
            self.num_tail_tokens += end - max(start, stored * self.chunk_size)

    def _plan_save(self, req_id: str, tracked: _Tracked, computed: int) -> None:
        if not self.save:
            return
        have_blocks = len(tracked.block_ids) * self.block_size // self.chunk_size
        end_chunk = min(
            min(computed, len(tracked.token_ids)) // self.chunk_size, len(tracked.keys), have_blocks
        )
        tail = self._tail_to_save(tracked, computed, end_chunk)
        if end_chunk <= tracked.next_save and tail is None:
            return
        first = tracked.next_save
        chunks = plan_save(
            tracked.keys,
            tracked.token_ids,
            first,
            end_chunk,
            chunk_size=self.chunk_size,
            block_size=self.block_size,
            block_ids=tracked.block_ids,
            tail=tail,
        )
        tracked.next_save = end_chunk
        if tail is not None:
            tracked.tail_saved = True
            self.num_tail_saves += 1
        self._unacked[req_id] = self._unacked.get(req_id, 0) + self.workers
        self._plan.saves.append(RequestSave(req_id, tracked.keys[first - 1] if first else None, chunks))

    def _tail_to_save(self, tracked: _Tracked, computed: int, end_chunk: int) -> RankKeys | None:
        """The prompt's tail keys, when it is to be saved now: the whole prompt computed, every full chunk
        saved or stored by the end of this step, the blocks holding the tail allocated."""
        n = len(tracked.token_ids)
        full = len(tracked.keys)
        if (
            self.tail_keys_for is None
            or self.locate_tails is None
            or tracked.tail_saved
            or n % self.chunk_size == 0
            or computed < n
            or end_chunk < full
            or len(tracked.block_ids) * self.block_size < n
        ):
            return None
        return self.tail_keys_for(
            tracked.token_ids[full * self.chunk_size :], tracked.keys[-1] if full else None
        )
