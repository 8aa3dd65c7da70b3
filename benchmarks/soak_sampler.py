"""What the soak samples from a running process and a front end's /metrics.

``proc_sample(pid)``: resident memory (VmRSS), open file descriptors, the sockets among them, threads, from
/proc; ``group_sample(pgid)``: the same summed over a process group (a router's supervisor and its workers).
``front_counters(text)``: a front end's ``kvstack_router_requests_total`` by status, the sum of
``kvstack_router_in_flight_requests`` and failed attempts against engines by reason. Neither kvstack
process exports its asyncio task count; the socket and in-flight counts stand for it (a leaked task holding
a connection holds a socket).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from procs import group_pids
from prometheus_client.parser import text_string_to_metric_families


def proc_sample(pid: int) -> dict[str, int] | None:
    """{rss_kib, fds, sockets, threads} of ``pid``, or None when it is gone."""
    base = Path(f"/proc/{pid}")
    try:
        status = (base / "status").read_text()
        names = os.listdir(base / "fd")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    sockets = 0
    for name in names:
        try:
            if os.readlink(base / "fd" / name).startswith("socket:"):
                sockets += 1
        except OSError:
            continue  # closed between listdir and readlink
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "fds": len(names),
        "sockets": sockets,
        "threads": int(fields["Threads"]),
    }


def group_sample(pgid: int) -> dict[str, int] | None:
    """``proc_sample`` summed over every live process of group ``pgid`` (with ``processes``), or None."""
    samples = [s for pid in group_pids(pgid) if (s := proc_sample(pid)) is not None]
    if not samples:
        return None
    total = {key: sum(s[key] for s in samples) for key in samples[0]}
    total["processes"] = len(samples)
    return total


def front_counters(text: str) -> dict[str, Any]:
    """Requests answered by status and requests in flight, from a kvstack front end's /metrics page."""
    by_status: Counter[str] = Counter()
    upstream_errors: Counter[str] = Counter()
    in_flight = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvstack_router_requests_total":
                by_status[s.labels["status"]] += int(s.value)
            elif s.name == "kvstack_router_in_flight_requests":
                in_flight += s.value
            elif s.name == "kvstack_router_upstream_errors_total":
                upstream_errors[s.labels["reason"]] += int(s.value)
    return {
        "requests_by_status": dict(by_status),
        "in_flight": in_flight,
        "upstream_errors_by_reason": dict(upstream_errors),
    }
