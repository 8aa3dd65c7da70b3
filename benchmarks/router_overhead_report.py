"""The router overhead results as rows and tables: added latency against direct, throughput ratios, verdicts.

``summarize`` makes one row per target from the runs (added p50/p99 = target - direct at low load, 2xx
requests/s at ``-c 64`` and its ratio to each peer and to kvstack, CPU per request, per process for the
Envoy targets, upstream calls per request). ``targets_verdict`` reads kvstack's targets (throughput >= 0.5 x
vllm-router's, added p99 <= 2 ms) off them; ``envoy_verdict`` the Envoy front end's (picker CPU <= 250 us
per request, streams >= 1.5 x kvstack's proxy, added p99 <= 3 ms), shown by ``envoy_table``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table


# -- reporting ------------------------------------------------------------------------------------
def _find(runs: list[dict[str, Any]], target: str, kind: str, load: str) -> dict[str, Any] | None:
    for r in runs:
        if r["target"] == target and r["kind"] == kind and r["load"] == load and not r["failure"]:
            return r
    return None


def summarize(runs: list[dict[str, Any]], targets: Sequence[str]) -> list[dict[str, Any]]:
    """One row per target: added latency at low load vs direct, throughput at -c 64 and ratios."""
    rows = []
    for t in targets:
        row: dict[str, Any] = {"target": t}
        for kind in ("plain", "stream"):
            low, base = _find(runs, t, kind, "low"), _find(runs, "direct", kind, "low")
            top = _find(runs, t, kind, "max")
            if low:
                row[f"{kind}_low_rps"] = low["rps"]
                row[f"{kind}_low_p50_ms"] = low["p50_ms"]
                row[f"{kind}_low_p99_ms"] = low["p99_ms"]
                row[f"{kind}_low_errors"] = sum(low["errors"].values())
                row[f"{kind}_low_cpu_us_per_req"] = low["target_cpu_us_per_req"]
                row[f"{kind}_low_cpu_us_per_req_by_process"] = low.get("cpu_us_per_req_by_process") or {}
            if low and base:
                row[f"{kind}_added_p50_ms"] = round(low["p50_ms"] - base["p50_ms"], 3)
                row[f"{kind}_added_p99_ms"] = round(low["p99_ms"] - base["p99_ms"], 3)
            if top:
                row[f"{kind}_max_rps"] = top["ok_rps"]
                row[f"{kind}_max_errors"] = sum(top["errors"].values())
                row[f"{kind}_cpu_us_per_req"] = top["target_cpu_us_per_req"]
                row[f"{kind}_cpu_us_per_req_by_process"] = top.get("cpu_us_per_req_by_process") or {}
                row[f"{kind}_upstream_per_req"] = top["upstream_per_req"]
                row[f"{kind}_machine_busy_pct"] = top["machine_busy_pct"]
        rows.append(row)
    for row in rows:
        for peer in ("vllm-router", "vllm-router rr", "sglang-router", "kvstack", "direct"):
            ref = next((r for r in rows if r["target"] == peer), None)
            if ref is None or ref is row:
                continue
            for kind in ("plain", "stream"):
                a, b = row.get(f"{kind}_max_rps"), ref.get(f"{kind}_max_rps")
                if a and b:
                    row[f"{kind}_rps_vs_{peer}"] = round(a / b, 2)
    return rows


def targets_verdict(
    rows: list[dict[str, Any]], rate: float, rounds: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The issue's targets for every kvstack row: throughput >= 0.5 x vllm-router's, added p99 <= 2 ms
    (the median of the interleaved rounds when they ran, else the single low-load run)."""
    verdict: dict[str, Any] = {}
    for row in rows:
        if not row["target"].startswith("kvstack"):
            continue
        v: dict[str, Any] = {}
        for kind in ("plain", "stream"):
            ratio = row.get(f"{kind}_rps_vs_vllm-router")
            v[f"{kind}_throughput_vs_vllm_router"] = ratio
            v[f"{kind}_throughput_target_met"] = None if ratio is None else ratio >= 0.5
        added = _added_p99(row, rounds, v)
        v[f"added_p99_ms_at_{rate:g}_rps"] = added
        v["added_p99_target_met"] = None if added is None else added <= 2.0
        verdict[row["target"]] = v
    return verdict


def _added_p99(row: dict[str, Any], rounds: dict[str, Any] | None, v: dict[str, Any]) -> float | None:
    """Added p99 at the low plain rate: the interleaved rounds' median when they ran (the single run's noted
    in ``v``), else the single low-load run's."""
    added = row.get("plain_added_p99_ms")
    interleaved = (rounds or {}).get("summary", {}).get(row["target"], {}).get("added_p99_ms_median")
    if interleaved is None:
        return added
    v["added_p99_single_run_ms"] = added
    v["added_p99_from"] = "median of interleaved rounds"
    return interleaved


