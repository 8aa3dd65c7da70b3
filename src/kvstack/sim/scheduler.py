"""Continuous batching over the simulated KV cache, shaped like vLLM v1's scheduler.

One ``step()`` schedules a batch and applies its result at once; the caller (``SimEngine``) sleeps for the
step's modelled duration in between. Policy, as vLLM's FCFS: running requests first (one decode token each,
or the next prefill chunk), then waiting ones while there is room under ``max_num_seqs`` and
``max_num_batched_tokens``; when blocks run out the newest running request is preempted (its blocks freed,
back to the head of the waiting queue, recomputed later with whatever prefix is still cached).

Counters follow vLLM's accounting: prefix-cache queries and hits are recorded when a request is first
scheduled (prompt tokens; hit tokens capped at ``prompt - 1`` and block-aligned), not on re-schedules after
preemption. A KV connector extends the local hit with tokens loaded from outside the engine: the P/D decode
side's transfer (``remote_prefill``: every prompt token but the last, free of charge) or an external cache's
chunks (``external_prefix``, see `ExternalPrefix`; ``load_per_token`` each). Such a request records connector
queries (prompt tokens past the local hit) and hits (tokens loaded), as in vLLM.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstack.sim.kv_cache import Block, KVCache


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Modelled duration of one engine step, in seconds at time scale 1.

    step = overhead + prefill_per_token * prefill tokens + load_per_token * tokens loaded from a KV cache
           + (decode_base + decode_per_seq * running sequences, if any sequence decodes)
    Inter-token latency therefore grows linearly with batch size, and TTFT with uncached tokens; a token
    loaded from the KV cache tier costs a tenth of computing it by default.
    """

    step_overhead: float = 0.001
    prefill_per_token: float = 0.00005
    decode_base: float = 0.008
    decode_per_seq: float = 0.0001
    load_per_token: float = 0.000005

    def step_time(
        self, prefill_tokens: int, decode_seqs: int, batch_size: int, loaded_tokens: int = 0
    ) -> float:
        t = self.step_overhead + self.prefill_per_token * prefill_tokens + self.load_per_token * loaded_tokens
        if decode_seqs:
            t += self.decode_base + self.decode_per_seq * batch_size
        return t


@dataclass(frozen=True, slots=True)
class ExternalPrefix:
    """What an external KV cache holds of a prompt, as the connector found it before scheduling: the
    consecutive chunks ``first_chunk, first_chunk + 1, ...``, one source label per chunk (the
    ``prompt_tokens_cached_by_source`` label of the tier holding it), and the prompt's chunk keys (the
    connector's, opaque here)."""

    chunk_size: int
    first_chunk: int = 0
    sources: tuple[str, ...] = ()
    keys: tuple[bytes, ...] = ()

    @property
    def start(self) -> int:
        return self.first_chunk * self.chunk_size

    @property
    def end(self) -> int:
        return (self.first_chunk + len(self.sources)) * self.chunk_size

    def loadable(self, num_prompt_tokens: int, num_local: int, block_size: int) -> int:
        """Tokens past the local hit ``num_local`` to load: up to the stored end, capped at the last block
        boundary before the prompt's last token (which must be computed to sample from it); none when the
        local hit ends before the stored chunks begin."""
        if not self.sources or num_local < self.start:
            return 0
        cap = (num_prompt_tokens - 1) // block_size * block_size
        return max(0, min(self.end, cap) - num_local)

    def split(self, start: int, end: int) -> dict[str, int]:
        """Tokens ``[start, end)`` by the source label of the chunk holding them."""
        out: dict[str, int] = {}
        for i, source in enumerate(self.sources):
            lo = max(start, (self.first_chunk + i) * self.chunk_size)
            hi = min(end, (self.first_chunk + i + 1) * self.chunk_size)
            if hi > lo:
                out[source] = out.get(source, 0) + hi - lo
        return out


