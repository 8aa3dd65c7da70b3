"""`KVStackConnector`: kvstack's KV cache tier as a vLLM (0.32) ``KVConnectorBase_V1``.

Load it with ``--kv-transfer-config '{"kv_connector": "KVStackConnector", "kv_connector_module_path":
"kvstack.connector.vllm_v1", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {"server": "tcp://127.0.0.1:5560"}}'`` (settings: ``kvstack.connector.config``).

vLLM builds it twice. The scheduler half answers ``get_num_new_matched_tokens`` with one lookup on the
cache server and plans each step's loads and saves (``kvstack.connector.planner``); the worker half copies
chunks into the allocated blocks in ``start_load_kv`` (synchronous, before the forward pass) and, in
``wait_for_save``, hands the step's new full chunks to a background thread that saves them
(``kvstack.connector.saves``; a full queue drops the save, the forward pass never waits). P/D
disaggregation goes through the tier (``kvstack.connector.handoff``): a prefill request's params name the
chunks it leaves there; a decode request carrying them waits for them, for at most ``prefill_wait_s``.

Faults never reach vLLM as exceptions: a failed lookup is a miss, a failed load reports its blocks in
``get_block_ids_with_load_errors`` (recomputed under ``"kv_load_failure_policy": "recompute"``; under vLLM's
default, "fail", the request fails), a failed save is dropped and counted. A KV cache layout or model the
connector cannot handle turns it off (logged once); the engine then runs without it.
"""

# torch and vLLM are not in kvstack's dev environment; they are in the vLLM environment this runs in.
# mypy: disable-error-code="import-not-found"
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstack.cache.client import CacheClient
from kvstack.cache.keys import ChunkKey
from kvstack.cache.protocol import StoredTail
from kvstack.connector.config import ConnectorConfig, parse_config
from kvstack.connector.handoff import Handoff, HandoffWaits, handoff_of, prefill_answer
from kvstack.connector.layout import AttentionShape, block_layout_name, detect_layout, kv_layout
from kvstack.connector.plan import RequestSave, StepPlan
from kvstack.connector.planner import ChunkPlanner, keys_by_rank, tail_keys_by_rank
from kvstack.connector.saves import SaveQueue
from kvstack.connector.worker import BlockMover, Payloads
from kvstack.logs import ThrottledLog

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStackConnector", "KVStackConnectorMetadata", "KVStackLayoutReport", "KVStackWorkerReport"]

# A child of vLLM's logger: vLLM configures only "vllm", so these lines get its handler, format and level.
log = logging.getLogger("vllm.kvstack.connector")

