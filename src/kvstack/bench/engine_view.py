"""The engines' own view of a run: counters read from each engine's /metrics before and after it.

- Prefix-cache queries and hits (tokens) come through kvstack's metric catalog (``read_signals``), so an
  engine exporting only the pre-0.10 names (``vllm:gpu_prefix_cache_*``) is read through its aliases and
  the substitution is noted.
- Finished requests are ``vllm:request_success_total`` summed over its ``finished_reason`` (and
  ``model_name``, ``engine``) labels; the catalogs carry no request counter, so it is parsed here.
- Engine-side prefix hit rate = Δhits / Δqueries, per engine and summed over engines; load share of an
  engine = its Δrequests / Δrequests of all engines; imbalance = max share / mean share (1.0 = even).

Unknown is never zero: a counter the engine does not export, a /metrics that could not be read, or a
counter that went backwards (the engine restarted during the run) makes that value None, and a total
over engines is None when any engine's part is; the reason is in the engine's ``notes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvstack.engines.catalog import MetricCatalog
from kvstack.engines.metrics_reader import MetricsParseError, read_signals

__all__ = ["EngineCounters", "engine_view", "fetch_counters", "metrics_url", "read_counters"]

# Engine type → the counter of finished requests (the catalogs have no such signal).
REQUEST_COUNTERS: dict[str, str] = {"vllm": "vllm:request_success"}
_PREFIX_SIGNALS = frozenset({"prefix_cache_queries", "prefix_cache_hits"})


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Cumulative counters of one engine at one moment; None = unknown."""

    url: str
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    requests: float | None = None
    notes: tuple[str, ...] = ()


def metrics_url(url: str) -> str:
    """An engine's base URL (or its /metrics URL) → its /metrics URL."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else f"{url}/metrics"


def read_counters(url: str, text: str, catalog: MetricCatalog) -> EngineCounters:
    """Counters from a /metrics body ``text`` of the engine at ``url``."""
    try:
        reading = read_signals(text, catalog)
    except MetricsParseError as exc:
        return EngineCounters(url, notes=(f"engine {url}: unreadable /metrics ({exc})",))
    notes = [
        gap.message(url, catalog.engine_type) for gap in reading.gaps if _PREFIX_SIGNALS & set(gap.signals)
    ]
    requests, note = _request_count(url, text, catalog.engine_type)
    if note:
        notes.append(note)
    return EngineCounters(
        url,
        prefix_queries=reading.signals.prefix_cache_queries,
        prefix_hits=reading.signals.prefix_cache_hits,
        requests=requests,
        notes=tuple(notes),
    )


def _request_count(url: str, text: str, engine_type: str) -> tuple[float | None, str | None]:
    name = REQUEST_COUNTERS.get(engine_type)
    if name is None:
        return None, f"engine {url}: no finished-request counter known for engine type {engine_type}"
    wanted = {f"{name}_total", name}  # an exporter may omit the _total suffix; never the _created series
    lines = "".join(line + "\n" for line in text.split("\n") if line.startswith(name))
    try:
        samples = [
            s for fam in text_string_to_metric_families(lines) for s in fam.samples if s.name in wanted
        ]
    except Exception as exc:  # the parser reports bad input as ValueError, IndexError, ... alike
        return None, f"engine {url}: unreadable {name}_total ({exc or type(exc).__name__})"
    if not samples:
        return None, f"engine {url} exports no {name}_total; load share unknown"
    return sum(s.value for s in samples), None


async def fetch_counters(
    http: aiohttp.ClientSession, url: str, catalog: MetricCatalog, *, limit_s: float = 10.0
) -> EngineCounters:
    """Read the engine's /metrics now; a failure gives unknown counters with the reason, never an error."""
    try:
        async with http.get(metrics_url(url), timeout=aiohttp.ClientTimeout(total=limit_s)) as resp:
            body = await resp.text(errors="replace")
            if resp.status != 200:
                return EngineCounters(url, notes=(f"engine {url}: GET /metrics answered {resp.status}",))
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return EngineCounters(
            url, notes=(f"engine {url}: GET /metrics failed ({exc or type(exc).__name__})",)
        )
    return read_counters(url, body, catalog)


def _delta(before: float | None, after: float | None) -> float | None:
    if before is None or after is None or after < before:
        return None
    return after - before


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _total(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else sum(v for v in values if v is not None)


def engine_view(before: list[EngineCounters], after: list[EngineCounters]) -> dict[str, Any]:
    """Per-engine and total deltas, hit rates and load shares between two readings of the same engines."""
    engines: list[dict[str, Any]] = []
    for b, a in zip(before, after, strict=True):
        notes = list(dict.fromkeys((*b.notes, *a.notes)))
        for field, label in (
            ("prefix_queries", "prefix-cache queries"),
            ("prefix_hits", "prefix-cache hits"),
            ("requests", "finished requests"),
        ):
            vb, va = getattr(b, field), getattr(a, field)
            if vb is not None and va is not None and va < vb:
                notes.append(f"engine {a.url}: {label} went backwards (restarted during the run?); unknown")
        queries, hits = _delta(b.prefix_queries, a.prefix_queries), _delta(b.prefix_hits, a.prefix_hits)
        engines.append(
            {
                "url": a.url,
                "prefix_queries": queries,
                "prefix_hits": hits,
                "prefix_hit_rate": _ratio(hits, queries),
                "requests": _delta(b.requests, a.requests),
                "load_share": None,
                "notes": notes,
            }
        )
    total_requests = _total([e["requests"] for e in engines])
    shares: list[float] = []
    if total_requests:
        for e in engines:
            e["load_share"] = e["requests"] / total_requests
            shares.append(e["load_share"])
    queries = _total([e["prefix_queries"] for e in engines])
    hits = _total([e["prefix_hits"] for e in engines])
    return {
        "prefix_queries": queries,
        "prefix_hits": hits,
        "prefix_hit_rate": _ratio(hits, queries),
        "requests": total_requests,
        "load_share_max_over_mean": max(shares) * len(shares) if shares else None,
        "engines": engines,
    }
