"""Summary statistics of a run's records. Pure; no I/O.

Percentiles interpolate linearly between the two nearest ranks (numpy's default): p50 of 1..100 is 50.5.
TTFT and end-to-end latency count successful requests only; ITL pools the gaps of every successful
request. Throughputs divide by ``elapsed_s``, the time from the run's start to its last response. A value
that cannot be known (no successful request, no usage reported, no engine metrics) is None, shown as
"unknown", never 0.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from kvstack.bench.records import RequestRecord

__all__ = ["distribution", "percentile", "summarize"]

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (0..100) of ``values``, sorted or not; None when empty."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within 0..100, got {p}")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean and p50/p90/p99 of ``values``."""
    ordered = sorted(values)
    out: dict[str, float | int | None] = {"count": len(ordered)}
    out["mean"] = math.fsum(ordered) / len(ordered) if ordered else None
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ordered, p)
    return out


def _sum_known(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def summarize(
    records: Sequence[RequestRecord],
    *,
    elapsed_s: float,
    not_sent: int = 0,
    engine: dict[str, Any] | None = None,
    workload: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary dict of a run (written as summary.json)."""
    ok = [r for r in records if r.ok]
    prompt = _sum_known(r.prompt_tokens for r in ok)
    completion = _sum_known(r.completion_tokens for r in ok)
    with_cached = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = _sum_known(r.cached_tokens for r in with_cached)
    cached_prompt = _sum_known(r.prompt_tokens for r in with_cached)
    errors = Counter((r.error or "")[:160] for r in records if not r.ok)
    headers = Counter(r.engine for r in records if r.engine is not None)
    return {
        "workload": workload,
        "config": config,
        "elapsed_s": elapsed_s,
        "requests_sent": len(records),
        "requests_ok": len(ok),
        "errors": len(records) - len(ok),
        "not_sent": not_sent,
        "ttft_s": distribution(r.ttft for r in ok if r.ttft is not None),
        "itl_s": distribution(itertools.chain.from_iterable(r.itl for r in ok)),
        "e2e_s": distribution(r.e2e for r in ok if r.e2e is not None),
        "send_lag_s": distribution(r.sent_s - r.planned_s for r in records),
        "request_throughput": len(ok) / elapsed_s if elapsed_s > 0 else None,
        "output_tokens_per_s": completion / elapsed_s if completion is not None and elapsed_s > 0 else None,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "client_cached_ratio": cached / cached_prompt if cached is not None and cached_prompt else None,
        "engine": engine,
        "engine_header_counts": dict(sorted(headers.items())),
        "error_kinds": dict(errors.most_common(5)),
    }
