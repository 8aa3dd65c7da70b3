"""`kvstack bench`: seeded workloads, summary statistics, engine counters, report files, and runs against
real simulated engines (``kvstack sim`` subprocesses): multi-round QA, bounds, and failing requests."""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rich.console import Console

from kvstack.bench import (
    BenchConfig,
    BenchResult,
    Conversation,
    LongDocQA,
    MultiRoundQA,
    RequestRecord,
    SharedPrefix,
    compare,
    load_result,
    run_bench,
    write_report,
)
from kvstack.bench.cli import add_bench_parser
from kvstack.bench.cli import run_bench as run_bench_cli
from kvstack.bench.engine_view import EngineCounters, engine_view, read_counters
from kvstack.bench.summary import percentile, summarize
from kvstack.bench.workloads import arrival_times
from kvstack.engines.catalog import catalog_for
from support.engines import EngineProcess, start_sim
from support.ports import free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- workloads ---------------------------------------------------------------------------------------


def _some(workload: MultiRoundQA | SharedPrefix | LongDocQA, n: int = 40) -> list[tuple[float, str]]:
    return [(t.arrival, t.text) for t in itertools.islice(workload.turns(), n)]


Make = Callable[[int], MultiRoundQA | SharedPrefix | LongDocQA]


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: MultiRoundQA(
            num_users=4, num_rounds=3, system_prompt_len=30, user_history_len=20, seed=seed
        ),
        lambda seed: SharedPrefix(groups=3, prefix_len=20, suffix_len=5, zipf=1.1, seed=seed),
        lambda seed: LongDocQA(documents=3, document_len=50, questions_per_document=2, seed=seed),
    ],
    ids=["multi-round-qa", "shared-prefix", "long-doc-qa"],
)
def test_same_seed_same_prompts_and_arrivals_other_seed_differs(make: Make) -> None:
    first, again, other = _some(make(7)), _some(make(7)), _some(make(8))
    assert first == again
    assert [a for a, _ in first] != [a for a, _ in other]
    assert [t for _, t in first] != [t for _, t in other]


def test_arrival_processes() -> None:
    import random

    uniform = list(itertools.islice(arrival_times(4.0, "uniform", random.Random(0)), 5))
    assert uniform == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    poisson = list(itertools.islice(arrival_times(10.0, "poisson", random.Random(0)), 4001))
    assert poisson[-1] / 4000 == pytest.approx(0.1, rel=0.1)
    assert len({round(b - a, 9) for a, b in itertools.pairwise(poisson)}) > 100  # not evenly spaced
    assert list(itertools.islice(arrival_times(0, "poisson", random.Random(0)), 3)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="arrival"):
        next(arrival_times(1.0, "bursty", random.Random(0)))  # type: ignore[arg-type]  # unknown on purpose


def test_multi_round_users_start_staggered_and_round_zero_carries_the_context() -> None:
    wl = MultiRoundQA(num_users=3, num_rounds=2, system_prompt_len=12, user_history_len=10, question_len=4)
    turns = list(wl.turns())
    assert wl.size == len(turns) == 6
    assert [(t.session, t.round, t.last) for t in turns] == [
        (0, 0, False),
        (1, 0, False),
        (2, 0, False),
        (0, 1, True),
        (1, 1, True),
        (2, 1, True),
    ]
    assert [t.arrival for t in turns] == sorted(t.arrival for t in turns)
    system = wl.system_prompt()
    assert system is not None and len(system.split()) == 12
    first = [t for t in turns if t.round == 0]
    assert all(t.system == system for t in first)  # one system prompt shared by every user
    assert len({t.text.split("\n\n")[0] for t in first}) == 3  # each user has its own history
    assert all(len(t.text.split()) == 14 for t in first)  # history 10 words + question 4
    later = [t for t in turns if t.round == 1]
    assert all(t.system is None and len(t.text.split()) == 4 for t in later)


def test_conversation_grows_with_the_answers_received() -> None:
    conv = Conversation(system="be brief")
    conv.ask("history and first question")
    round1 = conv.prompt()
    conv.answer("the first answer")
    conv.ask("second question")
    round2 = conv.prompt()
    assert round2.startswith(round1 + "the first answer")  # a later prompt extends the earlier one
    assert conv.messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "history and first question"},
        {"role": "assistant", "content": "the first answer"},
        {"role": "user", "content": "second question"},
    ]
    with pytest.raises(ValueError, match="no answer yet"):
        conv.ask("a third question before the second answer")
    conv.answer("")
    with pytest.raises(ValueError, match="no question"):
        conv.answer("unasked")


