"""Reports of benchmark runs: a rich table, files in a directory, and side-by-side comparisons.

``write_report(result, out_dir)`` writes ``requests.csv`` (one row per request), ``summary.json`` (the
summary; unknown values are ``null``) and three PNGs: ``ttft_cdf.png``, ``ttft_over_time.png``,
``load_share.png``. ``load_result(out_dir)`` reads such a directory back (the per-request inter-token
gaps are not in the CSV, only their mean and max). ``compare(results, out_dir)`` puts several named runs
side by side: metrics as rows, runs as columns, TTFT ratios against a baseline run, and one TTFT CDF
with a line per run (``compare.json``, ``compare_ttft_cdf.png``).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstack.bench import plots
from kvstack.bench.records import BenchResult, RequestRecord

__all__ = ["compare", "load_result", "print_summary", "summary_table", "write_report"]

UNKNOWN = "unknown"
CSV_FIELDS = (
    "index",
    "session",
    "round",
    "group",
    "planned_s",
    "sent_s",
    "ttft_s",
    "e2e_s",
    "itl_mean_s",
    "itl_max_s",
    "content_chunks",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "status",
    "engine",
    "error",
)


def _ms(v: float | None) -> str:
    return UNKNOWN if v is None else f"{v * 1000:.1f} ms"


def _s(v: float | None) -> str:
    return UNKNOWN if v is None else f"{v:.3f} s"


def _pct(v: float | None) -> str:
    return UNKNOWN if v is None else f"{v * 100:.1f}%"


def _num(v: float | None, unit: str = "") -> str:
    return UNKNOWN if v is None else f"{v:,.2f}{unit}"


def _count(v: float | None) -> str:
    return UNKNOWN if v is None else f"{v:,.0f}"


def _dist(
    summary: Mapping[str, Any], key: str, fmt: Callable[[float | None], str], ps: tuple[int, ...]
) -> str:
    d = summary.get(key) or {}
    return " / ".join(fmt(d.get(f"p{p}")) for p in ps)


def _engine(summary: Mapping[str, Any], key: str) -> Any:
    engine = summary.get("engine")
    return engine.get(key) if engine else None


def summary_table(result: BenchResult, title: str | None = None) -> Table:
    """The run's summary as a two-column table."""
    s = result.summary
    workload = s.get("workload") or {}
    table = Table(title=title or f"kvstack bench: {workload.get('name', 'run')}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    params = ", ".join(f"{k}={v}" for k, v in workload.items() if k != "name")
    table.add_row("workload", f"{workload.get('name', '?')} ({params})")
    table.add_row(
        "requests",
        f"{s['requests_ok']} ok of {s['requests_sent']} sent, {s['errors']} errors in {s['elapsed_s']:.1f} s"
        + (f"; {s['not_sent']} planned but not sent before --duration" if s["not_sent"] else ""),
    )
    table.add_row("TTFT p50 / p90 / p99", _dist(s, "ttft_s", _ms, (50, 90, 99)))
    table.add_row("ITL p50 / p90 / p99", _dist(s, "itl_s", _ms, (50, 90, 99)))
    table.add_row("end-to-end p50 / p99", _dist(s, "e2e_s", _s, (50, 99)))
    table.add_row("send lag p50 / p99", _dist(s, "send_lag_s", _ms, (50, 99)))
    table.add_row(
        "throughput", f"{_num(s['request_throughput'], ' req/s')}, {_num(s['output_tokens_per_s'])} out tok/s"
    )
    table.add_row("client cached-token ratio", _pct(s["client_cached_ratio"]))
    engine = s.get("engine")
    if engine is None:
        table.add_row("engine prefix hit rate", f"{UNKNOWN} (no --engine-metrics)")
    else:
        table.add_row("engine prefix hit rate", _pct(engine["prefix_hit_rate"]))
        for e in engine["engines"]:
            table.add_row(
                f"  {e['url']}",
                f"load share {_pct(e['load_share'])}, hit rate {_pct(e['prefix_hit_rate'])}, "
                f"requests {_count(e['requests'])}",
            )
        table.add_row("load share max / mean", _num(engine["load_share_max_over_mean"]))
        for e in engine["engines"]:
            for note in e["notes"]:
                table.add_row("  note", note)
    if s.get("engine_header_counts"):
        table.add_row("engine header", ", ".join(f"{k}: {v}" for k, v in s["engine_header_counts"].items()))
    for message, count in (s.get("error_kinds") or {}).items():
        table.add_row(f"  error x{count}", message)
    return table


def print_summary(result: BenchResult, console: Console | None = None) -> None:
    """Print the summary table."""
    (console or Console()).print(summary_table(result))


def _csv_row(r: RequestRecord) -> dict[str, Any]:
    return {
        "index": r.index,
        "session": r.session,
        "round": r.round,
        "group": r.group,
        "planned_s": f"{r.planned_s:.6f}",
        "sent_s": f"{r.sent_s:.6f}",
        "ttft_s": None if r.ttft is None else f"{r.ttft:.6f}",
        "e2e_s": None if r.e2e is None else f"{r.e2e:.6f}",
        "itl_mean_s": f"{math.fsum(r.itl) / len(r.itl):.6f}" if r.itl else None,
        "itl_max_s": f"{max(r.itl):.6f}" if r.itl else None,
        "content_chunks": len(r.itl) + (r.ttft is not None),
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "status": r.status,
        "engine": r.engine,
        "error": r.error,
    }


def write_report(result: BenchResult, out_dir: str | Path) -> list[Path]:
    """Write requests.csv, summary.json and the PNG plots into ``out_dir`` (created); return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "requests.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(_csv_row(r) for r in result.records)
    json_path = out / "summary.json"
    json_path.write_text(json.dumps(result.summary, indent=2, allow_nan=False) + "\n")
    name = (result.summary.get("workload") or {}).get("name", "run")
    ttfts = [r.ttft for r in result.records if r.ok and r.ttft is not None]
    return [
        csv_path,
        json_path,
        plots.ttft_cdf(out / "ttft_cdf.png", {name: ttfts}),
        plots.ttft_over_time(out / "ttft_over_time.png", result.records),
        plots.load_share(
            out / "load_share.png",
            result.summary.get("engine"),
            result.summary.get("engine_header_counts") or {},
        ),
    ]


def _opt(text: str, kind: Callable[[str], Any]) -> Any:
    return kind(text) if text != "" else None


def load_result(out_dir: str | Path) -> BenchResult:
    """A report directory written by ``write_report``, read back (inter-token gaps are not restored)."""
    out = Path(out_dir)
    summary = json.loads((out / "summary.json").read_text())
    records: list[RequestRecord] = []
    with (out / "requests.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            records.append(
                RequestRecord(
                    index=int(row["index"]),
                    session=int(row["session"]),
                    round=int(row["round"]),
                    group=_opt(row["group"], int),
                    planned_s=float(row["planned_s"]),
                    sent_s=float(row["sent_s"]),
                    ttft=_opt(row["ttft_s"], float),
                    e2e=_opt(row["e2e_s"], float),
                    prompt_tokens=_opt(row["prompt_tokens"], int),
                    completion_tokens=_opt(row["completion_tokens"], int),
                    cached_tokens=_opt(row["cached_tokens"], int),
                    status=_opt(row["status"], int),
                    engine=row["engine"] or None,
                    error=row["error"] or None,
                )
            )
    return BenchResult(summary=summary, records=records)


def _p(key: str, p: int) -> Callable[[Mapping[str, Any]], float | None]:
    return lambda s: (s.get(key) or {}).get(f"p{p}")


# (row label, value of a summary, format)
_COMPARE_ROWS: tuple[tuple[str, Callable[[Mapping[str, Any]], Any], Callable[[Any], str]], ...] = (
    ("requests ok / sent", lambda s: f"{s['requests_ok']} / {s['requests_sent']}", str),
    ("errors", lambda s: s["errors"], str),
    ("TTFT p50", _p("ttft_s", 50), _ms),
    ("TTFT p90", _p("ttft_s", 90), _ms),
    ("TTFT p99", _p("ttft_s", 99), _ms),
    ("ITL p50", _p("itl_s", 50), _ms),
    ("ITL p99", _p("itl_s", 99), _ms),
    ("end-to-end p50", _p("e2e_s", 50), _s),
    ("end-to-end p99", _p("e2e_s", 99), _s),
    ("requests/s", lambda s: s["request_throughput"], _num),
    ("output tokens/s", lambda s: s["output_tokens_per_s"], _num),
    ("client cached-token ratio", lambda s: s["client_cached_ratio"], _pct),
    ("engine prefix hit rate", lambda s: _engine(s, "prefix_hit_rate"), _pct),
    ("load share max / mean", lambda s: _engine(s, "load_share_max_over_mean"), _num),
)


def _ratio(value: float | None, base: float | None) -> str:
    return UNKNOWN if value is None or not base else f"{value / base:.2f}x"


def compare(
    results: Mapping[str, BenchResult],
    out_dir: str | Path | None = None,
    *,
    baseline: str | None = None,
    console: Console | None = None,
) -> Table:
    """Print named runs side by side (and write compare.json + compare_ttft_cdf.png into ``out_dir``).

    ``baseline`` (default: the first name) is the run the TTFT ratio rows divide by.
    """
    if not results:
        raise ValueError("compare needs at least one named result")
    names = list(results)
    base = baseline if baseline is not None else names[0]
    if base not in results:
        raise ValueError(f"baseline {base!r} is not one of the compared runs: {', '.join(names)}")
    table = Table(title=f"kvstack bench comparison (ratios against {base})")
    table.add_column("metric", style="bold")
    for name in names:
        table.add_column(name, justify="right")
    summaries = {name: results[name].summary for name in names}
    for label, value, fmt in _COMPARE_ROWS:
        table.add_row(label, *(fmt(value(summaries[n])) for n in names))
    for p in (50, 99):
        get = _p("ttft_s", p)
        table.add_row(
            f"TTFT p{p} / {base}", *(_ratio(get(summaries[n]), get(summaries[base])) for n in names)
        )
    (console or Console()).print(table)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"baseline": base, "summaries": summaries}
        (out / "compare.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        series = {n: [r.ttft for r in results[n].records if r.ok and r.ttft is not None] for n in names}
        plots.ttft_cdf(out / "compare_ttft_cdf.png", series, title="TTFT CDF by run")
    return table
