"""precise-prefix-scorer: prefer engines that already hold the prompt's prefix in their KV cache.

Formula: score = sum_t w_t * (c_t - c_{t-1}) / P (c_{-1} = 0), with P the prompt tokens and c_t the longest
consecutive prompt prefix the engine has at tier t or better (gpu, cpu, disk, remote; from KV events and
cache-tier events, see ``PrefixView``): a prompt fully in GPU blocks scores 1, lower tiers count for less.
An engine without events (``knowledge != "kv-events"``) scores, with ``useApproximate`` on,
max(approximateWeight * a / P, the formula over what cache servers hold for it), a = the prefix tokens the
router recently sent there. Each engine's cached prompt tokens (the longest prefix at any tier, or that
guess) are left in CycleState (``CACHED_PROMPT_TOKENS``) for pd-profile-handler.

Parameters: every weight is a number in [0, 1].
  gpuWeight (default 1.0)          tokens in the engine's own blocks
  cpuWeight (default 0.8)          offloaded blocks / same-node cache memory
  diskWeight (default 0.5)         local disk tier
  remoteWeight (default 0.3)       remote tier (Redis, S3)
  useApproximate (default true)    score event-less engines from routing history
  approximateWeight (default 0.9)

Cost: O(candidates); the router does the prefix lookup once per request, before scheduling.
When to use: the heart of KV-aware routing (preset ``kv-aware``), with load scorers and the saturation
filter: alone it sends every request sharing a hot prefix to the one engine holding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, Scorer, record_cached
from kvstack.scheduling.params import Param


def _unit(v: float) -> bool:
    return 0.0 <= v <= 1.0


class PrecisePrefixScorer(Scorer):
    type_name: ClassVar[str] = "precise-prefix-scorer"
    needs_prefix: ClassVar[bool] = True
    params: ClassVar[tuple[Param, ...]] = (
        Param("gpuWeight", "gpu_weight", float, 1.0, "a number in [0, 1]", _unit),
        Param("cpuWeight", "cpu_weight", float, 0.8, "a number in [0, 1]", _unit),
        Param("diskWeight", "disk_weight", float, 0.5, "a number in [0, 1]", _unit),
        Param("remoteWeight", "remote_weight", float, 0.3, "a number in [0, 1]", _unit),
        Param("useApproximate", "use_approximate", bool, True, "true or false"),
        Param("approximateWeight", "approximate_weight", float, 0.9, "a number in [0, 1]", _unit),
    )

    def __init__(
        self,
        name: str | None = None,
        *,
        gpu_weight: float = 1.0,
        cpu_weight: float = 0.8,
        disk_weight: float = 0.5,
        remote_weight: float = 0.3,
        use_approximate: bool = True,
        approximate_weight: float = 0.9,
    ) -> None:
        super().__init__(name)
        self.tier_weights = (gpu_weight, cpu_weight, disk_weight, remote_weight)
        self.use_approximate = use_approximate
        self.approximate_weight = approximate_weight

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        view = request.prefix
        if view is None or view.prompt_tokens <= 0:
            return {}
        total = view.prompt_tokens
        out: dict[str, float] = {}
        cached: dict[str, int] = {}
        for engine in candidates:
            url = engine.url
            cached[url] = view.cached_tokens(engine, self.use_approximate)
            tiers = view.precise.get(url)
            score = 0.0
            if tiers is not None:
                weighted, below = 0.0, 0
                for weight, cumulative in zip(self.tier_weights, tiers, strict=False):
                    weighted += weight * (cumulative - below)
                    below = cumulative
                score = weighted / total
            if self.use_approximate and engine.knowledge != "kv-events":
                score = max(score, self.approximate_weight * view.approximate.get(url, 0) / total)
            elif tiers is None:
                continue
            out[url] = score
        record_cached(state, cached)
        return out
