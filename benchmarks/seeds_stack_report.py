"""seeds_stack.py's tables and verdicts, from the runs' summaries alone (no I/O).

A row per setup: requests ok / failed, where prompt tokens came from (computed, the engines' own prefix
cache, the tier: shares of all prompt tokens the engines counted), the share not computed, TTFT p50 / p90
(client side) and the engines' own mean, each engine's share of the requests. ``compare`` sets each
kvstack row against the seeds' row of the same run and the ceiling row (``CEILING_LABEL``, when it ran):
ratios kvstack ÷ seeds, not computed ÷ the ceiling's, and the targets, met or not: not computed ≥
``TARGET_NOT_COMPUTED`` and TTFT p50 ≤ ``TARGET_TTFT_RATIO`` times the seeds'. ``by_round``: where the
computed tokens were, round by round, from each response's usage (prompt minus cached tokens; vLLM counts
tokens from its prefix cache and from the tier as cached); ``moves``: how often a conversation changed
engine between rounds, and what a moved round computed against one that stayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connector_ttft_report import fmt
from results import ratio

TARGET_NOT_COMPUTED = 0.84
CEILING_LABEL = "kvstack-spare-kv"  # kvstack with KV to spare: the workload's ceiling of not computed
TARGET_TTFT_RATIO = 0.8

COLUMNS = (
    "setup",
    "ok / failed",
    "not computed",
    "computed",
    "GPU prefix cache",
    "tier",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "later rounds p50 ms",
    "engine TTFT mean ms",
    "requests A / B",
    "moved rounds (computed: moved / stayed)",
    "preemptions",
    "busy % (this run)",
)
COMPARE_COLUMNS = (
    "kvstack setup",
    "not computed ÷ seeds",
    "not computed ÷ spare-KV row",
    "TTFT p50 ÷ seeds",
    "TTFT p90 ÷ seeds",
    f"not computed ≥ {TARGET_NOT_COMPUTED}",
    f"TTFT p50 ≤ {TARGET_TTFT_RATIO} of seeds'",
)


def not_computed(summary: dict[str, Any]) -> float | None:
    share = summary.get("computed_share")
    return None if share is None else 1 - share


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def engine_ttft(run: dict[str, Any]) -> float | None:
    """The engines' own mean TTFT over the run (Δ sum / Δ count of vLLM's TTFT histogram, all engines)."""
    engines = run.get("engines") or []
    count = sum(e.get("ttft_count", 0.0) for e in engines)
    return sum(e.get("ttft_sum", 0.0) for e in engines) / count if count else None


def request_shares(summary: dict[str, Any]) -> list[float | None]:
    """Each engine's share of the finished requests, from the engines' own counters."""
    view = summary.get("bench_engine_view") or {}
    return [e.get("load_share") for e in view.get("engines", [])]


def rows(runs: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = []
    for run in runs:
        s = run.get("summary")
        if not s:
            continue
        m = run.get("machine", {})
        shares = " / ".join("-" if v is None else f"{100 * v:.0f}%" for v in request_shares(s))
        out.append(
            [
                run["setup"]["label"],
                f"{s['ok']} / {s['requests'] - s['ok']}",
                _pct(not_computed(s)),
                _pct(s["computed_share"]),
                _pct(s["local_hit_share"]),
                _pct(s["external_share"]),
                _ms(s["ttft_p50_s"]),
                _ms(s["ttft_p90_s"]),
                _ms(s["later_ttft_p50_s"]),
                _ms(engine_ttft(run)),
                shares or "-",
                move_cell(s),
                fmt(s["preemptions"], 0),
                f"{fmt(m.get('machine_busy_pct'), 0)} ({fmt(m.get('this_run_pct'), 0)})",
            ]
        )
    return out


def compare(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every kvstack row against the seeds' row: ratios and the two targets (None = unknown)."""
    seeds = next((r["summary"] for r in runs if r["setup"]["stack"] == "seeds" and r.get("summary")), None)
    spare = next(
        (r["summary"] for r in runs if r["setup"]["label"] == CEILING_LABEL and r.get("summary")), None
    )
    ceiling = not_computed(spare) if spare else None
    out = []
    for run in runs:
        s = run.get("summary")
        if run["setup"]["stack"] != "kvstack" or not s:
            continue
        nc = not_computed(s)
        p50 = ratio(s["ttft_p50_s"], seeds["ttft_p50_s"]) if seeds else None
        out.append(
            {
                "label": run["setup"]["label"],
                "not_computed": nc,
                "not_computed_ratio": ratio(nc, not_computed(seeds)) if seeds else None,
                "of_ceiling": ratio(nc, ceiling),
                "ttft_p50_ratio": p50,
                "ttft_p90_ratio": ratio(s["ttft_p90_s"], seeds["ttft_p90_s"]) if seeds else None,
                "not_computed_met": None if nc is None else nc >= TARGET_NOT_COMPUTED,
                "ttft_met": None if p50 is None else p50 <= TARGET_TTFT_RATIO,
            }
        )
    return out


