"""The load runner: sends a workload's turns as streaming OpenAI requests, open loop, and records each one.

Every turn is sent at its planned arrival time, or later when its session's previous round has not been
answered yet or ``max_concurrency`` requests are already in flight; the difference is the record's send
lag. Requests stream (``"stream": true`` with ``stream_options.include_usage``) and are timed on the
client: TTFT from sending to the first chunk with content, one inter-token latency per later content chunk
(chunks read together share a timestamp, so a coalesced read shows gaps of 0), end-to-end to the end of
the stream. Usage gives prompt, completion and cached tokens (``usage.prompt_tokens_details``); a response
header names the engine that served (``ENGINE_HEADERS``), when the server sets one. With
``session_header`` set, each request carries its session number in that header.

A failure never stops the run: an HTTP error, an in-stream error event, a stream cut before
``data: [DONE]``, a timeout or a refused connection is recorded as the request's ``error``. Only records
and the conversations of sessions still running are kept; response text is kept only as a next round's
context.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import msgspec
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kvstack.bench.engine_view import EngineCounters, engine_view, fetch_counters
from kvstack.bench.records import BenchConfig, BenchResult, RequestRecord
from kvstack.bench.summary import summarize
from kvstack.bench.workloads import Conversation, Turn
from kvstack.engines.catalog import MetricCatalog, catalog_for
from kvstack.openai.sse import DONE_PAYLOAD, SSEParser

__all__ = ["run_bench"]

# The response header naming the engine that served: kvstack's router sets the first, Envoy in front of
# kvstack's endpoint picker the second (kvstack.epp.envoy_config's served_header).
ENGINE_HEADERS = ("x-kvstack-engine", "x-gateway-destination-endpoint-served")
# Turns planned but not finished, at most: an endless workload at a rate the server cannot follow queues
# at the client up to here, then planning waits (the growing send lag shows it).
_MAX_OUTSTANDING = 10_000
_ERROR_BODY_BYTES = 4096


async def run_bench(config: BenchConfig) -> BenchResult:
    """Run ``config``'s workload against its server; read engine metrics before and after."""
    config.validate()
    catalog = catalog_for(config.engine_type, config.engine_version)
    connector = aiohttp.TCPConnector(
        limit=config.max_concurrency + len(config.engine_metrics), force_close=False
    )
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        before = await _read_engines(http, config, catalog)
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        run = _Run(config, http)
        async with _progress(config) as progress:
            run.progress = progress
            await run.run()
        elapsed = run.elapsed()
        if config.engine_metrics:
            # An engine may count a finished request just after its last chunk went out.
            await asyncio.sleep(config.metrics_settle_s)
        after = await _read_engines(http, config, catalog)
    records = sorted(run.records, key=lambda r: r.index)
    summary = summarize(
        records,
        elapsed_s=elapsed,
        not_sent=run.not_sent,
        engine=engine_view(before, after) if config.engine_metrics else None,
        workload=config.workload.describe(),
        config=config.describe(),
    )
    summary["started_at"] = started_at
    return BenchResult(summary=summary, records=records, config=config)


async def _read_engines(
    http: aiohttp.ClientSession, config: BenchConfig, catalog: MetricCatalog
) -> list[EngineCounters]:
    return list(await asyncio.gather(*(fetch_counters(http, url, catalog) for url in config.engine_metrics)))


class _LiveProgress:
    """The rich progress bar: requests done of planned, errors, TTFT p50 so far."""

    def __init__(self, progress: Progress, name: str, total: int | None) -> None:
        self._progress = progress
        self._task: TaskID = progress.add_task(name, total=total, errors=0, ttft="-")
        self._ttfts: list[float] = []
        self._errors = 0
        self._shown_at = 0.0

    def done(self, record: RequestRecord) -> None:
        if record.ok and record.ttft is not None:
            self._ttfts.append(record.ttft)
        self._errors += not record.ok
        now = time.monotonic()
        fields: dict[str, Any] = {"errors": self._errors}
        if self._ttfts and now - self._shown_at > 0.5:  # a median per response would cost O(n log n) each
            self._shown_at = now
            fields["ttft"] = f"{statistics.median(self._ttfts) * 1000:.0f} ms"
        self._progress.update(self._task, advance=1, **fields)


