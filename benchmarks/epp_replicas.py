"""Do two active `kvstack epp` replicas behind one Envoy choose the same engine for the same request?

Each phase starts fresh: 4 simulated engines in one ``kvstack sim`` process, publishing KV events; two
``kvstack epp`` processes subscribed to them (routing "auto": kv-aware-replicas); real Envoy
(``.venvs/dev/bin/envoy``) in front, balancing its ext_proc streams over the two replicas by round robin. A
seeded multi-round chat (``kvstack.bench.workloads.MultiRoundQA``) is replayed through Envoy. Before each
request both replicas are asked at once, as Envoy asks, where it would go (an ext_proc stream half-closed
after the answer), and the real request follows through Envoy; agreement = both answers equal. Disagreements
are classified by the first signal the replicas' ``/engines`` views differ in (in-flight, scrape, KV events).

Phases: sequential with a shared system prompt; sequential without one (every first round is a cold tie the
hash breaks); the same with ``--routing kv-aware`` (the router's preset: replica-local scorers, random ties)
as the baseline; 8 users at once (in-flight load does break ties, replica by replica).

Reported per phase: agreement (and on first rounds), causes, where Envoy's pick served, each replica's
in-flight (sampled every 0.2 s: peak, mean, the largest gap between the two, and at the end), engine
prefix-cache hit rate, engine shares, latency through Envoy.

Run: ``.venvs/dev/bin/python benchmarks/epp_replicas.py`` (about 3 minutes; ``--quick``: about 1). JSON in
``bench-results/epp_replicas.json``; process logs in ``.cache/bench/epp_replicas/``. The current result:
``docs/benchmarks/epp-replicas.md``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from epp_replicas_run import Phase, Settings, run_phase
from machine_info import machine
from procs import REPO
from results import git_state, write_json

from kvstack.bench.workloads import MultiRoundQA


def phases(quick: bool) -> list[Phase]:
    users, rounds = (8, 5) if quick else (20, 8)
    shape = {"user_history_len": 300, "question_len": 20, "answer_len": 32, "qps": 0.0}
    return [
        Phase(
            "sequential, shared system prompt",
            1,
            MultiRoundQA(num_users=users, num_rounds=rounds, system_prompt_len=300, seed=1, **shape),
        ),
        Phase(
            "sequential, no shared prompt",
            1,
            MultiRoundQA(num_users=users, num_rounds=rounds, system_prompt_len=0, seed=2, **shape),
        ),
        Phase(
            "sequential, no shared prompt, kv-aware (baseline)",
            1,
            MultiRoundQA(num_users=users, num_rounds=rounds, system_prompt_len=0, seed=2, **shape),
            routing="kv-aware",
        ),
        Phase(
            "8 users at once, shared system prompt",
            8,
            MultiRoundQA(num_users=2 * users, num_rounds=rounds, system_prompt_len=300, seed=3, **shape),
        ),
    ]


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def table(results: list[dict[str, Any]]) -> str:
    head = [
        "phase", "requests", "agreement (95% lower)", "first rounds", "disagreements by cause",
        "served as asked", "in-flight peak A/B", "largest A-B gap", "in-flight at end A/B",
        "prefix hit rate", "p50 latency",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        causes = ", ".join(f"{k} {v}" for k, v in sorted(r["causes"].items())) or "-"
        cells = [
            r["phase"],
            f"{r['requests']} ({r['errors']} errors)",
            f"{pct(r['agreement'])} ({pct(r['agreement_lower_95'])})",
            pct(r["agreement_first_rounds"]),
            causes,
            pct(r["served_where_a_replica_said"]),
            "/".join(str(v) for v in r["in_flight_peak"]),
            str(r["in_flight_gap_peak"]),
            "/".join(str(v) for v in r["in_flight_final"]),
            pct(r["prefix_hit_rate"]),
            "-" if r["latency_p50_s"] is None else f"{1000 * r['latency_p50_s']:.0f} ms",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer users and rounds")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "epp_replicas.json")
    args = parser.parse_args()
    command = shlex.join([".venvs/dev/bin/python", "benchmarks/epp_replicas.py", *sys.argv[1:]])
    info = machine()
    print(command, info, sep="\n", flush=True)
    logs = REPO / ".cache" / "bench" / "epp_replicas" / time.strftime("%Y%m%d-%H%M%S")
    settings = Settings()
    results = []
    for phase in phases(args.quick):
        t0 = time.monotonic()
        result = run_phase(phase, settings, logs)
        print(
            f"{phase.name}: {pct(result['agreement'])} agreement, {time.monotonic() - t0:.0f} s", flush=True
        )
        results.append(result)
    print(table(results))
    for r in results:
        print(f"{r['phase']}: engine shares {r['engine_shares']}, cpu {r['cpu_seconds']}")
        for d in r["disagreement_detail"]:
            where = f"{d['picks']} served {d['served']}"
            print(f"  request {d['index']} (round {d['round']}): {where}: {d['cause']}")
    write_json(
        args.out,
        {
            "command": command,
            "machine": info,
            "git": git_state(),
            "settings": vars(settings),
            "phases": results,
        },
    )
    print(f"JSON: {args.out}; logs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
