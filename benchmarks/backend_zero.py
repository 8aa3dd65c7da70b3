"""A zero-delay OpenAI backend for router benchmarks: answers at once, so a router's overhead is what is left.

Raw asyncio protocol on uvloop, HTTP/1.1 keep-alive, no framework: one process answers tens of thousands of
small requests per second, and ``--procs N`` runs N processes on one port (SO_REUSEPORT) when one is not
enough. What it answers:

- ``POST /v1/completions`` and ``/v1/chat/completions``: a fixed vLLM-shaped JSON body; with ``"stream":
  true`` in the body, a fixed stream of ``--chunks`` (default 64) SSE token events, then ``data: [DONE]``.
  Each event is its own HTTP chunk and its own socket write, and the writes are spread over event-loop
  turns (``call_soon``), so a router sees a stream arriving in pieces, not one buffer; there is no timer
  between them (zero delay).
- ``POST /v1/completions/render``, ``/v1/chat/completions/render`` and ``/tokenize``: fixed token ids in
  vLLM's shapes, so a router that tokenizes through the engine (vllm-router's ``cache_aware`` and
  ``kv_aware`` policies) makes the calls it would make against vLLM, not extra fallback calls;
- ``GET /v1/models`` (the served model), ``/health``, ``/version``, and the ``/get_server_info``,
  ``/server_info``, ``/get_model_info``, ``/model_info`` probes that SGLang-style routers send;
- ``GET /metrics``: a minimal vLLM 0.10+ exposition (``vllm:num_requests_running`` = streams in progress,
  waiting 0, KV usage 0, prefix-cache counters, ``vllm:cache_config_info``), so that routers reading vLLM
  metrics see an idle engine, not a missing one; plus ``backend_zero_requests_total{method,path}``, the
  requests every process has answered, so a benchmark can check that a router sends exactly one upstream
  request per client request (and see any extra calls such as ``/tokenize``).

Anything else is 404. The body is not parsed beyond looking for ``"stream": true``; the model name is not
checked. ``--log-paths`` prints each distinct (method, path) once, to see what a router probes.

    .venvs/dev/bin/python benchmarks/backend_zero.py --port 9000 [--procs 2] [--chunks 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import re
import signal
import socket
import sys
import time
from typing import cast

HOST = "127.0.0.1"
MODEL = "zero"
CREATED = 1_700_000_000
# "stream": true with any spacing; false, absent or inside a string value all read as not streaming.
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')


def _compact(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def completion_body(chat: bool) -> bytes:
    """A fixed non-streaming response, shaped like vLLM's (16 tokens of output)."""
    usage = {"prompt_tokens": 8, "total_tokens": 24, "completion_tokens": 16}
    if chat:
        choice: dict[str, object] = {
            "index": 0,
            "message": {"role": "assistant", "content": " tok" * 16},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
        kind, rid = "chat.completion", "chatcmpl-zero"
    else:
        choice = {"index": 0, "text": " tok" * 16, "logprobs": None, "finish_reason": "length"}
        choice["stop_reason"] = None
        kind, rid = "text_completion", "cmpl-zero"
    return _compact(
        {"id": rid, "object": kind, "created": CREATED, "model": MODEL, "choices": [choice], "usage": usage}
    )


def stream_frames(chat: bool, chunks: int) -> list[bytes]:
    """The HTTP chunks of a streaming response: ``chunks`` token events, then ``data: [DONE]``, then EOF."""
    events = []
    for i in range(chunks):
        last = i == chunks - 1
        if chat:
            delta: dict[str, object] = {"content": " tok"}
            if i == 0:
                delta["role"] = "assistant"
            choice: dict[str, object] = {"index": 0, "delta": delta, "logprobs": None}
            kind, rid = "chat.completion.chunk", "chatcmpl-zero"
        else:
            choice = {"index": 0, "text": " tok", "logprobs": None}
            kind, rid = "text_completion", "cmpl-zero"
        choice["finish_reason"] = "length" if last else None
        choice["stop_reason"] = None
        obj = {"id": rid, "object": kind, "created": CREATED, "model": MODEL, "choices": [choice]}
        events.append(b"data: " + _compact(obj) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    frames = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
    frames.append(b"0\r\n\r\n")
    return frames


def _head(status: str, content_type: bytes, length: int | None) -> bytes:
    size = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type + b"\r\n" + size + b"\r\n\r\n"
    )


def _fixed(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return _head("200 OK", content_type, len(body)) + body


# Requests counted by (method, path); anything else counts as "other".
COUNTED: tuple[tuple[bytes, bytes], ...] = (
    (b"POST", b"/v1/completions"),
    (b"POST", b"/v1/chat/completions"),
    (b"POST", b"/tokenize"),
    (b"POST", b"/v1/completions/render"),
    (b"POST", b"/v1/chat/completions/render"),
    (b"GET", b"/metrics"),
    (b"GET", b"/health"),
    (b"GET", b"/v1/models"),
)
_OTHER = len(COUNTED)
_RUNNING = _OTHER + 1
_ROW = _RUNNING + 1
_INDEX = {key: i for i, key in enumerate(COUNTED)}


class SharedCounts:
    """Request counts and streams in progress of all processes, in one anonymous shared mapping.

    Created before the fork; each process adds only to its own row (no locks), /metrics sums the rows.
    """

    def __init__(self, procs: int) -> None:
        self._mem = mmap.mmap(-1, procs * _ROW * 8)
        self._cells = memoryview(self._mem).cast("Q")
        self._procs = procs
        self._base = 0

    def use_row(self, row: int) -> None:
        self._base = row * _ROW

    def count(self, method: bytes, path: bytes) -> None:
        self._cells[self._base + _INDEX.get((method, path), _OTHER)] += 1

    def stream_started(self) -> None:
        self._cells[self._base + _RUNNING] += 1

    def stream_ended(self) -> None:
        self._cells[self._base + _RUNNING] -= 1

    def totals(self) -> list[int]:
        """Per column, summed over the processes: COUNTED..., other, running."""
        cells = self._cells
        return [sum(cells[r * _ROW + c] for r in range(self._procs)) for c in range(_ROW)]


class Responses:
    """Every response, encoded once at start-up."""

    def __init__(self, chunks: int, counts: SharedCounts) -> None:
        self.counts = counts
        # No model_path or tokenizer_path: sglang-router would try to fetch a tokenizer by that name from the
        # Hugging Face hub (no network here); without them it skips tokenizer registration.
        info = _compact({"served_model_name": MODEL, "is_generation": True})
        models = _compact(
            {
                "object": "list",
                "data": [
                    {"id": MODEL, "object": "model", "created": CREATED, "owned_by": "vllm", "root": MODEL}
                ],
            }
        )
        self.get = {
            b"/v1/models": _fixed(models),
            b"/health": _fixed(b""),
            b"/version": _fixed(b'{"version":"0.32.0"}'),
            b"/get_server_info": _fixed(info),
            b"/server_info": _fixed(info),
            b"/get_model_info": _fixed(info),
            b"/model_info": _fixed(info),
        }
        ids = list(range(100, 122))
        rendered = {
            "request_id": "cmpl-zero",
            "token_ids": ids,
            "sampling_params": {"temperature": 1.0, "max_tokens": 64},
            "model": MODEL,
            "stream": False,
        }
        self.post = {
            b"/v1/completions/render": _fixed(_compact([rendered])),
            b"/v1/chat/completions/render": _fixed(_compact({**rendered, "request_id": "chatcmpl-zero"})),
            b"/tokenize": _fixed(
                _compact({"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None})
            ),
        }
        self.complete = {False: _fixed(completion_body(False)), True: _fixed(completion_body(True))}
        sse_head = _head("200 OK", b"text/event-stream; charset=utf-8", None)
        self.stream = {chat: (sse_head, stream_frames(chat, chunks)) for chat in (False, True)}
        self.not_found = _head("404 Not Found", b"application/json", 26) + b'{"error":"no such route."}'

    def metrics(self) -> bytes:
        totals = self.counts.totals()
        running = totals[_RUNNING]
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{MODEL}",engine="0"}} {running}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{MODEL}",engine="0"}} 0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}",engine="0"}} 0.0\n'
            "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{model_name="{MODEL}",engine="0"}} 0\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            f'vllm:prefix_cache_hits_total{{model_name="{MODEL}",engine="0"}} 0\n'
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="8192"} 1.0\n'
            "# TYPE backend_zero_requests counter\n"
        )
        for (method, path), n in zip((*COUNTED, (b"*", b"other")), totals, strict=False):
            text += f'backend_zero_requests_total{{method="{method.decode()}",path="{path.decode()}"}} {n}\n'
        return _fixed(text.encode(), b"text/plain; version=0.0.4; charset=utf-8")