def test_shared_prefix_groups_uniform_and_zipf() -> None:
    def counts(wl: SharedPrefix, n: int = 4000) -> list[int]:
        c = Counter(t.group for t in itertools.islice(wl.turns(), n))
        return [c[g] for g in range(wl.groups)]

    uniform = counts(SharedPrefix(groups=4, prefix_len=5, suffix_len=2, qps=0))
    assert all(abs(c / 4000 - 0.25) < 0.03 for c in uniform)
    zipf = SharedPrefix(groups=4, prefix_len=5, suffix_len=2, zipf=1.2, qps=0)
    weights = zipf.group_weights()
    assert weights == sorted(weights, reverse=True) and weights[0] / weights[1] == pytest.approx(2**1.2)
    observed = counts(zipf)
    assert observed == sorted(observed, reverse=True)
    assert all(abs(c / 4000 - w) < 0.03 for c, w in zip(observed, weights, strict=True))
    # Requests of one group share its prefix exactly and differ in the suffix.
    same = [t.text for t in itertools.islice(zipf.turns(), 50) if t.group == 0][:2]
    assert same[0].split("\n\n")[0] == same[1].split("\n\n")[0] and same[0] != same[1]


def test_long_doc_questions_interleave_documents() -> None:
    wl = LongDocQA(documents=3, document_len=40, questions_per_document=2, question_len=3)
    turns = list(wl.turns())
    assert [t.group for t in turns] == [0, 1, 2, 0, 1, 2]
    docs = [t.text.split("\n\n")[0] for t in turns]
    assert docs[0] == docs[3] and docs[0] != docs[1] and len(docs[0].split()) == 40
    assert turns[0].text != turns[3].text  # another question on the same document


def test_endless_workload_needs_a_bound() -> None:
    config = BenchConfig(url="http://127.0.0.1:9", model="m", workload=SharedPrefix())
    with pytest.raises(ValueError, match="--max-requests"):
        config.validate()
    config.duration = 5.0
    assert config.validate().planned_requests is None


# --- summary, engine counters, report files ---------------------------------------------------------


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


# --- against real simulated engines ------------------------------------------------------------------


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    """Two engines with 16-token blocks: one exporting current metric names, one only the legacy names."""
    workdir = tmp_path_factory.mktemp("bench-sim")
    current = start_sim(workdir, block_size=16, num_gpu_blocks=2048, replay=False)
    try:
        legacy = start_sim(
            workdir, block_size=16, num_gpu_blocks=2048, replay=False, extra_args=["--legacy-metric-names"]
        )
    except Exception:
        current.stop()
        raise
    yield current, legacy
    legacy.stop()
    current.stop()


async def test_multi_round_qa_against_a_simulated_engine(
    sims: tuple[EngineProcess, EngineProcess], tmp_path: Path
) -> None:
    current, legacy = sims
    workload = MultiRoundQA(
        num_users=3,
        num_rounds=3,
        system_prompt_len=64,
        user_history_len=48,
        question_len=8,
        answer_len=8,
        qps=30,
        seed=3,
    )
    config = BenchConfig(
        url=current.url, model="tiny", workload=workload, engine_metrics=(current.url, legacy.url)
    )
    result = await run_bench(config)
    records = result.records
    assert len(records) == 9 and all(r.ok for r in records), [r.error for r in records]
    assert all(r.ttft is not None and r.ttft > 0 and r.completion_tokens == 8 for r in records)
    assert all(len(r.itl) >= 1 for r in records)
    # Each round's prompt holds the previous prompt, the answer received and a new question.
    for user in range(3):
        rounds = sorted((r for r in records if r.session == user), key=lambda r: r.round)
        assert [r.round for r in rounds] == [0, 1, 2]
        for prev, nxt in itertools.pairwise(rounds):
            assert prev.prompt_tokens is not None and prev.completion_tokens is not None
            assert nxt.prompt_tokens is not None
            assert nxt.prompt_tokens >= prev.prompt_tokens + prev.completion_tokens + 8
            assert nxt.sent_s >= prev.sent_s + (prev.e2e or 0)  # sent after the answer arrived
            assert nxt.cached_tokens is not None and nxt.cached_tokens >= prev.prompt_tokens // 16 * 16 - 16
    s = result.summary
    engine = s["engine"]
    assert engine["prefix_hit_rate"] > 0.3, engine
    a, b = engine["engines"]
    assert (a["requests"], a["load_share"]) == (9, 1.0)
    assert (b["requests"], b["load_share"], b["prefix_queries"]) == (0, 0.0, 0)
    assert b["prefix_hit_rate"] is None  # no queries: unknown, not 0
    assert any("found legacy vllm:gpu_prefix_cache_queries" in n for n in b["notes"])
    assert engine["load_share_max_over_mean"] == pytest.approx(2.0)
    assert s["client_cached_ratio"] > 0.3
    paths = write_report(result, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)