def by_round(requests: Sequence[tuple[int, int | None, int | None]]) -> list[dict[str, Any]]:
    """Per round, from (round, prompt tokens, cached tokens) of each answered request: requests, prompt and
    computed tokens (prompt - cached), and the requests that computed more than one block's worth (128)."""
    out: dict[int, dict[str, Any]] = {}
    for rnd, prompt, cached in requests:
        if prompt is None or cached is None:
            continue
        row = out.setdefault(rnd, {"round": rnd, "requests": 0, "prompt": 0, "computed": 0, "over_block": 0})
        row["requests"] += 1
        row["prompt"] += prompt
        row["computed"] += prompt - cached
        row["over_block"] += prompt - cached > 128
    return [out[r] for r in sorted(out)]


def moves(requests: Sequence[tuple[int, int, str | None, int | None, int | None]]) -> dict[str, Any] | None:
    """Rounds served by another engine than their conversation's previous round, from (session, round,
    engine, prompt tokens, cached tokens) of each answered request; the mean computed tokens of moved and
    of staying rounds. None when no response named its engine (only kvstack's router names it)."""
    served = {(s, r): (e, p, c) for s, r, e, p, c in requests if e is not None}
    if not served:
        return None
    moved: list[int] = []
    stayed: list[int] = []
    for (session, rnd), (engine, prompt, cached) in served.items():
        previous = served.get((session, rnd - 1))
        if previous is None or prompt is None or cached is None:
            continue
        (moved if engine != previous[0] else stayed).append(prompt - cached)
    return {
        "moved": len(moved),
        "later_rounds": len(moved) + len(stayed),
        "computed_mean_moved": sum(moved) / len(moved) if moved else None,
        "computed_mean_stayed": sum(stayed) / len(stayed) if stayed else None,
    }


def move_cell(summary: dict[str, Any]) -> str:
    m = summary.get("moves")
    if not m:
        return "-"
    return (
        f"{m['moved']}/{m['later_rounds']} ({fmt(m['computed_mean_moved'], 0)} / "
        f"{fmt(m['computed_mean_stayed'], 0)})"
    )


def round_rows(runs: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row per setup: each round's computed tokens as a share of that round's prompt tokens, and how
    many of its requests computed more than a block."""
    out = []
    for run in runs:
        rounds = (run.get("summary") or {}).get("by_round") or []
        cells = [
            f"{_pct(r['computed'] / r['prompt'] if r['prompt'] else None)} ({r['over_block']})"
            for r in rounds
        ]
        if cells:
            out.append([run["setup"]["label"], *cells])
    return out


def verdict(met: bool | None) -> str:
    return {True: "met", False: "not met", None: "unknown"}[met]


def compare_rows(comparisons: Sequence[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            c["label"],
            fmt(c["not_computed_ratio"]),
            fmt(c["of_ceiling"]),
            fmt(c["ttft_p50_ratio"]),
            fmt(c["ttft_p90_ratio"]),
            f"{verdict(c['not_computed_met'])} ({_pct(c['not_computed'])})",
            verdict(c["ttft_met"]),
        ]
        for c in comparisons
    ]
