"""The scheduler: eligibility, then profiles run by the profile handler.

A decision:
1. Eligibility, always on so no configuration can route to a dead engine or the wrong model: model-filter
   then health-filter over the engines passed in. Nothing left raises NoEndpointError with the reason
   (no engines, model not served, none routable — with each engine's reason).
2. The profile handler picks profiles; each runs its filters in order (stopping when none is left), adds
   ``weight * score`` over its scorers (scores clamped to [0, 1], weights not normalised), and hands the
   totals to its picker.
3. The handler turns the profile results into the SchedulingResult.

Cost per decision, n = engines passed in: eligibility O(n); each filter and scorer O(n) (session affinity
adds an O(log) ring lookup; least-QPS an O(log) bisection per engine); the picker O(n log n) to order the
retry fallbacks. Allocations are a few lists and dicts of n entries; the only larger structure, the
session hash ring, is cached across decisions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from kvstack.engines.state import EngineState
from kvstack.scheduling.filters.health import HealthFilter, unroutable_reason
from kvstack.scheduling.filters.model import ModelFilter
from kvstack.scheduling.interfaces import (
    CycleState,
    Filter,
    NoEndpointError,
    NoEndpointReason,
    Picker,
    ProfileHandler,
    ProfileResult,
    SchedulingRequest,
    SchedulingResult,
    ScoredEngine,
    Scorer,
)
from kvstack.scheduling.pickers.max_score import MaxScorePicker
from kvstack.scheduling.profile_handlers.single import SingleProfileHandler

# Engines named in a NO_ROUTABLE_ENGINE message; a large fleet's full list would drown the log line.
_MAX_LISTED = 8


class SchedulerProfile:
    """Filters in order, weighted scorers, one picker."""

    __slots__ = ("filters", "name", "picker", "scorers")

    def __init__(
        self,
        name: str,
        filters: Sequence[Filter] = (),
        scorers: Sequence[tuple[Scorer, float]] = (),
        picker: Picker | None = None,
    ) -> None:
        if picker is None:
            picker = MaxScorePicker()  # as in llm-d: a profile without a picker takes the highest score
        for scorer, weight in scorers:
            if not 0 <= weight < math.inf:  # also rejects NaN; inf * 0 would make totals NaN
                raise ValueError(
                    f"profile {name!r}: scorer {scorer.name!r} has weight {weight}; must be finite and >= 0"
                )
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple((s, float(w)) for s, w in scorers if w > 0)  # a 0 weight cannot change a total
        self.picker = picker

    def run(
        self, request: SchedulingRequest, state: CycleState, candidates: list[EngineState]
    ) -> ProfileResult:
        for f in self.filters:
            candidates = f.filter(request, state, candidates)
            if not candidates:
                return ProfileResult(self.name, (), {}, emptied_by=f.name)
        if len(candidates) == 1:
            # Nothing to compare: scores could not change the choice (a one-engine fleet's hot path).
            return ProfileResult(self.name, (candidates[0],), {candidates[0].url: 0.0})
        totals = dict.fromkeys((e.url for e in candidates), 0.0)
        for scorer, weight in self.scorers:
            scores = scorer.score(request, state, candidates)
            for url, score in scores.items():
                if url in totals:
                    totals[url] += weight * _clamp(score)
        scored = [ScoredEngine(e, totals[e.url]) for e in candidates]
        return ProfileResult(self.name, tuple(self.picker.pick(request, state, scored)), totals)

    def __repr__(self) -> str:
        scorers = ", ".join(f"{s.name}*{w:g}" for s, w in self.scorers)
        filters = ", ".join(f.name for f in self.filters)
        picker = self.picker.name
        return f"SchedulerProfile({self.name!r}, filters=[{filters}], scorers=[{scorers}], picker={picker})"


def _clamp(score: float) -> float:
    if math.isnan(score):
        return 0.0
    return 0.0 if score < 0.0 else 1.0 if score > 1.0 else score


class Scheduler:
    """Chooses engines for requests; built by config.build_scheduler or directly from profiles."""

    def __init__(self, profiles: Sequence[SchedulerProfile], handler: ProfileHandler | None = None) -> None:
        self.profiles = {p.name: p for p in profiles}
        if len(self.profiles) != len(profiles):
            raise ValueError(f"duplicate scheduling profile names: {[p.name for p in profiles]}")
        self.handler = handler or SingleProfileHandler()
        problem = self.handler.check_profiles(list(self.profiles))
        if problem:
            raise ValueError(problem)
        self._names = tuple(self.profiles)
        self.needs_prefix = any(
            plugin.needs_prefix
            for profile in profiles
            for plugin in (*profile.filters, *(s for s, _ in profile.scorers), profile.picker)
        )
        self._model_filter = ModelFilter()
        self._health_filter = HealthFilter()

    def schedule(
        self, request: SchedulingRequest, candidates: Sequence[EngineState], now: float | None = None
    ) -> SchedulingResult:
        """Choose engines for ``request`` among ``candidates`` (every engine the router knows, any state).

        ``now`` is the decision's monotonic time (defaults to time.monotonic()). Raises NoEndpointError.
        """
        state = CycleState(time.monotonic() if now is None else now, candidates)
        eligible = self._eligible(request, state, candidates)
        results: dict[str, ProfileResult] = {}
        while names := self.handler.pick(request, state, self._names, results):
            for name in names:
                if name in results or name not in self.profiles:
                    raise RuntimeError(
                        f"profile handler {self.handler.name!r} asked to run profile {name!r}, which "
                        + ("already ran" if name in results else "does not exist")
                    )
                results[name] = self.profiles[name].run(request, state, eligible)
        return self.handler.process_results(request, state, results)

    def _eligible(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> list[EngineState]:
        model = request.model
        if not candidates:
            raise NoEndpointError(NoEndpointReason.NO_ENGINES, model, "no engines are registered")
        serving = self._model_filter.filter(request, state, list(candidates))
        if not serving:
            known = sorted({m for e in candidates for m in e.endpoint.models})
            raise NoEndpointError(
                NoEndpointReason.MODEL_NOT_SERVED,
                model,
                f"no engine serves model {model!r}; models served: {', '.join(known) or 'none'}",
            )
        routable = self._health_filter.filter(request, state, serving)
        if not routable:
            why = "; ".join(f"{e.url} ({unroutable_reason(e)})" for e in serving[:_MAX_LISTED])
            if len(serving) > _MAX_LISTED:
                why += f"; and {len(serving) - _MAX_LISTED} more"
            raise NoEndpointError(
                NoEndpointReason.NO_ROUTABLE_ENGINE,
                model,
                f"no routable engine for model {model!r}: {why}",
            )
        return routable
