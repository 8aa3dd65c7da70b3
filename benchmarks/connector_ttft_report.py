"""The connector_ttft tables: TTFT per stack and kind of request, and the QA runs; rich and markdown."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table


# -- output -----------------------------------------------------------------------------------------
def fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


KIND_LABEL = {
    "cold": "cold on B (never seen anywhere)",
    "tier": "tier on B (computed on A, loaded)",
    "own": "B's own prefix cache (same prompt again)",
    "cold-A": "cold on A (the tier prompts, saved)",
}


def ttft_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for stack in ("kvstack", "lmcache"):
        if stack not in report or "summary" not in report[stack]:
            continue
        s = report[stack]["summary"]
        for kind, label in KIND_LABEL.items():
            k = s["kinds"][kind]
            rows.append(
                [
                    stack,
                    label,
                    str(k["n"]),
                    fmt(k["ttft_median_s"]),
                    f"{fmt(k['ttft_min_s'])}-{fmt(k['ttft_max_s'])}",
                    fmt(k["server_ttft_median_s"]),
                    f"{fmt(k['computed_tokens_median'], 0)} / {fmt(k['external_tokens_median'], 0)} / "
                    f"{fmt(k['local_hit_tokens_median'], 0)}",
                    f"{k['verified']}/{k['n']}",
                    f"{fmt(k['machine_busy_pct_median'], 0)} ({fmt(k['engine_cpu_pct_median'], 0)})",
                ]
            )
    return rows


TTFT_COLUMNS = (
    "stack",
    "request",
    "n",
    "TTFT median s",
    "min-max s",
    "server TTFT s",
    "computed / external / local tokens",
    "verified",
    "busy % (engine)",
)
QA_COLUMNS = (
    "run",
    "requests ok",
    "TTFT p50 s",
    "TTFT p90 s",
    "round 0 p50 s",
    "later rounds p50 s",
    "engine hit (local + tier)",
    "local",
    "tier",
    "preemptions",
    "busy % (this run)",
)


def qa_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for run in report.get("qa", {}).get("runs", []):
        s = run.get("summary")
        if not s:
            continue
        hit = None if s["computed_share"] is None else 1 - s["computed_share"]
        m = run.get("machine", {})
        rows.append(
            [
                run["label"],
                f"{s['ok']}/{s['requests']}",
                fmt(s["ttft_p50_s"]),
                fmt(s["ttft_p90_s"]),
                fmt(s["round0_ttft_p50_s"]),
                fmt(s["later_ttft_p50_s"]),
                _pct(hit),
                _pct(s["local_hit_share"]),
                _pct(s["external_share"]),
                fmt(s["preemptions"], 0),
                f"{fmt(m.get('machine_busy_pct'), 0)} ({fmt(m.get('this_run_pct'), 0)})",
            ]
        )
    return rows


def rich_table(title: str, columns: Sequence[str], rows: list[list[str]]) -> Table:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c in ("stack", "request", "run") else "right")
    for row in rows:
        table.add_row(*row)
    return table


def markdown_table(columns: Sequence[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