# The targets for the Envoy front end.
PICKER_CPU_US = 250.0  # picker CPU per request, scheduling included, at -c 64 (plain and streams)
STREAM_VS_KVSTACK = 1.5  # streams/s at -c 64 over kvstack's proxy (Envoy relays the chunks)
ENVOY_ADDED_P99_MS = 3.0  # at the low plain rate
ENVOY_REFERENCES = ("kvstack", "vllm-router rr")


def envoy_verdict(
    rows: list[dict[str, Any]], rate: float, rounds: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The Envoy front end's targets for every ``envoy...`` row: picker CPU <= 250 us per request (plain and
    streams at -c 64), streams >= 1.5 x kvstack's proxy, added p99 <= 3 ms (rounds' median when they ran)."""
    verdict: dict[str, Any] = {}
    for row in rows:
        if not row["target"].startswith("envoy"):
            continue
        v: dict[str, Any] = {}
        picker = {k: row.get(f"{k}_cpu_us_per_req_by_process", {}).get("picker") for k in ("plain", "stream")}
        known = [us for us in picker.values() if us is not None]
        v["picker_cpu_us_per_req"] = picker
        v["picker_cpu_target_met"] = max(known) <= PICKER_CPU_US if known else None
        ratio = row.get("stream_rps_vs_kvstack")
        v["stream_throughput_vs_kvstack"] = ratio
        v["stream_throughput_target_met"] = None if ratio is None else ratio >= STREAM_VS_KVSTACK
        added = _added_p99(row, rounds, v)
        v[f"added_p99_ms_at_{rate:g}_rps"] = added
        v["added_p99_target_met"] = None if added is None else added <= ENVOY_ADDED_P99_MS
        verdict[row["target"]] = v
    return verdict


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def results_table(rows: list[dict[str, Any]], rate: float, stream_rate: float) -> Table:
    table = Table(title="Router overhead against a zero-delay backend (wrk; added = target - direct)")
    cols = [
        "target",
        f"plain +p50 ms @{rate:g}/s",
        f"plain +p99 ms @{rate:g}/s",
        "plain req/s c64",
        "/vllm-router",
        "/sglang-router",
        "CPU us/req",
        f"stream +p50 ms @{stream_rate:g}/s",
        f"stream +p99 ms @{stream_rate:g}/s",
        "stream req/s c64",
        "/vllm-router",
        "/sglang-router",
        "CPU us/req",
        "upstream POSTs/req",
    ]
    for c in cols:
        table.add_column(c, justify="left" if c == "target" else "right")
    for r in rows:
        ups = r.get("plain_upstream_per_req") or {}
        table.add_row(
            r["target"],
            _fmt(r.get("plain_added_p50_ms")),
            _fmt(r.get("plain_added_p99_ms")),
            _rps_cell(r, "plain"),
            _fmt(r.get("plain_rps_vs_vllm-router")),
            _fmt(r.get("plain_rps_vs_sglang-router")),
            _fmt(r.get("plain_cpu_us_per_req"), 0),
            _fmt(r.get("stream_added_p50_ms")),
            _fmt(r.get("stream_added_p99_ms")),
            _rps_cell(r, "stream"),
            _fmt(r.get("stream_rps_vs_vllm-router")),
            _fmt(r.get("stream_rps_vs_sglang-router")),
            _fmt(r.get("stream_cpu_us_per_req"), 0),
            _upstream(ups),
        )
    return table


def envoy_table(
    rows: list[dict[str, Any]], rate: float, verdict: dict[str, Any], rounds: dict[str, Any] | None
) -> Table:
    """The Envoy rows with kvstack's proxy and vllm-router rr as references: ratios, CPU per process, and
    the Envoy targets (``envoy_verdict``) as pass/fail."""
    table = Table(title="Envoy front end: ratios to kvstack's proxy and vllm-router rr (same run)")
    cols = [
        "target",
        "plain req/s c64",
        "/kvstack",
        "/vllm-router rr",
        "stream req/s c64",
        "/kvstack",
        "/vllm-router rr",
        "CPU us/req plain",
        "CPU us/stream",
        f"+p50 ms @{rate:g}/s",
        f"+p99 ms @{rate:g}/s",
        f"picker <= {PICKER_CPU_US:g} us",
        f"streams >= {STREAM_VS_KVSTACK:g}x kvstack",
        f"+p99 <= {ENVOY_ADDED_P99_MS:g} ms",
    ]
    for c in cols:
        table.add_column(c, justify="left" if c == "target" else "right")
    summary = (rounds or {}).get("summary", {})
    for r in rows:
        name = r["target"]
        if name not in ENVOY_REFERENCES and not name.startswith("envoy"):
            continue
        v = verdict.get(name, {})
        added50 = summary.get(name, {}).get("added_p50_ms_median", r.get("plain_added_p50_ms"))
        added99 = summary.get(name, {}).get("added_p99_ms_median", r.get("plain_added_p99_ms"))
        table.add_row(
            name,
            _rps_cell(r, "plain"),
            _fmt(r.get("plain_rps_vs_kvstack")),
            _fmt(r.get("plain_rps_vs_vllm-router rr")),
            _rps_cell(r, "stream"),
            _fmt(r.get("stream_rps_vs_kvstack")),
            _fmt(r.get("stream_rps_vs_vllm-router rr")),
            _cpu_cell(r, "plain"),
            _cpu_cell(r, "stream"),
            _fmt(added50),
            _fmt(added99),
            _pass(v.get("picker_cpu_target_met")),
            _pass(v.get("stream_throughput_target_met")),
            _pass(v.get("added_p99_target_met")),
        )
    return table


def _cpu_cell(row: dict[str, Any], kind: str) -> str:
    """The target's CPU per request at -c 64; per process (``picker 180 + envoy 90``) when it has several."""
    each = row.get(f"{kind}_cpu_us_per_req_by_process") or {}
    if each:
        return " + ".join(f"{name} {us:.0f}" for name, us in each.items())
    return _fmt(row.get(f"{kind}_cpu_us_per_req"), 0)


