"""The simulated engine's asyncio loop: scheduler steps in modelled time, tokens out to request streams.

Each step: schedule (``Scheduler.step``), sleep the step's modelled duration divided by the time scale,
then hand the new tokens to the waiting request handlers, publish the step's KV events as one batch,
and update metrics. New requests wait for the next step, as on a real engine.

With a KV connector (``sim.kv_connector``), a new request first asks it what the external cache holds of
its prompt (counted as waiting meanwhile) and then joins the queue; when its prompt is computed, the
connector saves the new chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstack.kvevents.codec import KVEvent
from kvstack.sim.kv_cache import KVCache
from kvstack.sim.metrics import EngineMetrics
from kvstack.sim.scheduler import ExternalPrefix, LatencyModel, Scheduler, SimRequest, Status
from kvstack.sim.textgen import OutputSampler

log = logging.getLogger(__name__)

# When the process falls this far behind the modelled schedule (CPU saturated), stop trying to catch up.
MAX_LAG_S = 0.1


class EventSink(Protocol):
    """Where a step's KV events go: the ZMQ publisher, one batch per step."""

    def publish(self, events: Iterable[KVEvent], *, ts: float | None = None) -> int | None: ...


class KVConnector(Protocol):
    """An external KV cache the engine loads prompt prefixes from and saves computed chunks to."""

    async def lookup(self, token_ids: Sequence[int], num_local: int) -> ExternalPrefix:
        """What the cache holds of the prompt past the local prefix hit of ``num_local`` tokens."""
        ...

    def save(self, req: SimRequest) -> None:
        """The request's prompt is computed: keep its new chunks (without blocking)."""
        ...


@dataclass(slots=True)
class TokenEvent:
    """One new token of a sequence, or its end (``finish_reason`` set)."""

    token_id: int
    finish_reason: str | None
    stream: RequestStream


@dataclass(eq=False)
class RequestStream:
    """Handler-side view of one sequence in the engine; sequences of one request may share a queue."""

    req: SimRequest
    queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_name: str = "kvstack-sim"
    max_model_len: int = 4096
    block_size: int = 16
    num_gpu_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # vLLM's --max-num-queued-reqs: cap on unfinished sequences, beyond which requests get 503.
    max_num_queued_reqs: int | None = None
    enable_prefix_caching: bool = True
    time_scale: float = 1.0
    seed: int = 0
    mean_output_len: int = 128
    latency: LatencyModel = field(default_factory=LatencyModel)
    legacy_metric_names: bool = False