@dataclass(slots=True, eq=False)
class SimRequest:
    """One sequence inside the engine (``n > 1`` becomes several)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    min_tokens: int = 0
    ignore_eos: bool = False
    # Number of tokens the "model" would write before EOS; None never stops early.
    natural_len: int | None = None
    eos_token_id: int | None = None
    sample_key: int = 0
    # P/D decode side: prompt KV arrives from a prefill engine, so no prefill time is spent.
    remote_prefill: bool = False
    # P/D prefill side: keep the blocks after finishing until the decode side has pulled them.
    hold_blocks_on_finish: bool = False
    lora_name: str | None = None
    # What the engine's KV connector found in the external cache (None: no connector asked).
    external_prefix: ExternalPrefix | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    # Filled at first scheduling; what usage.prompt_tokens_details.cached_tokens reports.
    num_cached_tokens: int = -1
    num_external_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    prev_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class ConnectorQuery(NamedTuple):
    """One newly admitted request's KV connector accounting, as vLLM records it."""

    queries: int
    """Prompt tokens past the local prefix hit."""
    hits: int
    """Tokens the connector supplies."""
    hits_by_source: dict[str, int]
    """``hits`` by ``prompt_tokens_cached_by_source`` label."""


@dataclass(slots=True)
class StepStats:
    """What one step did, for metrics."""

    duration: float = 0.0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    batch_size: int = 0
    # Tokens loaded from an external KV cache (each costs ``load_per_token``).
    loaded_tokens: int = 0
    # Per newly admitted request (not preempted before): prompt, hit tokens, external tokens.
    admitted: list[tuple[int, int, int]] = field(default_factory=list)
    # Per newly admitted request that went through a KV connector.
    connector: list[ConnectorQuery] = field(default_factory=list)
    preempted: int = 0


@dataclass(slots=True)
class StepOutput:
    stats: StepStats
    # Requests that received one new token in this step (last of output_token_ids).
    new_tokens: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)


TokenSampler = Callable[[SimRequest], int]