_TIER_SOURCES = {"memory": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
_DRAIN_S = 5.0  # shutdown: how long queued saves may still be sent
_AWAITING_LAYOUT = "the workers have not reported their KV cache layout yet"


@dataclass
class KVStackConnectorMetadata(KVConnectorMetadata):
    """Scheduler half -> workers, once per step."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KVStackWorkerReport(KVConnectorWorkerMetadata):
    """Workers -> scheduler half, after a step: a worker turned the connector off (sent once), and save
    jobs done reading their blocks since the last report."""

    disabled: str | None = None
    saved: dict[str, int] = field(default_factory=dict)
    """Save jobs per request, summed over the workers."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVStackWorkerReport):
            return self
        saved = dict(self.saved)
        for req_id, n in other.saved.items():
            saved[req_id] = saved.get(req_id, 0) + n
        return KVStackWorkerReport(self.disabled or other.disabled, saved)


@dataclass
class KVStackLayoutReport(KVConnectorHandshakeMetadata):
    """A worker -> the scheduler half, once at start-up (vLLM's handshake metadata): the block layout its
    KV cache gives the key namespace, or why it cannot move its KV cache."""

    block_layout: str | None
    problem: str | None = None


def agreed_block_layout(reports: Mapping[int, object], tp_size: int) -> tuple[str | None, str | None]:
    """The block layout every tensor-parallel rank reported, or why there is none: (layout, problem)."""
    missing = [rank for rank in range(tp_size) if not isinstance(reports.get(rank), KVStackLayoutReport)]
    if missing:
        return None, f"tensor-parallel ranks {missing} reported no KV cache layout"
    layouts: dict[str, list[int]] = {}
    for rank in range(tp_size):
        report = reports[rank]
        assert isinstance(report, KVStackLayoutReport)
        if report.problem is not None or report.block_layout is None:
            return None, f"rank {rank}: {report.problem or 'no KV cache layout'}"
        layouts.setdefault(report.block_layout, []).append(rank)
    if len(layouts) > 1:
        return None, f"the tensor-parallel ranks' KV cache layouts differ: {layouts}"
    return next(iter(layouts)), None


def layer_backends(vllm_config: VllmConfig, layer_names: Sequence[str]) -> dict[str, str]:
    """The attention backend (vLLM's name, e.g. "CPU_ATTN") of each of ``layer_names`` this process knows
    (vLLM's forward context); layers it does not know are left out."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
    return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}


def attention_shape(kv_cache_config: KVCacheConfig | None) -> tuple[AttentionShape | None, str | None]:
    """Every layer's KV shape from vLLM's KV cache spec, or why the connector cannot handle the model."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec

    if kv_cache_config is None:
        return None, "vLLM passed no KV cache config"
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return None, f"{len(groups)} KV cache groups (a hybrid model); only one full-attention group works"
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
        return None, f"KV cache spec {type(spec).__name__}; only full attention (not MLA) works"
    if spec.sliding_window is not None or spec.attention_chunk_size is not None:
        return None, "sliding-window or chunked-local attention is not supported"
    if spec.kv_quant_mode != KVQuantMode.NONE or spec.head_size_v != spec.head_size:
        return None, "a quantized KV cache, or V heads of another size than K, is not supported"
    if spec.num_head_slots is not None or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
        return None, "a packed KV cache page (head slots, state bytes, tokens per state) is not supported"
    shape = AttentionShape(
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=str(spec.dtype).removeprefix("torch."),
        block_size=spec.block_size,
    )
    return shape, None


def _parallel_problem(vllm_config: VllmConfig) -> str | None:
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1 or parallel.decode_context_parallel_size != 1:
        return "pipeline or decode-context parallelism is not supported (a rank would hold part of a chunk)"
    return None


def cacheable_tokens(request: Request) -> list[int] | None:
    """The prompt tokens whose KV the store may serve and keep, or None when the KV depends on more than
    the tokens (images, a LoRA adapter) or must not be shared (a cache salt)."""
    if request.mm_features or request.lora_request is not None or request.cache_salt:
        return None
    return request.prompt_token_ids


class KVStackConnector(KVConnectorBase_V1):
    """kvstack's KV cache tier behind vLLM's KV connector API (see the module docstring).

    ``wait_for_layer_load`` and ``save_kv_layer`` do nothing: the whole step's KV is moved at once.
    ``get_num_new_matched_tokens`` answers None ("ask again later": vLLM skips the request for a step) while a
    decode request waits for the chunks its prefill engine handed off. Blocks a save reads stay allocated
    until it has read them (vLLM 0.32's contract):

    - the workers acknowledge each save job once done reading, through their worker metadata;
    - ``request_finished`` returns False when every save job of the request is acknowledged (or it had
      none), else True: vLLM keeps the blocks, the next plan lists the request as held,
      and the workers report it in ``get_finished`` (``finished_sending``) once, when its jobs are done;
      vLLM passes it in that step's ``finished_req_ids`` too, as the contract requires;
    - preemption frees blocks without ``request_finished``: the next plan lists preempted requests with
      jobs in flight, and ``handle_preemptions`` (before the forward pass) drops their queued jobs and waits
      for a gather in progress. An abort is an ordinary ``request_finished``.

    A failed load is a lost, corrupt or wrong-sized chunk; with ``"recompute"`` the request is answered as
    if nothing had been loaded, and a warning at start-up says when the policy is "fail". ``shutdown``
    sends what is queued for up to 5 s and drops the rest; vLLM waits for it only with
    ``--shutdown-timeout`` > 0 (its default, 0, kills the workers at once: saves still queued are lost,
    future misses).

    The key namespace names the KV cache layout and the attention backend (``kvstack.connector.layout``),
    which only the workers know: vLLM builds the scheduler half without tensors and picks a backend per
    layer in the workers (``cache_config.kv_cache_layout`` is the physical order in memory, not the tensor
    layout). Each worker detects both in ``register_kv_caches`` and reports the block layout as handshake
    metadata (``get_handshake_metadata``); vLLM hands the reports to the scheduler half
    (``set_xfer_handshake_metadata``) before the first request. The scheduler half keys nothing until every
    tensor-parallel rank has reported the same block layout (a problem or a disagreement turns the
    connector off). Every step's plan names its keys' block layout; a worker whose own differs turns itself
    off (its loads fail and are recomputed, its saves are skipped) and tells the scheduler half through its
    worker metadata.
    """

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._config: ConnectorConfig = parse_config(self._kv_transfer_config.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        self._config.check_block_size(self._block_size)
        from vllm.platforms import current_platform

        self._platform = current_platform.device_type
        self._attn, problem = attention_shape(kv_cache_config)
        self._disabled = problem or _parallel_problem(vllm_config)
        self._model = self._config.model_id or vllm_config.model_config.model
        # The name requests use (the first --served-model-name): a router credits the chunks to it.
        self._served_model: str = vllm_config.model_config.served_model_name
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._engine = self._kv_transfer_config.engine_id or ""
        self._warn = ThrottledLog(log, 10.0)
        self._client: CacheClient | None = None
        self._block_layout: str | None = None
        """The key namespace's block layout: the workers' (scheduler half), this worker's (worker half)."""
        # scheduler half
        self._planner: ChunkPlanner | None = None
        self._said_waiting = False
        self._handoffs = HandoffWaits(self._config.prefill_wait_s)
        # P/D problems, each throttled on its own: one must not hide the other.
        self._warn_keys, self._warn_late = ThrottledLog(log, 10.0), ThrottledLog(log, 10.0)
        # worker half
        self._mover: BlockMover | None = None
        self._saves: SaveQueue[Payloads] = SaveQueue(
            self._gather,
            self._send,
            capacity=self._config.save_queue,
            on_exit=self._close_save_client,
            log=log,
            name=f"kvstack-saves:{self._engine}",
        )
        self._failed: set[int] = set()
        self._reported = False
        if self._disabled is not None:
            log.warning(
                "kvstack connector: off (%s); the engine runs without the KV cache tier", self._disabled
            )
        if role == KVConnectorRole.SCHEDULER:
            self._start_scheduler()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never lost work

    # ==============================
    # Scheduler half
    # ==============================

    def _start_scheduler(self) -> None:
        config, transfer = self._config, self._kv_transfer_config
        self._planner = ChunkPlanner(
            chunk_size=config.chunk_size,
            block_size=self._block_size,
            keys_for=lambda token_ids: [],
            locate=self._locate,
            locate_tails=self._find if config.partial_tail else None,
            load=config.load and transfer.is_kv_consumer,
            save=config.save and transfer.is_kv_producer,
            workers=self._tp_size,
            log=log,
            disabled=self._disabled or _AWAITING_LAYOUT,  # `set_xfer_handshake_metadata` enables it
        )
        if self._disabled is not None:
            return
        self._client = self._new_client(shm=False, name=f"vllm-scheduler:{self._engine}")
        log.info(
            "kvstack connector: server %s, chunks of %d tokens (%d blocks), load %s, save %s, "
            "partial tails %s",
            config.server,
            config.chunk_size,
            config.chunk_size // self._block_size,
            self._planner.load,
            self._planner.save,
            config.partial_tail,
        )
        if transfer.kv_load_failure_policy != "recompute":
            log.warning(
                "kvstack connector: kv_load_failure_policy is %r: a chunk that fails to load fails its "
                'request; set "kv_load_failure_policy": "recompute" in --kv-transfer-config to recompute it',
                transfer.kv_load_failure_policy,
            )

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """The workers' KV cache layouts (vLLM calls this once, before the first request): the key
        namespace, if they agree."""
        planner = self._planner
        if planner is None or self._attn is None or planner.disabled != _AWAITING_LAYOUT:
            return
        block_layout, problem = agreed_block_layout(metadata, self._tp_size)
        if block_layout is None:
            self._disabled = problem or "no KV cache layout"
            planner.disable(self._disabled)
            log.warning("kvstack connector: off (%s); the engine runs without the KV cache tier", problem)
            return
        self._block_layout = block_layout
        layouts = [
            kv_layout(self._model, self._attn, block_layout=block_layout, tp_rank=r, tp_size=self._tp_size)
            for r in range(self._tp_size)
        ]
        chunk_size = self._config.chunk_size
        planner.enable(keys_by_rank(layouts, chunk_size), tail_keys_by_rank(layouts, chunk_size))
        log.info("kvstack connector: keys of %s", layouts[0])

    def _new_client(self, *, shm: bool, name: str) -> CacheClient:
        config = self._config
        return CacheClient(
            config.server,
            secret=config.secret(),
            timeout_s=config.timeout_s,
            shm=shm,
            arena_bytes=config.arena_mb << 20,
            retry_initial_s=config.timeout_s,
            retry_max_s=config.retry_max_s,
            name=name,
        )

    def _locate(self, keys: Sequence[ChunkKey]) -> list[str]:
        return [] if self._client is None else self._client.locate(keys)

    def _find(self, keys: Sequence[ChunkKey], parent: ChunkKey | None) -> tuple[list[str], list[StoredTail]]:
        return ([], []) if self._client is None else self._client.find(keys, parent=parent)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._planner is not None
        if self._planner.disabled == _AWAITING_LAYOUT and not self._said_waiting:
            self._said_waiting = True
            log.warning(
                "kvstack connector: off until the workers report their KV cache layout (vLLM passes it "
                "with the workers' handshake metadata at start-up; this vLLM has not): no chunk is "
                "looked up or saved"
            )
        try:
            handoff = handoff_of(request.kv_transfer_params)
            if handoff is not None and not self._handoffs.due(request.request_id):
                return None, False  # waiting for a prefill engine's chunks; not time to look again
            tokens = cacheable_tokens(request)
            matched = self._planner.match(request.request_id, tokens, num_computed_tokens)
            if handoff is not None and self._awaits(request.request_id, handoff):
                return None, False  # vLLM asks again next step
            return matched, False
        except Exception as e:  # never into vLLM's scheduler loop
            self._warn.warning("kvstack connector: lookup of %s failed (%r); a miss", request.request_id, e)
            return 0, False

    def _awaits(self, req_id: str, handoff: Handoff) -> bool:
        """Whether a decode request should wait for more of the chunks its prefill engine handed off (see
        ``kvstack.connector.handoff``), after a lookup."""
        planner = self._planner
        assert planner is not None
        stored = planner.stored_end(req_id)
        if stored is None:
            return False  # nothing looked up: off, not loading, or a prompt the tier must not serve
        if planner.chunk_key(req_id, handoff.tokens // self._config.chunk_size - 1) != handoff.key:
            self._warn_keys.warning(
                "kvstack connector: request %s: its prefill engine saved the prompt under other chunk keys "
                "than this engine computes (another kv_connector_extra_config model_id or chunk_size, KV "
                "cache layout or tensor-parallel size, or other prompt tokens); computing the prompt. Give "
                "prefill and decode engines the same model, layout and connector settings",
                req_id,
            )
            return False
        if self._handoffs.keep_waiting(req_id, handoff, stored):
            return True
        if stored < handoff.tokens:
            self._warn_late.warning(
                "kvstack connector: request %s: %d of the %d prompt tokens its prefill engine handed off "
                "are in the tier after %.1f s (prefill_wait_s); computing the rest",
                req_id,
                stored,
                handoff.tokens,
                self._handoffs.wait_s,
            )
        return False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._planner is not None
        self._planner.allocated(request.request_id, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._planner is not None
        sources: dict[CacheHitSource, int] = {}
        for tier, tokens in self._planner.sources(request.request_id, num_external_tokens).items():
            source = _TIER_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            sources[source] = sources.get(source, 0) + tokens
        if sum(sources.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return sources

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        planner = self._planner
        assert planner is not None
        scheduled = scheduler_output.num_scheduled_tokens
        try:
            planner.preempted(scheduler_output.preempted_req_ids or ())
            for new in scheduler_output.scheduled_new_reqs:
                if new.prompt_token_ids is not None:
                    planner.schedule_new(
                        new.req_id,
                        new.prompt_token_ids,
                        new.block_ids[0],
                        new.num_computed_tokens,
                        scheduled.get(new.req_id, 0),
                    )
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                new_blocks = cached.new_block_ids[i]
                planner.schedule_cached(
                    req_id,
                    None if new_blocks is None else new_blocks[0],
                    req_id in cached.resumed_req_ids,
                    cached.num_computed_tokens[i],
                    scheduled.get(req_id, 0),
                )
        except Exception as e:
            self._warn.warning("kvstack connector: planning the step failed (%r); nothing saved this step", e)
        plan = planner.take_plan()
        plan.block_layout = self._block_layout or ""
        return KVStackConnectorMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        planner = self._planner
        if not isinstance(report, KVStackWorkerReport) or planner is None:
            return
        planner.acknowledged(report.saved)
        if report.disabled and planner.disabled is None:
            log.warning("kvstack connector: off, a worker reports: %s", report.disabled)
            planner.disable(report.disabled)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        planner = self._planner
        assert planner is not None
        self._handoffs.end(request.request_id)
        tokens, key = planner.handed_off(request.request_id)
        params = prefill_answer(request.kv_transfer_params, tokens, key)
        held = planner.finished(request.request_id)
        if held and planner.num_held == 1:
            log.info(
                "kvstack connector: request %s finished with saves in flight; vLLM keeps its blocks until "
                "the workers have read them (logged for the first such request only)",
                request.request_id,
            )
        return held, params

    # ==============================
    # Worker half
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._disabled is not None or self._attn is None:
            return
        names = self._kv_cache_config.kv_cache_groups[0].layer_names
        missing = [name for name in names if name not in kv_caches]
        if missing:
            self._disable(f"vLLM registered no KV cache for layers {missing[:3]}")
            return
        layers = [kv_caches[name] for name in names]
        first = layers[0]
        log.info(
            "kvstack connector: %d KV cache layers, each %s %s on %s, strides %s; spec %s",
            len(layers),
            tuple(first.shape),
            first.dtype,
            first.device,
            tuple(first.stride()),
            self._attn,
        )
        verdict = detect_layout(tuple(first.shape), self._attn)
        if not verdict.supported:
            self._disable(f"KV cache layout {verdict.name}: {verdict.reason}")
            return
        if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in layers):
            self._disable("the layers' KV caches differ in shape, dtype or device")
            return
        if str(first.dtype).removeprefix("torch.") != self._attn.dtype:
            self._disable(f"KV cache dtype {first.dtype} is not the spec's {self._attn.dtype}")
            return
        backends = set(layer_backends(self._vllm_config, names).values())
        if len(backends) != 1:
            self._disable(
                f"the attention layers use backends {sorted(backends)}; the key namespace needs exactly one"
                if backends
                else f"cannot tell which attention backend layers {names[:3]} use (none in vLLM's forward "
                "context)"
            )
            return
        self._block_layout = block_layout_name(
            verdict.name, platform=self._platform, backend=backends.pop(), block_size=self._attn.block_size
        )
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
        shm = self._config.shm
        self._mover = BlockMover(
            layers,
            blocks_per_chunk=self._config.chunk_size // self._block_size,
            rank=rank,
            client=self._new_client(shm=shm, name=f"vllm-worker{rank}:{self._engine}"),
            save_client=self._new_client(shm=shm, name=f"vllm-worker{rank}-saves:{self._engine}"),
            block_dim=verdict.block_dim,
            model=self._served_model,
        )
        log.info(
            "kvstack connector: layout %s, %d bytes per chunk, rank %d of %d",
            self._block_layout,
            self._mover.chunk_bytes,
            rank,
            self._tp_size,
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._role != KVConnectorRole.WORKER:
            return None
        if self._disabled is None and self._block_layout is None:
            return KVStackLayoutReport(None, "vLLM registered no KV cache with the connector")
        return KVStackLayoutReport(self._block_layout, self._disabled)

    def _disable(self, reason: str) -> None:
        self._disabled = reason
        log.warning("kvstack connector: off (%s); the engine runs without the KV cache tier", reason)

    def _plan(self) -> StepPlan | None:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, KVStackConnectorMetadata) else None

    def _mover_for(self, plan: StepPlan) -> BlockMover | None:
        """The mover, if the plan's chunk keys are of this worker's KV cache layout (else the connector
        turns off: its keys would name bytes of another layout)."""
        if self._disabled is not None or self._mover is None:
            return None
        if (plan.loads or plan.saves) and plan.block_layout != self._block_layout:
            self._disable(
                f"the scheduler half keys chunks of KV cache layout {plan.block_layout!r}, this worker's "
                f"is {self._block_layout!r}"
            )
            return None
        return self._mover

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None:
            return
        self._failed.update(plan.failed_block_ids)
        mover = self._mover_for(plan)
        for load in plan.loads:
            if mover is None:
                self._failed.update(load.block_ids())
                continue
            try:
                loaded, failed = mover.load(load)
            except Exception as e:  # a bug here must cost a recompute, not the engine
                loaded, failed = 0, load.block_ids()
                log.exception("kvstack connector: loading %s failed: %r", load.req_id, e)
            if failed:
                self._failed.update(failed)
                self._warn.warning(
                    "kvstack connector: request %s: loaded %d of %d chunks; %d blocks to recompute",
                    load.req_id,
                    loaded,
                    len(load.chunks),
                    len(failed),
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer already

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # wait_for_save saves every layer at once

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None:
            return
        mover = self._mover_for(plan)
        # The step's forward pass has written these blocks (on a device: once `ready` returns).
        ready = mover.written() if mover is not None and plan.saves else None
        for save in plan.saves:
            if mover is None:
                self._saves.skip(save)
            else:
                self._saves.submit(save, ready)

    def _gather(self, save: RequestSave) -> Payloads:
        assert self._mover is not None  # saves are queued only with a mover
        return self._mover.gather(save)

    def _send(self, save: RequestSave, payloads: Payloads) -> bool:
        assert self._mover is not None
        return self._mover.send(save, payloads)

    def _close_save_client(self) -> None:
        """On the save thread, its only user, when the thread ends."""
        if self._mover is not None and self._mover.save_client is not self._mover.client:
            self._mover.save_client.close()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if (
            isinstance(kv_connector_metadata, KVStackConnectorMetadata)
            and kv_connector_metadata.plan.preempted
        ):
            self._saves.cancel(set(kv_connector_metadata.plan.preempted))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        plan = self._plan()
        for req_id in plan.held if plan is not None else ():
            self._saves.hold(req_id)
        return self._saves.take_released() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._role != KVConnectorRole.WORKER:
            return None
        disabled = self._disabled if not self._reported else None
        self._reported = self._disabled is not None
        saved = self._saves.take_acks()
        if disabled is None and not saved:
            return None
        return KVStackWorkerReport(disabled, saved)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            if not self._saves.close(_DRAIN_S):
                log.warning("kvstack connector: saves still running after %.0f s; abandoned", _DRAIN_S)
            log.info("kvstack connector: saves: %s", self._saves.stats)
        elif self._planner is not None and self._planner.tails:
            planner = self._planner
            log.info(
                "kvstack connector: partial tails: %d loads planned (%d tokens), %d saves planned",
                planner.num_tail_loads,
                planner.num_tail_tokens,
                planner.num_tail_saves,
            )
        client = self._mover.client if self._mover is not None else self._client
        if client is not None:
            client.close()
