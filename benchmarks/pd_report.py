"""The P/D benchmark's results: one row per setup, P/D / colocated ratios, tables, markdown and two plots.

Every time is modelled (client wall time multiplied by the sims' time scale), so numbers read as a real
engine with the latency model would show them; throughputs are per modelled second likewise. ``row_of``
splits a setup's requests into long prompts and short chats (the turn's group): TTFT p50/p99 of each,
inter-token latency (ITL, the gaps between streamed content chunks) p50/p99 of all and of long requests,
end-to-end time of long requests (p50),
the share of gaps of ``SLOW_GAP_S`` or more (a decode step that carried a prefill chunk) as the client saw
it and as the engines' own histograms counted it (with their p99 bucket), the share of gaps of 0 (two chunks
read at once: the client or router fell behind), throughput, and the router's prefills and fallbacks.
``ratios`` divides each P/D setup's values by the colocated setup's at the same load.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pd_run import SLOW_GAP_S, Settings
from pd_workload import KIND, LONG, SHORT
from results import ratio
from rich.table import Table

from kvstack.bench import BenchResult
from kvstack.bench.summary import percentile

COLOCATED = "colocated"


def _gaps(result: BenchResult, group: int | None = None) -> list[float]:
    ok = [r for r in result.records if r.ok and (group is None or r.group == group)]
    return list(itertools.chain.from_iterable(r.itl for r in ok))


def _ttfts(result: BenchResult, group: int) -> list[float]:
    return [r.ttft for r in result.records if r.ok and r.group == group and r.ttft is not None]


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def row_of(info: dict[str, Any], result: BenchResult | None, s: Settings) -> dict[str, Any]:
    """A setup's numbers (modelled seconds, per modelled second)."""
    row: dict[str, Any] = {"setup": info["name"], "load": info["load"], "failure": info.get("failure")}
    if result is None:
        return row
    k = s.time_scale
    summary = result.summary
    for group in (LONG, SHORT):
        ttfts = _ttfts(result, group)
        row[f"ttft_{KIND[group]}_p50"] = _scaled(percentile(ttfts, 50), k)
        row[f"ttft_{KIND[group]}_p99"] = _scaled(percentile(ttfts, 99), k)
        row[f"{KIND[group]}_ok"] = len(ttfts)
    gaps, long_gaps = _gaps(result), _gaps(result, LONG)
    row.update(
        itl_p50=_scaled(percentile(gaps, 50), k),
        itl_p99=_scaled(percentile(gaps, 99), k),
        itl_long_p99=_scaled(percentile(long_gaps, 99), k),
        slow_gaps=sum(g * k >= SLOW_GAP_S for g in gaps) / len(gaps) if gaps else None,
        zero_gaps=sum(g == 0 for g in gaps) / len(gaps) if gaps else None,
        e2e_long_p50=_scaled(
            percentile([r.e2e for r in result.records if r.ok and r.group == LONG and r.e2e], 50), k
        ),
        ok=summary["requests_ok"],
        sent=summary["requests_sent"],
        errors=summary["errors"],
        req_per_s=_scaled_rate(summary["request_throughput"], k),
        out_tok_per_s=_scaled_rate(summary["output_tokens_per_s"], k),
        machine_busy_pct=info.get("machine_busy_pct"),
        cpu_s=info.get("cpu_s"),
    )
    counters = info.get("engine_counters") or {}
    decoding = [c for c in counters.values() if c["role"] != "prefill"]
    buckets: dict[float, float] = {}
    for c in decoding:
        for le, n in c["itl_buckets"].items():
            buckets[le] = buckets.get(le, 0.0) + n
    count = sum(c["itl_count"] for c in decoding)
    row["engine_slow_gaps"] = 1 - buckets.get(SLOW_GAP_S, 0.0) / count if count else None
    row["engine_itl_p99_le"] = bucket_bound(buckets, count, 0.99)
    computed = sum(c["prompt_computed"] for c in counters.values())
    on_prefill = sum(c["prompt_computed"] for c in counters.values() if c["role"] == "prefill")
    row["prefill_engine_compute_share"] = on_prefill / computed if computed else None
    pd = info.get("router_pd") or {}
    prefills = pd.get("prefills") or {}
    row["prefills_ok"] = prefills.get("ok", 0.0)
    row["prefills_failed"] = sum(v for o, v in prefills.items() if o != "ok")
    row["fallbacks"] = sum((pd.get("fallbacks") or {}).values())
    row["fallback_reasons"] = {r: v for r, v in (pd.get("fallbacks") or {}).items() if v}
    n = pd.get("prefill_seconds_count")
    row["prefill_mean_s"] = pd["prefill_seconds_sum"] / n * k if n else None
    return row


