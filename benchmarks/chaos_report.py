"""The chaos benchmark's tables (one per fault, a row per router) and its targets, as markdown and rich.

``tables`` turns ``results[fault][router]`` (a fault's numbers, or ``{"skipped": why}``) into
(title, header, rows); ``markdown`` renders them with the targets, as the page shows them; ``targets``
checks kvstack's: no request failed before its first token, none truncated, none hung, a restarted engine
serving through the router within two scrape intervals of being healthy.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

FAULTS = {
    "engine-kill": "Engine SIGKILLed under load, restarted on the same port (2 real vLLM engines)",
    "kv-publisher-restart": "KV-event publisher restart (the killed vLLM engine's, restarted with it)",
    "slow-engine": "Slow engine: first-token delay on one of 2 simulated engines",
    "engine-503": "An engine answering every generation with 503 (1 of 2 simulated engines)",
    "cache-server-kill": "Cache server SIGKILLed and restarted (simulated engines' connector; kvstack only)",
    "redis-stop": "The cache server's Redis tier stopped and started (kvstack only)",
}
COUNTS = ("requests", "ok", "failed_before_token", "broken_mid_stream", "truncated", "hung")
COUNT_HEADER = ["requests", "ok", "failed before token", "broken mid-stream", "truncated", "hung", "ok share"]

Table_ = tuple[str, list[str], list[list[str]]]


def _s(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}{unit}"
    return f"{value}{unit}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def _extra(fault: str, r: dict[str, Any]) -> list[str]:
    if fault == "engine-kill":
        down = f"{r.get('failed_while_down', '-')}/{r.get('requests_while_down', '-')}"
        return [down, _s(r.get("restart_to_healthy_s"), " s"), _s(r.get("rejoin_s"), " s")]
    if fault == "slow-engine":
        return [f"{100 * r['faulty_engine_share']:.0f}%"]
    if fault == "engine-503":
        return []
    alive = all(r.get("engines_alive", {}).values())
    return [_s(r.get("service_back_s"), " s"), "yes" if alive else "NO"]


EXTRA_HEADER = {
    "engine-kill": ["not ok / sent while down", "restart → healthy", "healthy → serves (rejoin)"],
    "slow-engine": ["share to the slow engine"],
    "engine-503": [],
    "cache-server-kill": ["server back after start", "engines alive"],
    "redis-stop": ["Redis back after start", "engines alive"],
}


def tables(results: dict[str, dict[str, dict[str, Any]]]) -> list[Table_]:
    out: list[Table_] = []
    for fault, title in FAULTS.items():
        by_router = results.get(fault) or {}
        if not by_router:
            continue
        if fault == "kv-publisher-restart":
            rows = [[name, *_publisher_row(r)] for name, r in by_router.items()]
            out.append(
                (title, ["router", "follows vLLM KV events", "first batch applied after healthy"], rows)
            )
            continue
        header = ["router", *COUNT_HEADER, "TTFT p50 / p99 ms", *EXTRA_HEADER[fault]]
        rows = []
        for name, r in by_router.items():
            if "skipped" in r or "failure" in r:
                reason = r.get("skipped") or f"FAILED: {r['failure'][:120]}"
                rows.append([name, reason, *[""] * (len(header) - 2)])
                continue
            counts = [str(r[c]) for c in COUNTS]
            share = "-" if r["ok_ratio"] is None else f"{100 * r['ok_ratio']:.1f}%"
            ttft = f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])}"
            rows.append([name, *counts, share, ttft, *_extra(fault, r)])
        out.append((title, header, rows))
    return out


def _publisher_row(r: dict[str, Any]) -> list[str]:
    if "skipped" in r:
        return ["no", r["skipped"]]
    return ["yes", _s(r.get("kv_events_resumed_s"), " s")]


def targets(
    results: dict[str, dict[str, dict[str, Any]]], router: str, scrape_s: float
) -> list[dict[str, Any]]:
    """kvstack's targets over every fault it ran."""
    runs = {fault: by[router] for fault, by in results.items() if router in by and "ok" in by[router]}

    def total(key: str) -> int:
        return sum(int(r[key]) for r in runs.values())

    checks = [
        {
            "target": "0 requests failed before any token",
            "value": total("failed_before_token"),
            "pass": total("failed_before_token") == 0,
        },
        {"target": "0 truncated", "value": total("truncated"), "pass": total("truncated") == 0},
        {"target": "0 hung", "value": total("hung"), "pass": total("hung") == 0},
    ]
    if "engine-kill" in runs:
        rejoin = runs["engine-kill"].get("rejoin_s")
        checks.append(
            {
                "target": f"rejoin within two scrape intervals ({2 * scrape_s:g} s)",
                "value": rejoin,
                "pass": rejoin is not None and rejoin <= 2 * scrape_s,
            }
        )
    return checks


def markdown(rendered: list[Table_], checks: list[dict[str, Any]], subject: str) -> str:
    parts = []
    for title, header, rows in rendered:
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        parts.append("\n".join(lines))
    verdicts = [f"- {'PASS' if c['pass'] else '**FAIL**'}: {c['target']} ({_s(c['value'])})" for c in checks]
    if verdicts:
        parts.append(f"Targets for {subject}:\n\n" + "\n".join(verdicts))
    return "\n\n".join(parts) + "\n"


def rich_tables(rendered: list[Table_]) -> list[Table]:
    out = []
    for title, header, rows in rendered:
        table = Table(title=title, title_justify="left")
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        out.append(table)
    return out