class ZeroProtocol(asyncio.Protocol):
    """One keep-alive connection; requests are answered in order (a stream holds back the next one)."""

    def __init__(self, responses: Responses, seen: set[tuple[bytes, bytes]] | None) -> None:
        self.r = responses
        self.seen = seen
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.streaming = False
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.streaming:
            self._serve_buffered()

    def _serve_buffered(self) -> None:
        buf = self.buf
        while self.transport is not None and not self.streaming:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    self.transport.close()  # not HTTP, or headers without end
                return
            head = bytes(buf[:end])
            length = 0
            lower = head.lower()
            at = lower.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = lower.find(b"\r\n", at + 2)
                length = int(lower[at + 17 : stop if stop >= 0 else None])
            total = end + 4 + length
            if len(buf) < total:
                return
            body = bytes(buf[end + 4 : total])
            del buf[:total]
            method, _, rest = head.partition(b" ")
            path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
            self._answer(method, path, body)

    def _answer(self, method: bytes, path: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.r.counts.count(method, path)
        if self.seen is not None and (method, path) not in self.seen:
            self.seen.add((method, path))
            print(f"backend_zero[{os.getpid()}]: {method.decode()} {path.decode()}", flush=True)
        if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
            chat = path == b"/v1/chat/completions"
            if _STREAM_TRUE.search(body):
                head, frames = self.r.stream[chat]
                self.transport.write(head)
                self.streaming = True
                self.r.counts.stream_started()
                self.loop.call_soon(self._stream_step, frames, 0)
            else:
                self.transport.write(self.r.complete[chat])
        elif method == b"POST" and path in self.r.post:
            self.transport.write(self.r.post[path])
        elif method == b"GET" and path == b"/metrics":
            self.transport.write(self.r.metrics())
        elif method == b"GET" and path in self.r.get:
            self.transport.write(self.r.get[path])
        else:
            self.transport.write(self.r.not_found)

    def _stream_step(self, frames: list[bytes], i: int) -> None:
        """Write one frame, then let the loop turn before the next: the router reads the stream in pieces."""
        if self.transport is None or self.transport.is_closing():
            self.r.counts.stream_ended()
            self.streaming = False
            return
        self.transport.write(frames[i])
        if i + 1 < len(frames):
            self.loop.call_soon(self._stream_step, frames, i + 1)
            return
        self.r.counts.stream_ended()
        self.streaming = False
        if self.buf:
            self._serve_buffered()


def listen(port: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((HOST, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


async def serve(sock: socket.socket, chunks: int, counts: SharedCounts, log_paths: bool) -> None:
    loop = asyncio.get_running_loop()
    responses = Responses(chunks, counts)
    seen: set[tuple[bytes, bytes]] | None = set() if log_paths else None
    server = await loop.create_server(lambda: ZeroProtocol(responses, seen), sock=sock)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _run(sock: socket.socket, chunks: int, counts: SharedCounts, log_paths: bool) -> None:
    try:
        import uvloop

        uvloop.run(serve(sock, chunks, counts, log_paths))
    except ImportError:
        asyncio.run(serve(sock, chunks, counts, log_paths))


def _reap(pid: int, deadline: float) -> None:
    """Wait for a child until ``deadline``; one that is still running is killed."""
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=9000, help="0 = a free port (printed)")
    parser.add_argument("--procs", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)")
    parser.add_argument("--chunks", type=int, default=64, help="token events per streamed response")
    parser.add_argument("--log-paths", action="store_true", help="print each distinct method and path once")
    args = parser.parse_args(argv)
    if args.procs < 1 or args.chunks < 1:
        parser.error("--procs and --chunks must be positive")
    # Bind in the parent, so that a free port (0) is known before the children start and all share it.
    first = listen(args.port, reuse_port=args.procs > 1)
    port = first.getsockname()[1]
    counts = SharedCounts(args.procs)
    children = []
    for row in range(1, args.procs):
        pid = os.fork()
        if pid == 0:
            first.close()
            counts.use_row(row)
            _run(listen(port, reuse_port=True), args.chunks, counts, args.log_paths)
            os._exit(0)
        children.append(pid)
    print(
        f"backend_zero: http://{HOST}:{port} ({args.procs} process(es): {os.getpid()} {children}, "
        f"{args.chunks} chunks per stream)",
        flush=True,
    )
    try:
        _run(first, args.chunks, counts, args.log_paths)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for pid in children:
            _reap(pid, deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