def bucket_bound(buckets: dict[float, float], count: float, q: float) -> float | None:
    """The smallest histogram bucket bound that at least ``q`` of ``count`` observations are under."""
    if not count:
        return None
    return next((le for le in sorted(buckets) if buckets[le] >= q * count), None)


def _scaled_rate(value: float | None, scale: float) -> float | None:
    return None if value is None else value / scale


RATIO_KEYS = (
    "ttft_long_p50",
    "ttft_long_p99",
    "ttft_short_p50",
    "ttft_short_p99",
    "itl_p50",
    "itl_p99",
    "itl_long_p99",
    "e2e_long_p50",
    "slow_gaps",
    "engine_slow_gaps",
    "out_tok_per_s",
    "req_per_s",
)


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each P/D row divided by the colocated row at the same load."""
    base = {r["load"]: r for r in rows if r["setup"].split(" @")[0] == COLOCATED and not r.get("failure")}
    out = []
    for r in rows:
        b = base.get(r["load"])
        if b is None or r is b or r.get("failure"):
            continue
        out.append(
            {"setup": r["setup"], "against": b["setup"]} | {k: ratio(r.get(k), b.get(k)) for k in RATIO_KEYS}
        )
    return out


# -- formatting ------------------------------------------------------------------------------------
def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _fallbacks(r: dict[str, Any]) -> str:
    reasons = ", ".join(f"{k} {v:.0f}" for k, v in r.get("fallback_reasons", {}).items())
    return f"{r.get('fallbacks', 0):.0f}" + (f" ({reasons})" if reasons else "")


# (header, value of a row)
COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("setup", lambda r: r["setup"]),
    ("TTFT long p50", lambda r: ms(r.get("ttft_long_p50"))),
    ("TTFT long p99", lambda r: ms(r.get("ttft_long_p99"))),
    ("TTFT short p50", lambda r: ms(r.get("ttft_short_p50"))),
    ("TTFT short p99", lambda r: ms(r.get("ttft_short_p99"))),
    ("ITL p50", lambda r: ms(r.get("itl_p50"))),
    ("ITL p99", lambda r: ms(r.get("itl_p99"))),
    ("ITL long p99", lambda r: ms(r.get("itl_long_p99"))),
    ("e2e long p50", lambda r: ms(r.get("e2e_long_p50"))),
    (
        "engine ITL p99",
        lambda r: "-" if r.get("engine_itl_p99_le") is None else f"≤ {ms(r['engine_itl_p99_le'])}",
    ),
    (
        f"gaps ≥{SLOW_GAP_S * 1000:.0f} ms client / engine",
        lambda r: f"{pct(r.get('slow_gaps'))} / {pct(r.get('engine_slow_gaps'))}",
    ),
    ("coalesced gaps", lambda r: pct(r.get("zero_gaps"))),
    ("out tok/s", lambda r: num(r.get("out_tok_per_s"))),
    ("req/s", lambda r: x(r.get("req_per_s"))),
    ("ok/sent", lambda r: f"{r.get('ok', '-')}/{r.get('sent', '-')}"),
    ("prefills ok", lambda r: f"{r.get('prefills_ok', 0):.0f}"),
    ("fallbacks", _fallbacks),
    ("prefill mean ms", lambda r: ms(r.get("prefill_mean_s"))),
    (
        "prompt compute on P",
        lambda r: pct(r.get("prefill_engine_compute_share")) if r.get("prefills_ok") else "-",
    ),
    ("machine busy", lambda r: "-" if r.get("machine_busy_pct") is None else f"{r['machine_busy_pct']:.0f}%"),
)
RATIO_COLUMNS: tuple[tuple[str, str], ...] = (
    ("TTFT long p50", "ttft_long_p50"),
    ("TTFT long p99", "ttft_long_p99"),
    ("TTFT short p50", "ttft_short_p50"),
    ("TTFT short p99", "ttft_short_p99"),
    ("ITL p50", "itl_p50"),
    ("ITL p99", "itl_p99"),
    ("ITL long p99", "itl_long_p99"),
    ("e2e long p50", "e2e_long_p50"),
    ("gaps ≥100 ms (engine)", "engine_slow_gaps"),
    ("out tok/s", "out_tok_per_s"),
    ("req/s", "req_per_s"),
)


def rich_tables(
    rows: Sequence[dict[str, Any]], ratio_rows: Sequence[dict[str, Any]], title: str
) -> list[Table]:
    table = Table(title=title)
    for header, _ in COLUMNS:
        table.add_column(header, justify="left" if header == "setup" else "right")
    for r in rows:
        if r.get("failure"):
            table.add_row(r["setup"], f"[red]{r['failure'][:80]}[/]", *[""] * (len(COLUMNS) - 2))
        else:
            table.add_row(*(value(r) for _, value in COLUMNS))
    against = Table(title="P/D / colocated at the same load")
    against.add_column("setup")
    for header, _ in RATIO_COLUMNS:
        against.add_column(header, justify="right")
    for r in ratio_rows:
        against.add_row(f"{r['setup']} / {r['against']}", *(x(r[key]) for _, key in RATIO_COLUMNS))
    return [table, against]


def markdown(rows: Sequence[dict[str, Any]], ratio_rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|---" + "|--:" * (len(COLUMNS) - 1) + "|"]
    for r in rows:
        cells = [r["setup"], f"failed: {r['failure']}"] if r.get("failure") else [v(r) for _, v in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| P/D / colocated | " + " | ".join(h for h, _ in RATIO_COLUMNS) + " |"]
    lines.append("|---" + "|--:" * len(RATIO_COLUMNS) + "|")
    for r in ratio_rows:
        cells = [f"{r['setup']} / {r['against']}", *(x(r[key]) for _, key in RATIO_COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- plots -------------------------------------------------------------------------------------------
def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def ttft_cdf_png(path: Path, results: dict[str, BenchResult], scale: float) -> Path:
    """TTFT CDFs, long prompts left and short chats right, a line per setup (modelled ms, log x)."""
    fig = _figure(11, 4)
    for i, group in enumerate((LONG, SHORT)):
        ax = fig.add_subplot(1, 2, i + 1)
        for name, result in results.items():
            values = sorted(v * scale * 1000 for v in _ttfts(result, group))
            if values:
                ax.step(values, [(j + 1) / len(values) for j in range(len(values))], where="post", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, modelled)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT, {KIND[group]} {'prompts' if group == LONG else 'chats'}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def itl_ccdf_png(path: Path, results: dict[str, BenchResult], scale: float) -> Path:
    """Share of inter-token gaps longer than x, a line per setup (modelled ms; log y shows the tail)."""
    fig = _figure(7, 4.2)
    ax = fig.add_subplot()
    for name, result in results.items():
        values = sorted(v * scale * 1000 for v in _gaps(result))
        n = len(values)
        if n:
            ax.step(values, [1 - (j + 1) / n for j in range(n)], where="post", label=f"{name} ({n:,} gaps)")
    ax.axhline(0.01, color="gray", linestyle=":", label="p99")
    ax.set_yscale("log")
    ax.set_ylim(1e-4, 1.05)
    ax.set_xlabel("inter-token gap (ms, modelled)")
    ax.set_ylabel("fraction of gaps longer")
    ax.set_title("Inter-token latency tail: a decode step that carried a prefill chunk")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    fig.savefig(path, dpi=100)
    return path
