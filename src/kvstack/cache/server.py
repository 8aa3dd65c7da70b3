"""The cache server: a `TieredStore` behind a ZMQ ROUTER socket and, optionally, a unix socket; the
requests are answered by `CacheService` (``kvstack.cache.service``; protocol: ``kvstack.cache.protocol``).

Requests that need no I/O are answered in the callback that read them: no task, no await. Every other
request is handled in its own task, at most ``max_concurrency`` at a time, so a slow disk read does not hold
up memory hits. Replies are sent without waiting (past a peer's high-water mark ZMQ drops the reply and the
client times out). Nothing a peer sends can stop the server: a malformed, oversized, unauthenticated or
failing request gets an error reply. `CacheServer` lists its endpoints, limits and options.

The server does not own the store: start the store before the server and stop it after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import time
from typing import Protocol, cast

import zmq
import zmq.asyncio
from aiohttp import web

from kvstack.cache.events import ChunkEvents, topic_for
from kvstack.cache.keys import DEFAULT_CHUNK_SIZE
from kvstack.cache.metrics import CacheMetrics
from kvstack.cache.protocol import (
    UNIX_SCHEME,
    ErrorCode,
    ErrorReply,
    ProtocolError,
    Put,
    Reply,
    Request,
    UnixFramer,
    decode_request,
    encode,
    recv_frames,
    send_frames,
    unix_head,
)
from kvstack.cache.service import CacheService, Frames
from kvstack.cache.shm import ServerArenas
from kvstack.cache.store import TieredStore
from kvstack.cache.tails import DEFAULT_TAIL_LIMIT, TailIndex
from kvstack.kvevents.publisher import KVEventPublisher
from kvstack.logs import ThrottledLog

__all__ = ["CacheServer"]

log = logging.getLogger(__name__)

DEFAULT_BIND = "tcp://127.0.0.1:5560"
_SWEEP_INTERVAL_S = 5.0
_READ_BATCH = 64  # requests read per loop callback before yielding to other callbacks
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)


class CacheServer:
    """Serves ``store`` on ``bind``.

    - ``bind``: ``tcp://127.0.0.1:5560`` by default (any ZMQ endpoint works, e.g. ``ipc:///run/kvstack/cache``);
      port 0 lets the OS choose (``endpoint`` tells the bound one).
    - ``max_concurrency``: requests handled in tasks at once; beyond it the sockets are not read, and ZMQ
      queues up to its high-water mark.
    - A message that is malformed, too large (``max_message_bytes`` for the sum of its frames, ``max_keys``
      keys), of another version or op, with a wrong or missing mac (``secret``), or that makes a handler fail
      gets an error reply; a single frame over ``max_message_bytes`` makes ZMQ drop the connection.
    - ``unix_path`` (``kvstack cache-server --unix-socket PATH``): also serve same-host clients on a unix
      socket (``unix://PATH``), with the same limits, errors and secret. A framing error gets an error reply
      and closes that connection; a client that lets more than two messages' worth of replies pile up unread
      is dropped. A socket file left by a killed server is replaced; one another server answers on, or a file
      that is not a socket, is refused; ``stop`` removes the file if it is still this server's.
    - ``events_endpoint``: admit/evict events on ZMQ PUB (``kvstack.cache.events``), topic
      ``kvstack-cache/<node>``; ``events_replay_endpoint`` serves replays. At start, the chunks the disk tier
      kept are announced (``BlockStored`` DISK) while requests are served.
    - ``tail_limit``: prompts' partial last chunks indexed for lookups (``kvstack.cache.tails``).
    - ``http_port``: ``GET /metrics`` (``kvstack.cache.metrics``) and ``GET /health`` on ``http_host``.
    """

    def __init__(
        self,
        store: TieredStore,
        bind: str = DEFAULT_BIND,
        *,
        secret: bytes | None = None,
        node: str | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        events_endpoint: str | None = None,
        events_replay_endpoint: str | None = None,
        http_port: int | None = None,
        http_host: str = "127.0.0.1",
        max_message_bytes: int = 256 << 20,
        max_keys: int = 65_536,
        max_concurrency: int = 64,
        context: zmq.asyncio.Context | None = None,
        unix_path: str | None = None,
        tail_limit: int = DEFAULT_TAIL_LIMIT,
    ) -> None:
        if secret is not None and not secret:
            raise ValueError("secret must be non-empty (or None for no authentication)")
        if max_message_bytes < 1024 or max_keys < 1 or max_concurrency < 1:
            raise ValueError(
                "need max_message_bytes >= 1024, max_keys >= 1 and max_concurrency >= 1, got "
                f"{max_message_bytes}, {max_keys}, {max_concurrency}"
            )
        self.store = store
        self.node = node or socket.gethostname()
        self._bind = bind
        self._unix_path = unix_path
        self._unix_server: asyncio.AbstractServer | None = None
        self._unix_inode: int | None = None  # of the socket file this server made (removed at stop)
        self._unix_peers: set[_UnixPeer] = set()
        self._unix_waiting: set[_UnixPeer] = set()  # paused while max_concurrency requests run
        self._max_bytes = max_message_bytes
        self._max_keys = max_keys
        self._max_tasks = max_concurrency
        self._reading = False
        self._read_scheduled = False
        self._ctx = context
        self._own_ctx = context is None
        self._http = (http_host, http_port)
        self.publisher: KVEventPublisher | None = None
        self.events: ChunkEvents | None = None
        if events_endpoint is not None:
            self.publisher = KVEventPublisher(
                events_endpoint, topic=topic_for(self.node), replay_endpoint=events_replay_endpoint
            )
            self.events = ChunkEvents(self.publisher.publish, chunk_size=chunk_size)
        publisher = self.publisher
        self.metrics = CacheMetrics(
            store,
            events=None if publisher is None else lambda: (publisher.sent_events, publisher.dropped_batches),
        )
        self.arenas = ServerArenas()
        self.service = CacheService(
            store,
            node=self.node,
            secret=secret,
            max_message_bytes=max_message_bytes,
            max_keys=max_keys,
            metrics=self.metrics,
            arenas=self.arenas,
            events=self.events,
            publisher=self.publisher,
            in_flight=lambda: len(self._tasks),
            chunk_size=chunk_size,
            tails=TailIndex(tail_limit),
        )
        self._sock: zmq.Socket[bytes] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._announcing: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._errors_log = ThrottledLog(log)
        self.endpoint: str | None = None
        self.unix_endpoint: str | None = None
        self.http_port: int | None = None

    # -- lifecycle

    async def start(self) -> None:
        if self._sock is not None:
            raise RuntimeError("CacheServer.start() called twice")
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        # A plain socket on the asyncio context: the loop watches its FD (see _readable).
        sock: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A frame larger than the whole message may be cannot be answered: ZMQ drops its connection.
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
        self._sock = sock
        try:
            sock.bind(self._bind)
        except zmq.ZMQError as e:
            await self.stop()
            raise OSError(f"cache server cannot bind {self._bind}: {e} (port in use? use port 0)") from e
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        try:
            if self.publisher is not None and self.events is not None:
                await self.publisher.start()
                for tier in self.store.tiers:
                    tier.listener = self.events
            host, port = self._http
            if port is not None:
                await self._start_http(host, port)
            if self._unix_path is not None:
                await self._start_unix(self._unix_path)
        except BaseException:
            await self.stop()
            raise
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._readable)
        self._reading = True
        loop.call_soon(self._readable)  # the FD signals changes only: read what may already be queued
        self._loops = [asyncio.create_task(self._sweep_arenas(), name="cache-server-arenas")]
        if self.events is not None:  # one-off, unlike the loops; cancelled by stop if still running
            self._announcing = asyncio.create_task(self._announce_held(), name="cache-server-announce")
        log.info(
            "cache server %s on %s%s%s%s",
            self.node,
            self.endpoint,
            "" if self.unix_endpoint is None else f" and {self.unix_endpoint}",
            "" if self.publisher is None else f", events on {self.publisher.endpoint}",
            "" if self.http_port is None else f", http://{self._http[0]}:{self.http_port}/metrics",
        )

    async def stop(self) -> None:
        if self._reading and self._sock is not None:  # no new requests; tasks still send their replies
            self._reading = False
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        unix_server, self._unix_server = self._unix_server, None
        if unix_server is not None:  # no new connections; open ones are closed after the tasks end
            unix_server.close()
        for peer in self._unix_peers:  # and no new requests on them
            peer.pause()
        loops, self._loops = self._loops, []
        if self._announcing is not None:
            loops.append(self._announcing)
            self._announcing = None
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=5.0)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for tier in self.store.tiers:
            if tier.listener is self.events:
                tier.listener = None
        if self.events is not None:
            self.events.flush()
        if self.publisher is not None:
            await self.publisher.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(linger=0)
        for peer in list(self._unix_peers):
            peer.close()
        self._unix_peers.clear()
        self._unix_waiting.clear()
        self._remove_unix_socket()
        self.arenas.close()
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> CacheServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the request loop

    def _readable(self) -> None:
        """Receive and start every request waiting. ZMQ's FD signals a change, not a level: read while
        ZMQ_EVENTS says a message waits, and read again after sending (a send can consume the signal of a
        request that arrived). Asking ZMQ_EVENTS costs a third of a receive that fails (which raises)."""
        self._read_scheduled = False
        sock = self._sock
        for _ in range(_READ_BATCH):
            if sock is None or not self._reading or len(self._tasks) >= self._max_tasks:
                return  # full: _done reads again when a task ends
            if not cast(int, sock.get(_EVENTS)) & _POLLIN:
                return
            try:
                frames = recv_frames(sock, _NOBLOCK)
            except zmq.Again:
                return
            self._on_request(sock, frames)
        self._read_soon()  # more may wait: let other callbacks (replies of tasks, events) run first

    def _read_soon(self) -> None:
        if not self._read_scheduled:
            self._read_scheduled = True
            asyncio.get_running_loop().call_soon(self._readable)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._read_soon()
        if self._unix_waiting:
            asyncio.get_running_loop().call_soon(self._resume_unix)

    def _on_request(self, sock: zmq.Socket[bytes], frames: list[zmq.Frame]) -> None:
        envelope: list[bytes] = [frames[0].bytes]
        first = 1
        if len(frames) > 1 and len(frames[1]) == 0:  # a REQ client's delimiter
            envelope.append(b"")
            first = 2
        self._serve(_ZmqPeer(self, sock, envelope), [frame.buffer for frame in frames[first:]])

    def _serve(self, peer: _Peer, rest: list[memoryview]) -> None:
        """Answer one request (``rest``: its frames, header first) now, or start a task that will."""
        started = time.perf_counter()
        op = "invalid"
        request_id = 0
        try:
            if sum(len(frame) for frame in rest) > self._max_bytes:
                raise ProtocolError(
                    ErrorCode.TOO_LARGE,
                    f"message is over max_message_bytes={self._max_bytes}; send fewer chunks",
                )
            if len(rest) < 2:
                raise ProtocolError(
                    ErrorCode.MALFORMED, f"expected frames [header, mac, *payloads], got {len(rest)} frame(s)"
                )
            request = decode_request(rest[0])
            op, request_id = str(request.__struct_config__.tag), request.id
            self.service.authenticate(rest[0], rest[1], request.id)
            if not isinstance(request, Put) and len(rest) > 2:
                extra = f"{len(rest) - 2} unexpected payload frame(s)"
                raise ProtocolError(ErrorCode.MALFORMED, extra, request_id)
            answer = self.service.answer_now(request, rest[2:])
        except Exception as e:
            self._reply(peer, op, started, self.service.failure(e, op, request_id), [])
            return
        if answer is not None:
            self._reply(peer, op, started, *answer)
            return
        task = asyncio.create_task(self._answer_later(peer, op, started, request))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _answer_later(self, peer: _Peer, op: str, started: float, request: Request) -> None:
        try:
            reply, payloads = await self.service.answer(request)
        except Exception as e:
            reply, payloads = self.service.failure(e, op, request.id), []
        self._reply(peer, op, started, reply, payloads)
        self._read_soon()

    def _reply(self, peer: _Peer, op: str, started: float, reply: Reply, payloads: Frames) -> None:
        error = isinstance(reply, ErrorReply)
        self.metrics.request_done(op, not error, time.perf_counter() - started)
        if isinstance(reply, ErrorReply) and reply.code != ErrorCode.ARENA:
            self._errors_log.warning("cache server: error reply %s: %s", reply.code, reply.message)
        try:
            peer.send([encode(reply), *payloads])
        except (zmq.ZMQError, OSError) as e:
            self.metrics.protocol_errors.labels("dropped").inc()
            self._errors_log.warning("cache server: cannot send a %s reply: %s", op, e)

    async def _announce_held(self) -> None:
        """Announce what the tiers kept across a restart (the disk tier's chunks, with the tokens kept in
        their files), while requests are served; subscribers that join later get it by replay."""
        for tier in self.store.tiers:
            try:
                count = await tier.announce_held()
            except Exception:
                log.exception("cache server: announcing the chunks tier %s holds failed", tier.name)
                continue
            if count:
                log.info("cache server: announced %d chunks tier %s held at start", count, tier.name)

    async def _sweep_arenas(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            self.arenas.sweep()

    async def _start_http(self, host: str, port: int) -> None:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "node": self.node, "endpoint": self.endpoint})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, host, port)
        await site.start()
        with contextlib.suppress(IndexError, TypeError):
            self.http_port = int(runner.addresses[0][1])

    # -- unix socket

    async def _start_unix(self, path: str) -> None:
        _claim_socket_path(path)
        loop = asyncio.get_running_loop()
        self._unix_server = await loop.create_unix_server(lambda: _UnixPeer(self), path)
        self._unix_inode = os.stat(path).st_ino
        self.unix_endpoint = f"{UNIX_SCHEME}{path}"

    def _remove_unix_socket(self) -> None:
        path, inode, self._unix_inode = self._unix_path, self._unix_inode, None
        if path is None or inode is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:  # still ours: not replaced by another server meanwhile
                os.unlink(path)

    def _resume_unix(self) -> None:
        for peer in list(self._unix_waiting):
            if len(self._tasks) >= self._max_tasks:
                return
            peer.serve_buffered()


class _Peer(Protocol):
    def send(self, frames: Frames) -> None: ...


class _ZmqPeer:
    """Where a ZMQ request came from: replies go back through the ROUTER with its envelope."""

    __slots__ = ("envelope", "server", "sock")

    def __init__(self, server: CacheServer, sock: zmq.Socket[bytes], envelope: list[bytes]) -> None:
        self.server = server
        self.sock = sock
        self.envelope = envelope

    def send(self, frames: Frames) -> None:
        if self.sock is self.server._sock:  # else stopped meanwhile
            send_frames(self.sock, [*self.envelope, *frames], _NOBLOCK)


class _UnixPeer(asyncio.Protocol):
    """One unix-socket connection: requests are served in the order they arrive (replies of tasks may pass
    each other, as through ZMQ: the client matches them by id). While ``max_concurrency`` tasks run the
    connection is not read (its requests wait in the kernel's buffer); a framing error gets an error reply
    and closes the connection (the stream cannot be trusted past it); a client that does not read its
    replies is dropped once more than two messages' worth of them wait to be sent."""

    def __init__(self, server: CacheServer) -> None:
        self.server = server
        # A put may carry one frame per key besides its header and mac.
        self.framer = UnixFramer(server._max_keys + 2, server._max_bytes)
        self.transport: asyncio.Transport | None = None
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.server._unix_peers.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server._unix_peers.discard(self)
        self.server._unix_waiting.discard(self)

    def data_received(self, data: bytes) -> None:
        self.framer.feed(data)
        self.serve_buffered()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def serve_buffered(self) -> None:
        server = self.server
        while self.transport is not None:
            if not server._reading:  # stopping: what is buffered stays unanswered
                self.pause()
                return
            if len(server._tasks) >= server._max_tasks:
                self.pause()
                server._unix_waiting.add(self)
                return
            try:
                frames = self.framer.next()
            except ProtocolError as e:
                self.send([encode(server.service.failure(e, "invalid", 0))])
                self.close()
                return
            if frames is None:
                break
            server._serve(self, frames)
        server._unix_waiting.discard(self)
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def send(self, frames: Frames) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.writelines([unix_head(frames), *frames])
        if transport.get_write_buffer_size() > 2 * self.server._max_bytes:
            self.server._errors_log.warning("cache server: dropped a unix-socket client that does not read")
            transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _claim_socket_path(path: str) -> None:
    """Remove a socket file left by a server that is gone; refuse a path another server listens on or that
    is not a socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"cache server cannot listen on {path}: it exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # stale
        return
    finally:
        probe.close()
    raise OSError(f"cache server cannot listen on {path}: another server answers there")