class Scheduler:
    """Waiting queue, running batch and the step function of one engine."""

    def __init__(
        self,
        kv: KVCache,
        sampler: TokenSampler,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        latency: LatencyModel | None = None,
    ) -> None:
        self.kv = kv
        self.sampler = sampler
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.latency = latency or LatencyModel()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._held: dict[str, list[Block]] = {}

    # -- requests --------------------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        req.block_hashes = self.kv.block_hashes(req.prompt_token_ids, have=req.block_hashes)
        self.waiting.append(req)

    def abort(self, req: SimRequest, finish_reason: str = "abort") -> None:
        """Remove a request wherever it is and release its blocks."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        req.finish_reason = finish_reason
        self._release(req)

    def held_blocks(self, request_id: str) -> list[Block]:
        """Blocks a finished P/D prefill request still holds for the decode side."""
        return self._held.get(request_id, [])

    def release_held(self, request_id: str) -> bool:
        """Free blocks a P/D prefill kept for the decode side."""
        blocks = self._held.pop(request_id, None)
        if blocks is None:
            return False
        self.kv.free(reversed(blocks))
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------------------------
    def step(self, now: float) -> StepOutput:
        stats = StepStats()
        scheduled: list[tuple[SimRequest, int]] = []
        budget = self.max_num_batched_tokens
        preempted_now = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._allocate(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                stats.preempted += 1
                preempted_now = True
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            break

        # Like vLLM, nothing new is admitted in a step that had to preempt.
        while self.waiting and not preempted_now and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self._admit(req, budget, now, stats):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            scheduled.append((req, num_new))
            budget -= num_new

        out = StepOutput(stats)
        for req, num_new in scheduled:
            prefilling = req.num_computed_tokens < req.num_prompt_tokens
            if prefilling:
                stats.prefill_tokens += num_new
            else:
                stats.decode_seqs += 1
        stats.batch_size = len(scheduled)
        stats.duration = self.latency.step_time(
            stats.prefill_tokens, stats.decode_seqs, stats.batch_size, stats.loaded_tokens
        )
        end = now + stats.duration

        for req, num_new in scheduled:
            req.num_computed_tokens += num_new
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            token = self.sampler(req)
            req.output_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = end
            req.prev_token_time, req.last_token_time = req.last_token_time, end
            req.block_hashes = self.kv.block_hashes(req.all_token_ids(), have=req.block_hashes)
            out.new_tokens.append(req)
            reason = self._finish_reason(req, token)
            if reason is not None:
                req.finish_reason = reason
                req.finish_time = end
                self.running.remove(req)
                self._release(req)
                out.finished.append(req)
        return out

    # -- internals ----------------------------------------------------------------------------------
    def _admit(self, req: SimRequest, budget: int, now: float, stats: StepStats) -> bool:
        """Prefix lookup and block allocation for a waiting request; False if it does not fit."""
        kv = self.kv
        hit_blocks = kv.longest_cached_prefix(req.block_hashes, req.num_tokens - 1)
        num_hit = len(hit_blocks) * kv.block_size
        num_external = 0
        loaded = 0
        by_source: dict[str, int] = {}
        ext = req.external_prefix
        if req.remote_prefill:
            if req.num_preemptions == 0:
                # The prefill engine supplies every prompt token except the last, which is recomputed
                # locally to produce logits (as vLLM's P/D connectors do).
                num_external = max(0, req.num_prompt_tokens - 1 - num_hit)
                by_source = {"external_unspecified": num_external}
        elif ext is not None:
            num_external = loaded = ext.loadable(req.num_prompt_tokens, num_hit, kv.block_size)
            by_source = ext.split(num_hit, num_hit + num_external)
        computed = num_hit + num_external
        num_new = min(req.num_tokens - computed, budget)
        needed = math.ceil((computed + num_new) / kv.block_size) - len(hit_blocks)
        # Touch first so an allocation cannot evict the very blocks this request hits.
        kv.touch(hit_blocks)
        fresh = kv.allocate(needed)
        if fresh is None:
            kv.free(reversed(hit_blocks))
            return False
        req.blocks = hit_blocks + fresh
        req.num_cached_blocks = len(hit_blocks)
        req.num_computed_tokens = computed
        stats.loaded_tokens += loaded
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit + num_external
            req.num_external_tokens = num_external
            req.first_scheduled_time = now
            stats.admitted.append((req.num_prompt_tokens, num_hit, num_external))
            queries = req.num_tokens - num_hit
            if (req.remote_prefill or ext is not None) and queries:
                stats.connector.append(ConnectorQuery(queries, num_external, by_source))
        self._cache_blocks(req, computed + num_new)
        return True

    def _allocate(self, req: SimRequest, num_new: int) -> bool:
        """Blocks for ``num_new`` more tokens of a running request; False when the pool is short."""
        total = req.num_computed_tokens + num_new
        needed = math.ceil(total / self.kv.block_size) - len(req.blocks)
        if needed > 0:
            fresh = self.kv.allocate(needed)
            if fresh is None:
                return False
            req.blocks.extend(fresh)
        self._cache_blocks(req, total)
        return True

    def _cache_blocks(self, req: SimRequest, num_tokens: int) -> None:
        # vLLM caches blocks at allocation time for the tokens this step will compute.
        num_full = min(num_tokens, req.num_tokens) // self.kv.block_size
        num_full = min(num_full, len(req.block_hashes))
        if num_full > req.num_cached_blocks:
            self.kv.cache_full_blocks(
                req.blocks,
                req.block_hashes,
                req.all_token_ids(),
                req.num_cached_blocks,
                num_full,
                lora_name=req.lora_name,
            )
            req.num_cached_blocks = num_full

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(reversed(req.blocks))
        req.blocks = []
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _release(self, req: SimRequest) -> None:
        req.status = Status.FINISHED
        if req.hold_blocks_on_finish and req.finish_reason != "abort":
            self._held[req.request_id] = req.blocks
        else:
            self.kv.free(reversed(req.blocks))
        req.blocks = []

    def _finish_reason(self, req: SimRequest, token: int) -> str | None:
        n_out = len(req.output_token_ids)
        if n_out >= req.max_tokens:
            return "length"
        if not req.ignore_eos and n_out >= req.min_tokens and token == req.eos_token_id:
            return "stop"
        return None
