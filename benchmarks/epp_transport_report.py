"""The endpoint-picker transport results as rows, ratios and a verdict.

``summarize``: one row per target, medians over the rounds of requests/s, latency and CPU per request (picker
or router, Envoy, backend, wrk), and the medians of per-round ratios to the ``grpcio`` target of the same
round (the machine's noise of a given minute falls on both sides of a ratio). ``verdict``: the picker CPU
per request of each transport against the target, and the transport to use.
"""

from __future__ import annotations

import statistics
from typing import Any

from rich.table import Table

BASELINE = "grpcio"
CPU_FIELDS = ("picker_cpu_us_per_req", "envoy_cpu_us_per_req", "backend_cpu_us_per_req", "wrk_cpu_us_per_req")


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarize(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    good = [r for r in runs if not r["failure"] and r["requests"]]
    by_round: dict[tuple[str, int], dict[str, Any]] = {(r["target"], r["round"]): r for r in good}
    rows = []
    for name in names:
        mine = [r for r in good if r["target"] == name]
        row: dict[str, Any] = {"target": name, "rounds": len(mine)}
        if not mine:
            rows.append(row)
            continue
        for key in ("ok_rps", "p50_ms", "p99_ms", "machine_busy_pct", *CPU_FIELDS):
            row[key] = _median([r[key] for r in mine if r[key] is not None])
        row["rps_by_round"] = [r["ok_rps"] for r in mine]
        row["picker_cpu_us_by_round"] = [r["picker_cpu_us_per_req"] for r in mine]
        row["errors"] = sum(sum(r["errors"].values()) for r in mine)
        row["upstream_per_req"] = _median(
            [r["upstream_per_req"] for r in mine if r["upstream_per_req"] is not None]
        )
        msgs = [r["ext_proc_msgs_per_req"] for r in mine if r["ext_proc_msgs_per_req"] is not None]
        row["ext_proc_msgs_per_req"] = _median(msgs)
        row["ext_proc_failures"] = sum(sum(r["ext_proc_failures"].values()) for r in mine)
        row["total_cpu_us_per_req"] = _median(
            [sum(r[k] for k in CPU_FIELDS if r[k] is not None) for r in mine]
        )
        for key, field in (
            ("rps", "ok_rps"),
            ("picker_cpu", "picker_cpu_us_per_req"),
            ("envoy_cpu", "envoy_cpu_us_per_req"),
        ):
            ratios = []
            for r in mine:
                base = by_round.get((BASELINE, r["round"]))
                if base and r[field] is not None and base[field]:
                    ratios.append(r[field] / base[field])
            row[f"{key}_vs_{BASELINE}"] = _median(ratios)
        kv = [
            r["picker_cpu_us_per_req"] / k["picker_cpu_us_per_req"]
            for r in mine
            if (k := by_round.get(("kvstack", r["round"])))
            and k["picker_cpu_us_per_req"]
            and r["picker_cpu_us_per_req"]
        ]
        row["picker_cpu_vs_kvstack"] = _median(kv)
        rows.append(row)
    return rows


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def table(rows: list[dict[str, Any]]) -> Table:
    t = Table(
        title=f"endpoint-picker transports: medians over rounds; ratios to {BASELINE} of the same round"
    )
    for col in (
        "target", "req/s c64", f"÷ {BASELINE}", "p50 ms", "p99 ms", "picker µs/req", f"÷ {BASELINE}",
        "÷ kvstack", "Envoy µs/req", f"÷ {BASELINE}", "backend+wrk µs/req", "msgs/req", "errors",
    ):  # fmt: skip
        t.add_column(col, justify="left" if col == "target" else "right")
    for r in rows:
        if not r.get("ok_rps"):
            t.add_row(r["target"], *["-"] * 12)
            continue
        other = (r["backend_cpu_us_per_req"] or 0) + (r["wrk_cpu_us_per_req"] or 0)
        t.add_row(
            r["target"],
            _num(r["ok_rps"]),
            _num(r.get(f"rps_vs_{BASELINE}"), 2),
            _num(r["p50_ms"], 2),
            _num(r["p99_ms"], 2),
            _num(r["picker_cpu_us_per_req"]),
            _num(r.get(f"picker_cpu_vs_{BASELINE}"), 2),
            _num(r.get("picker_cpu_vs_kvstack"), 2),
            _num(r["envoy_cpu_us_per_req"]),
            _num(r.get(f"envoy_cpu_vs_{BASELINE}"), 2),
            _num(other),
            _num(r["ext_proc_msgs_per_req"], 2),
            str(r["errors"] + r["ext_proc_failures"]),
        )
    return t


def verdict(rows: list[dict[str, Any]], target_us: float) -> dict[str, Any]:
    """Each transport's picker CPU per request against ``target_us``; the cheapest one that sends the body."""
    out: dict[str, Any] = {"picker_cpu_target_us": target_us}
    for r in rows:
        if r["target"] in ("kvstack", "envoy alone") or r.get("picker_cpu_us_per_req") is None:
            continue
        out[r["target"]] = {
            "picker_cpu_us_per_req": r["picker_cpu_us_per_req"],
            "floor_share_of_target": round(r["picker_cpu_us_per_req"] / target_us, 2),
            "rps": r["ok_rps"],
        }
    with_body = [r for r in rows if r["target"] in ("grpcio", "lean") and r.get("picker_cpu_us_per_req")]
    if with_body:
        best = min(with_body, key=lambda r: r["picker_cpu_us_per_req"])
        out["cheapest_with_body"] = best["target"]
    return out
