"""`kvstack bench` runs against real simulated engines (``kvstack sim`` subprocesses): multi-round QA, the
completions API and a duration bound, failing requests, the engine named by a response header, and the
command line writing and comparing reports."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstack.bench import BenchConfig, LongDocQA, MultiRoundQA, SharedPrefix, run_bench, write_report
from kvstack.bench.cli import add_bench_parser
from kvstack.bench.cli import run_bench as run_bench_cli
from support.engines import EngineProcess, start_sim
from support.ports import free_port
from support.routers import fake_engine


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


@pytest.mark.parametrize(
    ("headers", "engine"),
    [
        ({"x-kvstack-engine": "http://10.0.0.1:8000"}, "http://10.0.0.1:8000"),
        ({"x-gateway-destination-endpoint-served": "10.0.0.2:8000"}, "10.0.0.2:8000"),
        (
            {
                "x-kvstack-engine": "http://10.0.0.1:8000",
                "x-gateway-destination-endpoint-served": "10.0.0.9:1",
            },
            "http://10.0.0.1:8000",
        ),
        ({}, None),
    ],
)
async def test_the_engine_that_served_comes_from_the_router_or_envoy_header(
    headers: dict[str, str], engine: str | None
) -> None:
    stream = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode()

    async def answer(writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" + head)
        writer.write(b"content-length: %d\r\n\r\n" % len(stream) + stream)
        return True

    workload = LongDocQA(documents=1, document_len=10, questions_per_document=1, answer_len=1, qps=0)
    async with fake_engine(answer) as url:
        (record,) = (await run_bench(BenchConfig(url=url, model="tiny", workload=workload))).records
    assert record.ok, record.error
    assert record.engine == engine


async def test_session_header_carries_each_turns_session() -> None:
    stream = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.I)
        await reader.readexactly(int(length.group(1)) if length else 0)
        heads.append(head.lower())
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n")
        writer.write(b"content-length: %d\r\n\r\n" % len(stream) + stream)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    workload = MultiRoundQA(
        num_users=3,
        num_rounds=2,
        system_prompt_len=4,
        user_history_len=4,
        question_len=2,
        answer_len=1,
        qps=0,
    )
    try:
        plain = await run_bench(BenchConfig(url=url, model="tiny", workload=workload))
        assert plain.summary["errors"] == 0 and not any(b"x-user-id" in h for h in heads)
        heads.clear()
        config = BenchConfig(url=url, model="tiny", workload=workload, session_header="x-user-id")
        result = await run_bench(config)
    finally:
        server.close()
    assert result.summary["errors"] == 0
    sent = sorted(re.search(rb"x-user-id: *(\d+)", h).group(1) for h in heads)  # type: ignore[union-attr]
    assert sent == [b"0", b"0", b"1", b"1", b"2", b"2"]


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
