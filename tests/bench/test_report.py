"""`kvstack bench` results: percentiles and summaries of known records, engine counters through the catalog
(legacy names too), the engine view, and the report and comparison files."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from kvstack.bench import BenchResult, RequestRecord, compare, load_result, write_report
from kvstack.bench.engine_view import EngineCounters, engine_view, read_counters
from kvstack.bench.summary import percentile, summarize
from kvstack.engines.catalog import catalog_for

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_percentiles_interpolate_linearly() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def _record(
    i: int, ttft: float | None, *, error: str | None = None, engine: str | None = None
) -> RequestRecord:
    r = RequestRecord(index=i, session=i, round=0, group=None, planned_s=i * 0.1, sent_s=i * 0.1 + 0.01)
    r.ttft, r.e2e, r.error, r.engine = ttft, (None if ttft is None else ttft + 0.5), error, engine
    r.itl.extend([0.01, 0.03])
    r.prompt_tokens, r.completion_tokens, r.cached_tokens = 100, 10, 40
    r.status = 500 if error else 200
    return r


def _known_result() -> BenchResult:
    records = [_record(i, ttft=(i + 1) / 100, engine=f"e{i % 2}") for i in range(10)]
    records.append(_record(10, None, error="HTTP 500: boom"))
    summary = summarize(records, elapsed_s=2.0, workload={"name": "known"})
    return BenchResult(summary=summary, records=records)


def test_summary_of_known_records() -> None:
    s = _known_result().summary
    assert (s["requests_sent"], s["requests_ok"], s["errors"]) == (11, 10, 1)
    assert s["ttft_s"]["count"] == 10 and s["ttft_s"]["p50"] == pytest.approx(0.055)
    assert s["ttft_s"]["p90"] == pytest.approx(0.091) and s["ttft_s"]["p99"] == pytest.approx(0.0991)
    assert s["itl_s"]["count"] == 20 and s["itl_s"]["p50"] == pytest.approx(0.02)
    assert s["e2e_s"]["p50"] == pytest.approx(0.555)
    assert s["send_lag_s"]["p50"] == pytest.approx(0.01)
    assert s["request_throughput"] == pytest.approx(5.0)
    assert s["output_tokens_per_s"] == pytest.approx(50.0)  # failed requests' tokens not counted
    assert s["client_cached_ratio"] == pytest.approx(0.4)
    assert s["engine"] is None  # no engine metrics read: unknown, not 0
    assert s["engine_header_counts"] == {"e0": 5, "e1": 5}
    assert s["error_kinds"] == {"HTTP 500: boom": 1}
    empty = summarize([], elapsed_s=0.0)
    assert empty["ttft_s"]["p50"] is None and empty["request_throughput"] is None
    assert empty["client_cached_ratio"] is None


def _metrics(queries: int, hits: int, success: dict[str, int], *, legacy: bool = False) -> str:
    prefix = "vllm:gpu_prefix_cache" if legacy else "vllm:prefix_cache"
    lines = [
        f"# TYPE {prefix}_queries counter",
        f'{prefix}_queries_total{{engine="0",model_name="m"}} {queries}.0',
        f'{prefix}_queries_created{{engine="0",model_name="m"}} 1.7e9',
        f"# TYPE {prefix}_hits counter",
        f'{prefix}_hits_total{{engine="0",model_name="m"}} {hits}.0',
        "# TYPE vllm:request_success counter",
    ]
    for reason, n in success.items():
        lines.append(
            f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="m"}} {n}.0'
        )
        lines.append(
            f'vllm:request_success_created{{engine="0",finished_reason="{reason}",model_name="m"}} 1.7e9'
        )
    return "\n".join(lines) + "\n"


def test_engine_counters_through_the_catalog_incl_legacy_names() -> None:
    catalog = catalog_for("vllm")
    current = read_counters("http://a", _metrics(1000, 400, {"stop": 3, "length": 2}), catalog)
    assert (current.prefix_queries, current.prefix_hits, current.requests) == (1000, 400, 5)
    assert current.notes == ()
    legacy = read_counters("http://b", _metrics(50, 5, {"length": 1}, legacy=True), catalog)
    assert (legacy.prefix_queries, legacy.prefix_hits, legacy.requests) == (50, 5, 1)
    assert any("found legacy vllm:gpu_prefix_cache_queries" in n for n in legacy.notes)
    bare = read_counters("http://c", "vllm:num_requests_running 1\n", catalog)
    assert (bare.prefix_queries, bare.prefix_hits, bare.requests) == (None, None, None)
    assert any("vllm:request_success_total" in n for n in bare.notes)
    junk = read_counters("http://d", "<html>oops</html>", catalog)
    assert junk.requests is None and "unreadable" in junk.notes[0]


def test_engine_view_hit_rate_load_share_and_unknowns() -> None:
    before = [EngineCounters("a", 100, 10, 2), EngineCounters("b", 0, 0, 0)]
    after = [EngineCounters("a", 1100, 610, 8), EngineCounters("b", 1000, 200, 2)]
    view = engine_view(before, after)
    assert view["prefix_hit_rate"] == pytest.approx(800 / 2000)
    assert [e["prefix_hit_rate"] for e in view["engines"]] == pytest.approx([0.6, 0.2])
    assert [e["load_share"] for e in view["engines"]] == pytest.approx([0.75, 0.25])
    assert view["load_share_max_over_mean"] == pytest.approx(1.5)
    # One engine without a request counter, one restarted: unknown, never 0.
    missing = engine_view(before, [after[0], EngineCounters("b", 1000, 200, None)])
    assert missing["requests"] is None and missing["load_share_max_over_mean"] is None
    assert all(e["load_share"] is None for e in missing["engines"])
    assert missing["prefix_hit_rate"] == pytest.approx(0.4)
    restarted = engine_view(before, [EngineCounters("a", 5, 1, 1), after[1]])
    assert restarted["prefix_hit_rate"] is None and restarted["engines"][0]["requests"] is None
    assert any("went backwards" in n for n in restarted["engines"][0]["notes"])


def test_report_files_and_comparison(tmp_path: Path) -> None:
    result = _known_result()
    paths = write_report(result, tmp_path / "run")
    assert {p.name for p in paths} == {
        "requests.csv",
        "summary.json",
        "ttft_cdf.png",
        "ttft_over_time.png",
        "load_share.png",
    }
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG_MAGIC
    with (tmp_path / "run" / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 11 and rows[0]["ttft_s"] == "0.010000" and rows[10]["error"] == "HTTP 500: boom"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["engine"] is None and summary["ttft_s"]["p50"] == pytest.approx(0.055)
    loaded = load_result(tmp_path / "run")
    assert [r.ttft for r in loaded.records] == [r.ttft for r in result.records]
    assert loaded.records[10].error == "HTTP 500: boom" and loaded.records[10].status == 500

    slower = BenchResult(
        summary=summarize(
            [_record(i, ttft=(i + 1) / 50) for i in range(10)], elapsed_s=2.0, workload={"name": "known"}
        ),
        records=[_record(i, ttft=(i + 1) / 50) for i in range(10)],
    )
    out = io.StringIO()
    console = Console(file=out, width=200)
    table = compare({"fast": result, "slow": slower, "saved": loaded}, tmp_path / "cmp", console=console)
    assert [c.header for c in table.columns] == ["metric", "fast", "slow", "saved"]
    printed = out.getvalue()
    ratio_line = next(line for line in printed.splitlines() if "TTFT p50 / fast" in line)
    assert ratio_line.split()[-6:] == ["1.00x", "│", "2.00x", "│", "1.00x", "│"]
    assert (tmp_path / "cmp" / "compare_ttft_cdf.png").read_bytes()[:8] == PNG_MAGIC
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert doc["baseline"] == "fast" and set(doc["summaries"]) == {"fast", "slow", "saved"}
    with pytest.raises(ValueError, match="baseline"):
        compare({"fast": result}, baseline="nope")