class SimEngine:
    """One simulated engine: scheduler, KV cache, metrics and event stream."""

    def __init__(
        self,
        config: EngineConfig,
        sampler: OutputSampler,
        *,
        events: EventSink | None = None,
        eos_token_id: int | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.sampler = sampler
        self.eos_token_id = eos_token_id
        self.kv = KVCache(
            config.num_gpu_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_seed=config.seed,
            emit_events=events is not None,
        )
        self.scheduler = Scheduler(
            self.kv,
            sampler,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            latency=config.latency,
        )
        self.metrics = EngineMetrics(
            config.model_name,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            num_gpu_blocks=config.num_gpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            legacy_names=config.legacy_metric_names,
        )
        self.metrics.kv_usage.set(0.0)
        self.events = events
        self.connector = connector
        self._lookups: set[asyncio.Task[None]] = set()
        self._looking_up = 0  # requests in a connector lookup (the tasks leave the set a little later)
        self._streams: dict[int, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Modelled time: advances by each step's duration, so histograms are exact under any time scale.
        self._clock = 0.0
        self._wall0 = time.monotonic()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        for lookup in list(self._lookups):
            lookup.cancel()
        await asyncio.gather(*self._lookups, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def now(self) -> float:
        """Modelled seconds since start (wall time times the time scale, never behind the step clock)."""
        return max(self._clock, (time.monotonic() - self._wall0) * self.config.time_scale)

    # -- requests --------------------------------------------------------------------------------
    def submit(self, req: SimRequest, queue: asyncio.Queue[TokenEvent] | None = None) -> RequestStream:
        """Queue a sequence; its tokens arrive on ``queue`` (a new one unless given)."""
        req.arrival_time = self.now()
        if req.eos_token_id is None:
            req.eos_token_id = self.eos_token_id
        stream = RequestStream(req) if queue is None else RequestStream(req, queue)
        self._streams[id(req)] = stream
        if self.connector is None or req.remote_prefill:
            self._enqueue(req)
        else:
            task = asyncio.get_running_loop().create_task(self._lookup_then_enqueue(req, self.connector))
            self._looking_up += 1
            self._lookups.add(task)
            task.add_done_callback(self._lookups.discard)
        return stream

    def _enqueue(self, req: SimRequest) -> None:
        self.scheduler.add(req)
        self._wakeup.set()

    async def _lookup_then_enqueue(self, req: SimRequest, connector: KVConnector) -> None:
        kv = self.kv
        req.block_hashes = kv.block_hashes(req.prompt_token_ids)
        local = len(kv.longest_cached_prefix(req.block_hashes, req.num_prompt_tokens - 1)) * kv.block_size
        try:
            req.external_prefix = await connector.lookup(req.prompt_token_ids, local)
        except Exception:  # the connector turns faults into misses; a bug must not lose the request
            log.exception("KV connector lookup failed; computing the prompt")
        finally:
            self._looking_up -= 1
        if req.status is Status.WAITING and id(req) in self._streams:  # else aborted meanwhile
            self._enqueue(req)

    def abort(self, stream: RequestStream, *, finish_reason: str | None = None) -> None:
        """End a sequence early. A client abort (no reason) is not counted as a finished request, as in
        vLLM; a stop string found by the API layer (``finish_reason="stop"``) is."""
        req = stream.req
        if req.status is Status.FINISHED:
            return
        self.scheduler.abort(req, finish_reason or "abort")
        req.finish_time = self.now()
        self._streams.pop(id(req), None)
        if finish_reason is not None:
            self.metrics.observe_finished(req)

    def next_request_id(self, prefix: str) -> str:
        # Random like vLLM's, so ids from different engines never collide in a router's logs.
        return f"{prefix}-{uuid.uuid4().hex[:16]}"

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self._looking_up

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.running) + self.num_waiting

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished P/D prefill kept for its decode side."""
        released = self.scheduler.release_held(request_id)
        if released:
            self.metrics.kv_usage.set(self.kv.usage())
        return released

    def reset_prefix_cache(self) -> bool:
        """Forget cached blocks; like vLLM, AllBlocksCleared goes out with the next step's batch."""
        return self.kv.reset()

    # -- the loop ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        sched = self.scheduler
        scale = self.config.time_scale
        loop = asyncio.get_running_loop()
        # Steps end at absolute wall deadlines: a relative sleep would add every step's delivery work
        # (and the event loop's lateness) to the modelled time, so ITL would drift up with batch size.
        deadline = loop.time()
        while True:
            if not sched.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                # Idle time passes in the modelled clock too.
                self._clock = max(self._clock, (time.monotonic() - self._wall0) * scale)
                deadline = loop.time()
                continue
            out = sched.step(self._clock)
            self._clock += out.stats.duration
            now = loop.time()
            deadline = max(deadline + out.stats.duration / scale, now - MAX_LAG_S)
            await asyncio.sleep(max(0.0, deadline - now))
            self._deliver(out.new_tokens, out.finished)
            self.metrics.observe_step(
                out.stats, running=self.num_running, waiting=self.num_waiting, kv_usage=self.kv.usage()
            )
            self._publish_events()

    def _deliver(self, new_tokens: list[SimRequest], finished: list[SimRequest]) -> None:
        done = {id(r) for r in finished}
        for req in new_tokens:
            stream = self._streams.get(id(req))
            if stream is None:
                continue  # ended (aborted, or stopped by a stop string) while its step ran: output discarded
            if len(req.output_token_ids) == 1:
                self.metrics.observe_first_token(req)
                if self.connector is not None and req.external_prefix is not None:
                    self.connector.save(req)
            self.metrics.observe_token(req)
            finish = req.finish_reason if id(req) in done else None
            if finish is not None:
                self.metrics.observe_finished(req)
                del self._streams[id(req)]
            stream.queue.put_nowait(TokenEvent(req.output_token_ids[-1], finish, stream))

    def _publish_events(self) -> None:
        if self.events is None:
            return
        events = self.kv.take_events()
        if events:
            self.events.publish(events)
