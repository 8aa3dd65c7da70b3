"""PNG plots of benchmark runs, drawn with matplotlib's object API on the Agg canvas (no pyplot state).

- ``ttft_cdf``: the cumulative distribution of TTFT, one line per named run (one run, or a comparison).
- ``ttft_over_time``: TTFT of each successful request against its send time; failed requests as red
  crosses on the time axis.
- ``load_share``: each engine's share of the finished requests, from the engines' counters when read,
  else from the response header naming the engine that served; a dashed line marks the even share. When
  neither is known the image says so instead of drawing zeros.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvstack.bench.records import RequestRecord

__all__ = ["load_share", "ttft_cdf", "ttft_over_time"]


def _figure(width: float = 7.0, height: float = 4.2) -> tuple[Any, Any]:
    # Imported here: matplotlib is only needed when a report is written, and costs ~0.3 s to import.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


def ttft_cdf(path: Path, series: Mapping[str, Sequence[float]], title: str = "TTFT CDF") -> Path:
    """One CDF line of TTFT (seconds, plotted in ms) per name."""
    fig, ax = _figure()
    drawn = False
    lo, hi = float("inf"), 0.0
    for name, values in series.items():
        ms = sorted(v * 1000 for v in values)
        if not ms:
            continue
        n = len(ms)
        ax.step(ms, [(i + 1) / n for i in range(n)], where="post", label=f"{name} (n={n})")
        lo, hi = min(lo, ms[0]), max(hi, ms[-1])
        drawn = True
    if not drawn:
        ax.text(
            0.5, 0.5, "no successful request: TTFT unknown", ha="center", va="center", transform=ax.transAxes
        )
    elif lo > 0 and hi / lo > 50:
        ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    if drawn:
        ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path)


def ttft_over_time(path: Path, records: Sequence[RequestRecord], title: str = "TTFT over time") -> Path:
    """TTFT of each request against its send time."""
    fig, ax = _figure()
    ok = [r for r in records if r.ok and r.ttft is not None]
    failed = [r for r in records if not r.ok]
    if ok:
        ax.scatter([r.sent_s for r in ok], [r.ttft * 1000 for r in ok if r.ttft is not None], s=8, label="ok")
    if failed:
        ax.scatter([r.sent_s for r in failed], [0.0] * len(failed), s=18, c="red", marker="x", label="error")
    if not records:
        ax.text(0.5, 0.5, "no request was sent", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(loc="best", fontsize="small")
    ax.set_xlabel("send time (s since start)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    return _save(fig, path)


def _short(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc or url


def load_share(path: Path, engine: Mapping[str, Any] | None, header_counts: Mapping[str, int]) -> Path:
    """Per-engine share of finished requests, from the engine view when known, else the response header."""
    fig, ax = _figure()
    names: list[str] = []
    shares: list[float] = []
    source = ""
    engines = list(engine["engines"]) if engine else []
    if engines and all(e["load_share"] is not None for e in engines):
        names, shares = [_short(e["url"]) for e in engines], [e["load_share"] for e in engines]
        source = "engine counters (vllm:request_success_total)"
    elif header_counts:
        total = sum(header_counts.values())
        names = list(header_counts)
        shares = [c / total for c in header_counts.values()]
        source = "client side (engine response header)"
    if shares:
        ax.bar(range(len(shares)), shares)
        ax.set_xticks(range(len(names)), names, rotation=30 if len(names) > 4 else 0, ha="right")
        ax.axhline(1 / len(shares), color="gray", linestyle="--", label="even share")
        ax.set_ylim(0, max(1.0, max(shares)) * 1.05)
        ax.legend(loc="upper right", fontsize="small")
        ax.set_title(f"Load share per engine, {source}\nmax/mean = {max(shares) * len(shares):.2f}")
    else:
        reason = "no engine counters read" if not engines else "engine request counters unknown"
        ax.text(
            0.5,
            0.5,
            f"load share unknown: {reason}\nand no engine response header",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_title("Load share per engine")
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_ylabel("share of finished requests")
    return _save(fig, path)
