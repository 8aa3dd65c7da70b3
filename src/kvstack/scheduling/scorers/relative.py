"""Min-max scoring of a load value where lower is better, shared by the queue, running, active-requests
and least-QPS scorers.

score = (max - v) / (max - min) over the candidates whose value is known; 1 for all of them when they are
equal; 0 for a candidate whose value is unknown, so unknown load ranks with the worst, never with the idle.
Cost: two passes over the candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstack.engines.state import EngineState


def lower_is_better(
    candidates: Sequence[EngineState], value: Callable[[EngineState], float | None]
) -> dict[str, float]:
    values = [(e.url, value(e)) for e in candidates]
    known = [v for _, v in values if v is not None]
    if not known:
        return dict.fromkeys((url for url, _ in values), 0.0)
    lo, hi = min(known), max(known)
    span = hi - lo
    return {url: 0.0 if v is None else 1.0 if span <= 0 else (hi - v) / span for url, v in values}
