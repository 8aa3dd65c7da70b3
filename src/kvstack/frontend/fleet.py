"""The engines a front end routes to: the registry, kept current as engines join and leave, and the JSON
views of it both front ends serve (``/engines`` with the engines by P/D role, ``/ready``, ``/v1/models``).

An engine added without models learns them from its ``/v1/models`` (a side call through the front end's
`UpstreamPool`), quickly at first and every ``models_refresh_s`` after; models an engine spec names are kept
as given (an operator may limit an engine to some of its models, or route an alias). Listeners (the KV-event
feeds, the history forgetter) are told of every addition and removal.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvstack.backoff import Backoff, BackoffSequence
from kvstack.engines.state import Endpoint, EngineRole, EngineState
from kvstack.frontend.metrics import RouterMetrics
from kvstack.frontend.registry import EngineRegistry
from kvstack.http.client import UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

MODELS_MAX_BYTES = 4 << 20  # /v1/models: a few hundred bytes per model or adapter
MODELS_RETRY_MAX_S = 5.0  # an engine that never answered /v1/models is asked again at least this often


class EngineListener(Protocol):
    """Told when engines join or leave (the KV-event subscribers follow the fleet this way)."""

    def engine_added(self, endpoint: Endpoint) -> None: ...

    def engine_removed(self, url: str) -> None: ...


class Fleet:
    def __init__(
        self,
        registry: EngineRegistry,
        metrics: RouterMetrics,
        client: UpstreamPool,
        *,
        expected_models: frozenset[str] = frozenset(),
        extra_state: Callable[[EngineState], dict[str, Any]] | None = None,
        listeners: Sequence[EngineListener] = (),
        models_refresh_s: float = 30.0,
        models_timeout_s: float = 2.0,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.client = client
        self.expected_models = expected_models
        self.extra_state = extra_state  # more /engines detail per engine (prefix knowledge)
        self.listeners = tuple(listeners)
        self.models_refresh_s = models_refresh_s
        self.models_timeout_s = models_timeout_s
        self._model_tasks: dict[str, asyncio.Task[None]] = {}

    async def close(self) -> None:
        tasks = list(self._model_tasks.values())
        self._model_tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def add_engine(self, endpoint: Endpoint) -> None:
        """Add or update an engine (see the module docstring for its models)."""
        configured = bool(endpoint.models)
        existing = self.registry.get(endpoint.url)
        if existing is not None and not endpoint.models and existing.state.endpoint.models:
            endpoint = _replace_models(endpoint, existing.state.endpoint.models)
        entry = self.registry.upsert(endpoint)
        self.metrics.engine_added(endpoint.url)
        self.metrics.set_circuit(endpoint.url, entry.breaker.state)
        for listener in self.listeners:
            listener.engine_added(endpoint)
        task = self._model_tasks.get(endpoint.url)
        if configured:
            if task is not None:
                del self._model_tasks[endpoint.url]
                task.cancel()
        elif task is None:
            self._model_tasks[endpoint.url] = asyncio.get_running_loop().create_task(
                self._refresh_models(endpoint.url)
            )

    def remove_engine(self, url: str) -> bool:
        task = self._model_tasks.pop(url, None)
        if task is not None:
            task.cancel()
        removed = self.registry.remove(url) is not None
        if removed:
            self.metrics.forget_engine(url)
            for listener in self.listeners:
                listener.engine_removed(url)
        return removed

    async def _refresh_models(self, url: str) -> None:
        """Learn an engine's served models from its /v1/models, quickly at first, then periodically."""
        retry = _models_retry(0.2)
        while True:
            entry = self.registry.get(url)
            if entry is None:
                return
            answered = False
            try:
                reply = await self.client.get(
                    url, "/v1/models", within=self.models_timeout_s, max_bytes=MODELS_MAX_BYTES
                )
                if reply.status != 200:
                    raise UpstreamError(f"answered HTTP {reply.status}")
                models = frozenset(m["id"] for m in reply.json()["data"])
                if models != entry.state.endpoint.models:
                    self.registry.upsert(_replace_models(entry.state.endpoint, models))
                answered = True
            except (UpstreamError, ValueError, KeyError, TypeError, RecursionError) as exc:
                log.debug("engine %s: /v1/models failed: %r", url, exc)
            if answered or entry.state.endpoint.models:
                delay = self.models_refresh_s
                retry = _models_retry(delay)
            else:
                delay = retry.next()
            await asyncio.sleep(delay)

    # -- views ---------------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, detail): ready when every expected model (default: every model seen) has a routable
        engine."""
        states = self.registry.states()
        models = set(self.expected_models) or {m for s in states for m in s.endpoint.models}
        detail = {}
        for model in sorted(models):
            routable = [s.url for s in states if model in s.endpoint.models and s.routable]
            detail[model] = {"routable_engines": routable}
        ok = bool(models) and all(d["routable_engines"] for d in detail.values())
        return ok, {"ready": ok, "models": detail, "engines": len(states)}

    def models_list(self) -> dict[str, Any]:
        """The union of the engines' models as an OpenAI model list."""
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "kvstack"}
            for m in sorted(self.registry.models())
        ]
        return {"object": "list", "data": data}

    def engines_detail(self) -> list[dict[str, Any]]:
        """Every engine's state as ``/engines`` shows it."""
        out = []
        now = time.monotonic()
        for s in self.registry.states():
            reading = s.metrics
            item: dict[str, Any] = {
                "url": s.url,
                "type": s.endpoint.engine_type,
                "role": s.endpoint.role.value,
                "models": sorted(s.endpoint.models),
                "routable": s.routable,
                "healthy": s.healthy,
                "draining": s.draining,
                "circuit": s.circuit.value,
                "in_flight": s.total_in_flight,
                "in_flight_this_worker": s.in_flight,
                "metrics": None
                if reading is None
                else {
                    "age_seconds": round(reading.age(now), 3),
                    "stale": s.metrics_stale,
                    "queue": reading.signals.queue,
                    "running": reading.signals.running,
                    "kv_usage": reading.signals.kv_usage,
                    "missing": sorted(reading.missing),
                    "aliases_used": [list(a) for a in reading.aliases_used],
                },
                "routing_knowledge": s.knowledge,
            }
            if self.extra_state is not None:
                item.update(self.extra_state(s))
            out.append(item)
        return out

    def roles(self) -> dict[str, list[str]]:
        """The engines' URLs (sorted) by disaggregation role (``/engines``' ``roles``)."""
        out: dict[str, list[str]] = {role.value: [] for role in EngineRole}
        for s in self.registry.states():
            out[s.endpoint.role.value].append(s.url)
        return {role: sorted(urls) for role, urls in out.items()}

    def refresh_gauges(self) -> None:
        """The engine gauges read when metrics are rendered: circuit states and routable counts."""
        states = self.registry.states()
        for s in states:
            self.metrics.set_circuit(s.url, s.circuit)
        self.metrics.engines.labels(state="routable").set(sum(1 for s in states if s.routable))
        self.metrics.engines.labels(state="unroutable").set(sum(1 for s in states if not s.routable))


def _models_retry(after: float) -> BackoffSequence:
    """Retries of an engine with no models yet: doubling from ``after`` s, up to ``MODELS_RETRY_MAX_S``."""
    return Backoff(min(2 * after, MODELS_RETRY_MAX_S), MODELS_RETRY_MAX_S).sequence()


def _replace_models(endpoint: Endpoint, models: frozenset[str]) -> Endpoint:
    return dataclasses.replace(endpoint, models=models)
