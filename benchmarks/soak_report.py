"""The soak's verdict, table and plots.

Accounting, per front end: every request sent ended in one outcome; none truncated, hung or with a
malformed error; ``broken`` (a cut connection) only behind Envoy, which can only reset a stream whose
upstream died after the response began; the front end's ``kvstack_router_requests_total`` summed over
statuses equals the requests sent; in-flight gauges are 0 once the load stopped. Leaks, per kvstack process:
mean RSS over the last ``edge`` seconds of the load within ±``rss_pct`` (+ ``rss_slack_mib``) of its mean
over ``edge`` after warm-up; fds and sockets not growing from window to window (4 windows after warm-up:
every step up and more than ``count_slack`` in all), and once idle no more than at the end of warm-up +
``count_slack``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from statistics import mean
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

JUDGED = ("router", "epp")  # kvstack's processes; Envoy and the cache server are sampled for the record
BROKEN_ALLOWED = {"router": False, "envoy": True}


def _window(samples: list[dict[str, Any]], name: str, key: str, t0: float, t1: float) -> list[float]:
    return [s["procs"][name][key] for s in samples if t0 <= s["t"] <= t1 and s["procs"].get(name)]


def leak_verdict(
    samples: list[dict[str, Any]],
    idle: dict[str, Any],
    *,
    warmup_end: float,
    load_end: float,
    edge: float,
    rss_pct: float,
    rss_slack_mib: float,
    count_slack: int,
) -> dict[str, Any]:
    span = load_end - warmup_end
    out: dict[str, Any] = {}
    for name in JUDGED:
        warm_rss = _window(samples, name, "rss_kib", warmup_end, warmup_end + edge)
        end_rss = _window(samples, name, "rss_kib", load_end - edge, load_end)
        rss_start, rss_end = mean(warm_rss) / 1024, mean(end_rss) / 1024
        change = (rss_end - rss_start) / rss_start
        rss_ok = abs(rss_end - rss_start) <= rss_pct / 100 * rss_start + rss_slack_mib
        bounds = [warmup_end + i * span / 4 for i in range(5)]
        rss_windows = [
            round(mean(_window(samples, name, "rss_kib", a, b) or [0]) / 1024, 1)
            for a, b in itertools.pairwise(bounds)
        ]
        counts: dict[str, Any] = {}
        for key in ("fds", "sockets"):
            windows = [mean(_window(samples, name, key, a, b) or [0]) for a, b in itertools.pairwise(bounds)]
            warm_max = max(_window(samples, name, key, warmup_end - edge, warmup_end + edge))
            growing = all(b > a for a, b in itertools.pairwise(windows)) and (
                windows[-1] - windows[0] > count_slack
            )
            idle_value = idle["procs"][name][key]
            counts[key] = {
                "window_means": [round(w, 1) for w in windows],
                "max_at_warmup_end": warm_max,
                "idle_after_load": idle_value,
                "ok": not growing and idle_value <= warm_max + count_slack,
            }
        out[name] = {
            "rss_mib_after_warmup": round(rss_start, 1),
            "rss_mib_end": round(rss_end, 1),
            "rss_change_pct": round(100 * change, 1),
            "rss_ok": rss_ok,
            "rss_window_means_mib": rss_windows,  # 4 windows after warm-up: growth that flattens or goes on
            **counts,
            "ok": rss_ok and all(c["ok"] for c in counts.values()),
        }
    return out


def accounting_verdict(front: str, tally: dict[str, Any], counters: dict[str, Any]) -> dict[str, Any]:
    o = tally["outcomes"]
    counted = sum(counters["requests_by_status"].values())
    problems = []
    if tally["accounted"] != tally["sent"] or tally["open_at_end"]:
        problems.append(f"{tally['sent']} sent, {tally['accounted']} ended, {tally['open_at_end']} open")
    for bad in ("truncated", "hung", "error_status_malformed"):
        if o[bad]:
            problems.append(f"{o[bad]} {bad}")
    if o["broken"] and not BROKEN_ALLOWED[front]:
        problems.append(f"{o['broken']} broken")
    if counted != tally["sent"]:
        problems.append(f"front end counted {counted} requests, client sent {tally['sent']}")
    if counters["in_flight"]:
        problems.append(f"in-flight gauges at {counters['in_flight']} after the load")
    return {"front_end_counted": counted, "problems": problems, "ok": not problems}


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per front end."""
    columns = [
        "front end", "sent", "ok", "error (status)", "error (SSE event)", "broken", "truncated", "hung",
        "cancelled", "counted by kvstack", "process", "RSS MiB after warm-up → end (change)",
        "fds: window means → idle", "sockets: window means → idle", "verdict",
    ]  # fmt: skip
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for front, proc in (("router", "router"), ("envoy", "epp")):
        f = result["fronts"][front]
        o = f["client"]["outcomes"]
        leak = result["leaks"][proc]
        cells = [
            front,
            f["client"]["sent"],
            o["ok"],
            o["error_status"] + o["error_status_malformed"],
            o["error_event"],
            o["broken"],
            o["truncated"],
            o["hung"],
            o["cancelled"],
            f["accounting"]["front_end_counted"],
            proc,
            f"{leak['rss_mib_after_warmup']} → {leak['rss_mib_end']} ({leak['rss_change_pct']:+}%)",
            f"{leak['fds']['window_means']} → {leak['fds']['idle_after_load']}",
            f"{leak['sockets']['window_means']} → {leak['sockets']['idle_after_load']}",
            "PASS" if f["accounting"]["ok"] and leak["ok"] else "FAIL",
        ]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> None:
    """RSS, fds and sockets of the sampled processes over time, warm-up end, restarts and load stop marked."""
    samples = result["samples"]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    panels = [
        ("rss_kib", "RSS (MiB)", [n for n in result["watched"] if n != "cache-server"]),
        ("rss_kib", "cache server RSS (MiB)", ["cache-server"]),
        ("fds", "open fds", result["watched"]),
        ("sockets", "socket fds", result["watched"]),
    ]
    for ax, (key, label, names) in zip(axes, panels, strict=True):
        for name in names:
            pts = [(s["t"] / 60, s["procs"][name][key]) for s in samples if s["procs"].get(name)]
            ys = [y / 1024 if key == "rss_kib" else y for _, y in pts]
            ax.plot([x for x, _ in pts], ys, label=name, linewidth=1)
        ax.legend(loc="upper left", fontsize=8, ncol=4)
        ax.axvline(result["warmup_end_s"] / 60, color="grey", linestyle="--", linewidth=0.8)
        ax.axvline(result["load_end_s"] / 60, color="black", linestyle="--", linewidth=0.8)
        for t in result["restarts_s"]:
            ax.axvline(t / 60, color="red", alpha=0.15, linewidth=0.8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes (dashed: warm-up end, load stop; red: engine SIGKILL + restart)")
    fig.suptitle(f"kvstack soak, {result['minutes']:g} min")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
