"""``kvstack bench``: seeded workloads, an open-loop streaming load runner, reports and plots.

Library use (what experiment scripts call)::

    result = await run_bench(BenchConfig(url=..., model=..., workload=MultiRoundQA(num_users=10)))
    write_report(result, "out/kvstack")
    compare({"kvstack": result, "round-robin": other}, "out/compare")

Client side only: it imports the SSE parser of ``kvstack.openai`` and the metric catalogs of
``kvstack.engines``, nothing of the router or the simulator.
"""

from kvstack.bench.records import BenchConfig, BenchResult, RequestRecord
from kvstack.bench.report import compare, load_result, print_summary, write_report
from kvstack.bench.runner import run_bench
from kvstack.bench.workloads import Conversation, LongDocQA, MultiRoundQA, SharedPrefix, Turn, Workload

__all__ = [
    "BenchConfig",
    "BenchResult",
    "Conversation",
    "LongDocQA",
    "MultiRoundQA",
    "RequestRecord",
    "SharedPrefix",
    "Turn",
    "Workload",
    "compare",
    "load_result",
    "print_summary",
    "run_bench",
    "write_report",
]
