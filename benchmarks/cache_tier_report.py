"""The cache tier's results: rows judged against ceilings measured in the same run, tables and markdown.

A `Row` is one measurement, with its ceiling and ratio when it has one and PASS/FAIL when it is judged
against a target (``ratio_row``); a `Ceiling` is one of this machine's own limits (memcpy, dd,
redis-benchmark). ``verdicts`` sums the rows up per target of `TARGETS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

TARGETS = {
    "memory": "memory tier put/get >= 80% of memcpy (1-32 MiB chunks)",
    "server": "server over shared memory >= 50% of memcpy",
    "lookup": "lookup of a 128-chunk prompt: p99 < 1 ms",
    "disk": "disk tier >= 70% of sequential dd",
    "redis": "Redis tier >= 70% of redis-benchmark GET/SET",
}


# -- results ----------------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the results table; ``verdict`` is PASS/FAIL when judged against a target, else info."""

    target: str
    what: str
    size: str
    result: str
    ceiling: str = "-"
    ratio: float | None = None
    needed: str = "-"
    verdict: str = "info"
    data: dict[str, Any] = field(default_factory=dict)


def ratio_row(
    target: str,
    what: str,
    size: str,
    value: float,
    unit: str,
    ceiling_name: str,
    ceiling: float | None,
    needed: float | None,
    data: dict[str, Any] | None = None,
) -> Row:
    """A row comparing ``value`` with ``ceiling`` (same unit); judged when ``needed`` is a ratio."""
    ratio = None if not ceiling else value / ceiling
    verdict = "info" if needed is None else ("FAIL" if ratio is None or ratio < needed else "PASS")
    return Row(
        target,
        what,
        size,
        f"{value:,.{2 if value < 100 else 0}f} {unit}",
        "-" if ceiling is None else f"{ceiling_name} {ceiling:,.{2 if ceiling < 100 else 0}f}",
        ratio,
        "-" if needed is None else f">= {needed:.2f}",
        verdict,
        {"value": value, "unit": unit, "ceiling_name": ceiling_name, "ceiling": ceiling, **(data or {})},
    )


@dataclass
class Ceiling:
    name: str
    size: str
    value: float
    unit: str
    how: str
    samples: list[float] = field(default_factory=list)


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    ceilings: list[Ceiling] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


# -- output ---------------------------------------------------------------------------------------------
def ceilings_table(ceilings: list[Ceiling]) -> Table:
    table = Table(title="Ceilings measured in this run")
    for column in ("ceiling", "size", "value", "how"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for c in ceilings:
        table.add_row(c.name, c.size, f"{c.value:,.2f} {c.unit}", c.how)
    return table


def results_table(rows: list[Row]) -> Table:
    table = Table(title="KV cache tier against this machine's ceilings")
    for c in ("target", "measurement", "size", "result", "ceiling", "ratio", "needed", "verdict"):
        table.add_column(c, justify="right" if c in ("result", "ceiling", "ratio") else "left")
    style = {"PASS": "[green]PASS[/]", "FAIL": "[red]FAIL[/]", "info": "[dim]info[/]"}
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        table.add_row(r.target, r.what, r.size, r.result, r.ceiling, ratio, r.needed, style[r.verdict])
    return table


def verdicts(report: Report, ran: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for target, text in TARGETS.items():
        judged = [r for r in report.rows if r.target == target and r.verdict != "info"]
        failed = [f"{r.what} {r.size}" for r in judged if r.verdict == "FAIL"]
        if target in report.errors:
            verdict = "ERROR"
        elif not judged:
            verdict = "not run" if target not in ran else "no result"
        else:
            verdict = "FAIL" if failed else "PASS"
        out[target] = {"target": text, "verdict": verdict, "rows": len(judged), "failed": failed}
    return out


def markdown(report: Report) -> str:
    """The results as markdown tables (for docs/benchmarks/cache-tier.md)."""
    lines = ["| ceiling | size | value | how |", "|---|--:|--:|---|"]
    lines += [f"| {c.name} | {c.size} | {c.value:,.2f} {c.unit} | {c.how} |" for c in report.ceilings]
    lines += ["", "| target | measurement | size | result | ceiling | ratio | needed | verdict |"]
    lines += ["|---|---|--:|--:|--:|--:|---|---|"]
    for r in report.rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        verdict = f"**{r.verdict}**" if r.verdict == "FAIL" else r.verdict
        cells = (r.target, r.what, r.size, r.result, r.ceiling, ratio, r.needed, verdict)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