@contextlib.asynccontextmanager
async def _progress(config: BenchConfig) -> AsyncIterator[_LiveProgress | None]:
    if not config.progress:
        yield None
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("errors {task.fields[errors]}"),
        TextColumn("TTFT p50 {task.fields[ttft]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns) as progress:
        yield _LiveProgress(progress, config.workload.name, config.planned_requests)


def _endpoint(url: str, api: str) -> str:
    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return f"{base}/chat/completions" if api == "chat" else f"{base}/completions"


class _Run:
    """One run's state: the clock, the concurrency slots, the sessions still talking, the records."""

    def __init__(self, config: BenchConfig, http: aiohttp.ClientSession) -> None:
        self.config = config
        self.http = http
        self.endpoint = _endpoint(config.url, config.api)
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.slots = asyncio.Semaphore(config.max_concurrency)
        self.conversations: dict[int, Conversation] = {}
        self.records: list[RequestRecord] = []
        self.not_sent = 0
        self.progress: _LiveProgress | None = None
        self._t0 = time.perf_counter()
        self._last_end = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def elapsed(self) -> float:
        return self._last_end

    def _turns(self) -> Iterator[Turn]:
        turns = self.config.workload.turns()
        if self.config.max_requests is not None:
            turns = itertools.islice(turns, self.config.max_requests)
        return turns

    async def run(self) -> None:
        self._t0 = time.perf_counter()
        duration = self.config.duration
        tails: dict[int, asyncio.Task[None]] = {}  # session → the task of its latest round
        outstanding: set[asyncio.Task[None]] = set()
        for turn in self._turns():
            if duration is not None and turn.arrival >= duration:
                break
            if len(outstanding) >= _MAX_OUTSTANDING:
                await asyncio.wait(outstanding, return_when=asyncio.FIRST_COMPLETED)
            delay = turn.arrival - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            previous = tails.pop(turn.session, None)
            task = asyncio.create_task(self._turn(turn, previous))
            if not turn.last:
                tails[turn.session] = task
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
        if outstanding:
            await asyncio.gather(*outstanding)

    async def _turn(self, turn: Turn, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await previous
        conv = self.conversations.setdefault(turn.session, Conversation(system=turn.system))
        try:
            async with self.slots:
                if self.config.duration is not None and self.now() >= self.config.duration:
                    self.not_sent += 1
                    return
                conv.ask(turn.text)
                answer: list[str] | None = None if turn.last else []
                record = await self._send(turn, conv, answer)
                # A failed round stays with an empty answer, so that the session keeps its context.
                conv.answer("".join(answer) if answer is not None and record.ok else "")
        finally:
            if turn.last:
                self.conversations.pop(turn.session, None)
        self._finished(record)

    def _finished(self, record: RequestRecord) -> None:
        self.records.append(record)
        self._last_end = max(self._last_end, record.sent_s + (record.e2e or 0.0))
        if self.progress is not None:
            self.progress.done(record)

    def _body(self, turn: Turn, conv: Conversation) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.config.model}
        if self.config.api == "chat":
            body["messages"] = conv.messages()
        else:
            body["prompt"] = conv.prompt()
        body.update(max_tokens=turn.max_tokens, stream=True, stream_options={"include_usage": True})
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        return body

    def _headers(self, turn: Turn) -> dict[str, str]:
        if self.config.session_header is None:
            return self.headers
        return {**self.headers, self.config.session_header: str(turn.session)}

    async def _send(self, turn: Turn, conv: Conversation, answer: list[str] | None) -> RequestRecord:
        """Send one streaming request; every failure becomes the record's error."""
        body = self._body(turn, conv)
        record = RequestRecord(
            index=turn.index,
            session=turn.session,
            round=turn.round,
            group=turn.group,
            planned_s=turn.arrival,
            sent_s=self.now(),
        )
        start = time.perf_counter()
        timeout = self.config.request_timeout
        try:
            async with (
                asyncio.timeout(timeout),
                self.http.post(self.endpoint, json=body, headers=self._headers(turn)) as resp,
            ):
                record.status = resp.status
                record.engine = next(filter(None, map(resp.headers.get, ENGINE_HEADERS)), None)
                if resp.status != 200:
                    record.error = _http_error(resp.status, await _read_some(resp.content))
                else:
                    await _read_stream(resp.content, record, start, answer)
        except TimeoutError:
            record.error = f"timeout after {timeout:g}s"
        except (aiohttp.ClientError, OSError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        except (ValueError, msgspec.DecodeError) as exc:  # not SSE, not JSON
            record.error = f"bad stream: {exc}"
        record.e2e = time.perf_counter() - start
        return record


async def _read_some(content: aiohttp.StreamReader) -> bytes:
    buf = b""
    while len(buf) < _ERROR_BODY_BYTES and (piece := await content.read(_ERROR_BODY_BYTES - len(buf))):
        buf += piece
    return buf


_decode = msgspec.json.Decoder().decode


def _error_message(obj: Any) -> str | None:
    """The message of an OpenAI-shaped error body (or FastAPI's ``detail``), if it is one."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error", obj)
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str):
        return err
    return str(obj["detail"]) if "detail" in obj else None


def _http_error(status: int, body: bytes) -> str:
    try:
        message = _error_message(_decode(body))
    except msgspec.DecodeError:
        message = None
    text = message or body.decode(errors="replace").strip() or "(empty body)"
    return f"HTTP {status}: {text[:300]}"


def _content(event: dict[str, Any]) -> str:
    """The generated text a chat or completion chunk carries."""
    out = ""
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(text, str):
            out += text
    return out


def _usage(event: dict[str, Any], record: RequestRecord) -> None:
    usage = event.get("usage")
    if not isinstance(usage, dict):
        return
    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
    record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        record.cached_tokens = details["cached_tokens"]


async def _read_stream(
    content: aiohttp.StreamReader, record: RequestRecord, start: float, answer: list[str] | None
) -> None:
    parser = SSEParser()
    done = False
    last = start
    async for chunk in content.iter_any():
        now = time.perf_counter()
        for payload in parser.feed(chunk):
            if payload == DONE_PAYLOAD:
                done = True
                continue
            event = _decode(payload)
            if not isinstance(event, dict):
                continue
            if "error" in event:
                record.error = f"in-stream error: {_error_message(event) or event['error']}"[:300]
                continue
            text = _content(event)
            if text:
                if record.ttft is None:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last)
                last = now
                if answer is not None:
                    answer.append(text)
            _usage(event, record)
    if not done and record.error is None:
        record.error = "stream ended without data: [DONE]" + (" (mid-event)" if parser.has_partial else "")