def _pass(met: bool | None) -> str:
    return "-" if met is None else ("PASS" if met else "FAIL")


def _rps_cell(row: dict[str, Any], kind: str) -> str:
    errors = row.get(f"{kind}_max_errors")
    return _fmt(row.get(f"{kind}_max_rps"), 0) + (f" ({errors} err)" if errors else "")


def _upstream(per_req: dict[str, float]) -> str:
    """Upstream POSTs per client request, by the last path segment: ``completions 1, render 1``."""
    return ", ".join(f"{key.rsplit('/', 1)[-1]} {n:g}" for key, n in per_req.items()) or "-"


def runs_table(runs: list[dict[str, Any]]) -> Table:
    table = Table(title="Every measured run")
    for c in (
        "target",
        "kind",
        "load",
        "-c",
        "think ms",
        "2xx req/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "p99.9 ms",
        "errors",
        "target CPU s",
        "backend CPU s",
        "wrk CPU s",
        "machine busy%",
    ):
        table.add_column(c, justify="left" if c in ("target", "kind", "load") else "right")
    for r in runs:
        table.add_row(
            r["target"],
            r["kind"],
            r["load"],
            str(r["connections"]),
            _fmt(r["think_ms"], 1),
            _fmt(r["ok_rps"], 0),
            _fmt(r["p50_ms"], 3),
            _fmt(r["p90_ms"], 3),
            _fmt(r["p99_ms"], 3),
            _fmt(r["p999_ms"], 3),
            r["failure"] or (" ".join(f"{k}={v}" for k, v in r["errors"].items()) or "0"),
            _fmt(r["target_cpu_s"], 1),
            _fmt(r["backend_cpu_s"], 1),
            _fmt(r["wrk_cpu_s"], 1),
            _fmt(r["machine_busy_pct"], 0),
        )
    return table


def rounds_table(rounds: dict[str, Any]) -> Table:
    table = Table(
        title=f"Interleaved latency rounds at {rounds['rate']:g} req/s (added = target - direct, same round)"
    )
    for col in ("target", "added p50 ms by round", "added p99 ms by round", "median +p50", "median +p99"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for name, s in rounds["summary"].items():
        table.add_row(
            name,
            " ".join(f"{x:.2f}" for x in s["added_p50_ms_by_round"]),
            " ".join(f"{x:.2f}" for x in s["added_p99_ms_by_round"]),
            _fmt(s["added_p50_ms_median"]),
            _fmt(s["added_p99_ms_median"]),
        )
    wake = rounds.get("timer_wakeup_p99_ms_by_round") or []
    if wake:  # results from before the probe existed have none
        table.add_row(
            "machine: idle loop's 1 ms timer, p99 lag",
            "",
            " ".join(f"{x:.2f}" for x in wake),
            "",
            _fmt(rounds["timer_wakeup_p99_ms_median"]),
        )
    return table
