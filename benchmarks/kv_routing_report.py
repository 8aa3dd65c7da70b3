"""The KV-aware routing results: one row per router, the targets as PASS/FAIL, tables, markdown and a chart.

``row_of`` reads a router's bench summary (engine-side hit rate, TTFT, load shares, preemptions);
``evaluate`` checks a kv-aware router against the oracle (hit rate >= 0.95 x), round-robin (TTFT p50 <=
0.5 x), each Rust router's ``cache_aware`` (hit rate >= 1.2 x, TTFT p90 below) and its own balance (max
engine share <= 1.3 x mean); ``evaluate_envoy`` checks Envoy's kv-aware against the proxy's (hit rate >=
0.97 x) and round-robin (TTFT p50 <= 0.5 x).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from peers import PEER_VERSIONS
from results import ratio
from rich.table import Table

from kvstack.bench import BenchResult

BASELINE = "kvstack round-robin"


# -- summary and targets --------------------------------------------------------------------------
def row_of(info: dict[str, Any], result: BenchResult | None) -> dict[str, Any]:
    row: dict[str, Any] = {"router": info["name"], "failure": info.get("failure")}
    if result is None:
        return row
    s = result.summary
    engine = s.get("engine") or {}
    shares = [e["load_share"] for e in engine.get("engines", [])]
    row.update(
        hit_rate=engine.get("prefix_hit_rate"),
        ttft_p50=s["ttft_s"]["p50"],
        ttft_p90=s["ttft_s"]["p90"],
        ttft_p99=s["ttft_s"]["p99"],
        itl_p50=s["itl_s"]["p50"],
        req_per_s=s["request_throughput"],
        out_tok_per_s=s["output_tokens_per_s"],
        ok=s["requests_ok"],
        sent=s["requests_sent"],
        errors=s["errors"],
        max_over_mean=engine.get("load_share_max_over_mean"),
        shares=shares,
        engine_hit_rates=[e["prefix_hit_rate"] for e in engine.get("engines", [])],
        preemptions=sum(e["preemptions"] or 0 for e in info.get("engine_extras", [])),
        machine_busy_pct=info.get("machine_busy_pct"),
        **{k: info["requests"][k] for k in ("later_cached_ratio", "same_engine_as_previous_round")},
    )
    return row


def evaluate(rows: dict[str, dict[str, Any]], subject: str, oracle: str) -> list[dict[str, Any]]:
    """The issue's targets for ``subject`` (a kv-aware router) against the rows present."""
    kv = rows.get(subject, {})
    checks: list[dict[str, Any]] = []

    def check(name: str, value: float | None, ok: Callable[[float], bool], detail: str) -> None:
        checks.append(_check(name, value, ok, detail))

    orc, rr = rows.get(oracle, {}), rows.get(BASELINE, {})
    check(
        "hit rate >= 0.95 x oracle's",
        ratio(kv.get("hit_rate"), orc.get("hit_rate")),
        lambda v: v >= 0.95,
        f"{pct(kv.get('hit_rate'))} vs {pct(orc.get('hit_rate'))} ({oracle})",
    )
    check(
        "TTFT p50 <= 0.5 x round-robin's",
        ratio(kv.get("ttft_p50"), rr.get("ttft_p50")),
        lambda v: v <= 0.5,
        f"{ms(kv.get('ttft_p50'))} vs {ms(rr.get('ttft_p50'))}",
    )
    for kind in PEER_VERSIONS:
        peer = next((n for n in rows if n.split(" [")[0] == kind), kind)
        p = rows.get(peer, {})
        check(
            f"hit rate >= 1.2 x {peer}'s",
            ratio(kv.get("hit_rate"), p.get("hit_rate")),
            lambda v: v >= 1.2,
            f"{pct(kv.get('hit_rate'))} vs {pct(p.get('hit_rate'))}",
        )
        check(
            f"TTFT p90 below {peer}'s",
            ratio(kv.get("ttft_p90"), p.get("ttft_p90")),
            lambda v: v < 1.0,
            f"{ms(kv.get('ttft_p90'))} vs {ms(p.get('ttft_p90'))}",
        )
    check(
        "max engine share <= 1.3 x mean",
        kv.get("max_over_mean"),
        lambda v: v <= 1.3,
        "shares " + ", ".join(pct(x) for x in kv.get("shares") or []),
    )
    return checks


