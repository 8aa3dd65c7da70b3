"""Static discovery: the engines given as ``--engine URL[#key=value,...]`` strings, published once.

``parse_engine_spec`` reads the string syntax; the fields are checked by ``kvstack.engines.specs``.
"""

from __future__ import annotations

from kvstack.backoff import Backoff
from kvstack.engines.discovery.base import (
    RETRY_BACKOFF,
    Discovery,
    DiscoveryConfigError,
    ModelFetcher,
    by_url,
)
from kvstack.engines.specs import EngineSpecError, build_endpoint, with_default_scheme
from kvstack.engines.state import Endpoint

# Option name in the string -> field name.
_OPTIONS = {"type": "type", "role": "role", "node": "node", "kv-events": "kv_events"}


def parse_engine_spec(spec: str, where: str = "--engine") -> Endpoint:
    """Parse ``URL[#key=value,...]``; raises ``DiscoveryConfigError`` naming ``where`` and the problem.

    Keys: ``type`` (vllm, sglang, trtllm, triton; default vllm), ``role`` (both|prefill|decode, default
    both), ``model`` (repeat for several), ``node``, ``kv-events`` (the engine's ZMQ endpoint). A URL without
    a scheme gets ``http://``. Example::

        http://10.0.0.5:8000#type=sglang,role=prefill,model=qwen,kv-events=tcp://10.0.0.5:5557
    """
    url, _, options = spec.partition("#")
    fields: dict[str, str] = {}
    models: list[str] = []
    for item in filter(None, (i.strip() for i in options.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            raise DiscoveryConfigError(f"{where} {spec!r}: option {item!r} should be key=value")
        if key == "model":
            models.append(value)
        elif key in _OPTIONS:
            fields[_OPTIONS[key]] = value
        else:
            raise DiscoveryConfigError(
                f"{where} {spec!r}: unknown option {key!r}; known: type, role, model, node, kv-events"
            )
    try:
        return build_endpoint(
            where,
            with_default_scheme(url),
            engine_type=fields.get("type"),
            role=fields.get("role"),
            models=models,
            node=fields.get("node"),
            kv_events=fields.get("kv_events"),
        )
    except EngineSpecError as exc:
        raise DiscoveryConfigError(str(exc)) from None


class StaticDiscovery(Discovery):
    """A fixed list of engines given as ``parse_engine_spec`` strings; invalid specs raise at construction."""

    def __init__(
        self,
        specs: list[str],
        *,
        fetch_models: ModelFetcher | None = None,
        model_backoff: Backoff = RETRY_BACKOFF,
    ) -> None:
        super().__init__(fetch_models=fetch_models, model_backoff=model_backoff)
        self._endpoints = by_url([parse_engine_spec(s) for s in specs], "--engine")

    def describe(self) -> str:
        return f"static ({len(self._endpoints)} engines)"

    async def _run(self) -> None:
        self._publish(self._endpoints)