async def test_completions_api_and_the_duration_bound(sims: tuple[EngineProcess, EngineProcess]) -> None:
    current, _ = sims
    workload = SharedPrefix(groups=2, prefix_len=40, suffix_len=6, answer_len=4, qps=25, arrival="uniform")
    config = BenchConfig(
        url=f"{current.url}/v1", model="tiny", workload=workload, api="completions", duration=0.4
    )
    result = await run_bench(config)
    assert len(result.records) + result.summary["not_sent"] == 10  # planned at 0, 0.04, ..., 0.36
    assert all(r.ok and r.completion_tokens == 4 for r in result.records)
    assert all(r.sent_s < 0.4 for r in result.records)


async def test_failed_requests_are_recorded_and_the_run_finishes(
    sims: tuple[EngineProcess, EngineProcess],
) -> None:
    current, legacy = sims
    workload = LongDocQA(documents=2, document_len=30, questions_per_document=2, answer_len=8, qps=0)
    wrong_model = await run_bench(BenchConfig(url=current.url, model="no-such-model", workload=workload))
    assert len(wrong_model.records) == 4 and wrong_model.summary["errors"] == 4
    assert all(r.status == 404 and r.ttft is None for r in wrong_model.records)
    assert all(
        "HTTP 404" in (r.error or "") and "no-such-model" in (r.error or "") for r in wrong_model.records
    )
    assert wrong_model.summary["ttft_s"]["p50"] is None

    refused = await run_bench(
        BenchConfig(url=f"http://127.0.0.1:{free_port()}", model="tiny", workload=workload)
    )
    assert refused.summary["errors"] == 4 and all(r.status is None for r in refused.records)

    # Streams cut after the first content chunk: TTFT is known, the request still failed.
    _faults(legacy.url, "POST", {"drop_rate": 1.0, "drop_after_chunks": 2})
    try:
        dropped = await run_bench(BenchConfig(url=legacy.url, model="tiny", workload=workload))
    finally:
        _faults(legacy.url, "DELETE")
    assert dropped.summary["errors"] == 4
    assert all(r.status == 200 and r.ttft is not None and r.error for r in dropped.records)


def _faults(url: str, method: str, body: dict[str, float] | None = None) -> None:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"{url}/admin/faults", data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvstack")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_cli_runs_writes_a_report_and_compares(
    sims: tuple[EngineProcess, EngineProcess], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    current, _ = sims
    server = ["--url", current.url, "--answer-len", "4", "--quiet"]
    docs = [
        "long-doc-qa",
        "--documents",
        "2",
        "--questions-per-document",
        "2",
        "--document-len",
        "40",
        "--qps",
        "0",
    ]
    args = _parse(*docs, *server, "--model", "tiny", "--out", str(tmp_path / "a"))
    assert (args.bench_command, args.documents, args.model) == ("long-doc-qa", 2, "tiny")
    assert run_bench_cli(args) == 0
    assert (tmp_path / "a" / "summary.json").exists()
    # Every request failed: exit status 1, the report is still written.
    assert run_bench_cli(_parse(*docs, *server, "--model", "nope", "--out", str(tmp_path / "b"))) == 1
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["errors"] == 4
    assert run_bench_cli(_parse("shared-prefix", *server, "--model", "tiny")) == 2
    assert "--max-requests" in capsys.readouterr().err
    assert run_bench_cli(_parse("compare", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}")) == 0
    assert "TTFT p50 / a" in capsys.readouterr().out
    assert run_bench_cli(_parse("compare", "no-equals-sign")) == 2