def evaluate_envoy(rows: dict[str, dict[str, Any]], subject: str, proxy: str) -> list[dict[str, Any]]:
    """Whether kv-aware routing through Envoy and the picker (``subject``) reaches the proxy's (``proxy``)."""
    envoy, kv, rr = rows.get(subject, {}), rows.get(proxy, {}), rows.get(BASELINE, {})
    return [
        _check(
            f"hit rate >= 0.97 x {proxy}'s",
            ratio(envoy.get("hit_rate"), kv.get("hit_rate")),
            lambda v: v >= 0.97,
            f"{pct(envoy.get('hit_rate'))} vs {pct(kv.get('hit_rate'))}",
        ),
        _check(
            "TTFT p50 <= 0.5 x round-robin's",
            ratio(envoy.get("ttft_p50"), rr.get("ttft_p50")),
            lambda v: v <= 0.5,
            f"{ms(envoy.get('ttft_p50'))} vs {ms(rr.get('ttft_p50'))}",
        ),
    ]


def _check(name: str, value: float | None, ok: Callable[[float], bool], detail: str) -> dict[str, Any]:
    return {"target": name, "value": value, "pass": None if value is None else ok(value), "detail": detail}


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


COLUMNS = (
    "router",
    "hit rate",
    "later rounds cached",
    "same engine as prev. round",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "req/s",
    "out tok/s",
    "ok/sent",
    "max/mean share",
    "engine shares",
    "engine hit rates",
    "preemptions",
)


def table_cells(row: dict[str, Any]) -> list[str]:
    if row.get("failure") and "hit_rate" not in row:
        return [row["router"], f"failed: {row['failure'][:60]}", *["-"] * (len(COLUMNS) - 2)]
    return [
        row["router"],
        pct(row["hit_rate"]),
        pct(row["later_cached_ratio"]),
        pct(row["same_engine_as_previous_round"]),
        ms(row["ttft_p50"]),
        ms(row["ttft_p90"]),
        ms(row["ttft_p99"]),
        _num(None if row["itl_p50"] is None else 1000 * row["itl_p50"], 1),
        _num(row["req_per_s"]),
        _num(row["out_tok_per_s"], 0),
        f"{row['ok']}/{row['sent']}" + (f" ({row['errors']} err)" if row["errors"] else ""),
        _num(row["max_over_mean"]),
        " ".join("-" if x is None else f"{100 * x:.0f}" for x in row["shares"]),
        " ".join("-" if x is None else f"{100 * x:.0f}" for x in row["engine_hit_rates"]),
        str(row["preemptions"]),
    ]


def rich_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for c in COLUMNS:
        table.add_column(c, justify="left" if c == "router" else "right")
    for row in rows:
        table.add_row(*table_cells(row))
    return table


def markdown(rows: list[dict[str, Any]], verdicts: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" + "|--:" * (len(COLUMNS) - 1) + "|"]
    lines += ["| " + " | ".join(table_cells(row)) + " |" for row in rows]
    for subject, checks in verdicts.items():
        lines += ["", f"Targets for `{subject}`:", ""]
        lines += [f"- {verdict_line(c)}" for c in checks]
    return "\n".join(lines) + "\n"


def verdict_line(c: dict[str, Any]) -> str:
    state = {True: "PASS", False: "FAIL", None: "n/a"}[c["pass"]]
    value = "-" if c["value"] is None else f"{c['value']:.2f}"
    return f"**{state}** {c['target']}: {value} ({c['detail']})"


def summary_png(path: Path, rows: list[dict[str, Any]]) -> Path | None:
    """Hit rate, TTFT p50/p90 and max/mean share per router, side by side."""
    rows = [r for r in rows if r.get("hit_rate") is not None]
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4), layout="constrained")
    FigureCanvasAgg(fig)
    names = [r["router"].replace(" [", "\n[") for r in rows]
    x = range(len(rows))
    ax = fig.add_subplot(1, 3, 1)
    ax.bar(x, [100 * r["hit_rate"] for r in rows])
    ax.set_title("engine prefix-cache hit rate (%)")
    ax.set_xticks(x, names, fontsize="x-small", rotation=30, ha="right")
    ax = fig.add_subplot(1, 3, 2)
    ax.bar([i - 0.2 for i in x], [1000 * (r["ttft_p50"] or 0) for r in rows], width=0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [1000 * (r["ttft_p90"] or 0) for r in rows], width=0.4, label="p90")
    ax.set_yscale("log")
    ax.set_title("TTFT (ms, log scale)")
    ax.legend(fontsize="small")
    ax.set_xticks(x, names, fontsize="x-small", rotation=30, ha="right")
    ax = fig.add_subplot(1, 3, 3)
    ax.bar(x, [r["max_over_mean"] or 0 for r in rows])
    ax.axhline(1.3, color="red", linestyle="--", label="target 1.3")
    ax.set_title("max / mean engine share")
    ax.legend(fontsize="small")
    ax.set_xticks(x, names, fontsize="x-small", rotation=30, ha="right")
    fig.savefig(path, dpi=110)
    return path
