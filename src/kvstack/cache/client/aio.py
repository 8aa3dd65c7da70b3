"""`AsyncCacheClient`: the asynchronous cache client; any number of requests run concurrently over one
connection (a ZMQ DEALER socket or, for a ``unix://`` endpoint, an `AsyncUnixLink`), driving `ClientCore`'s
plans.

Replies are matched to requests by id: a reader task the client owns (ZMQ) or the unix link's protocol
hands each one to the request waiting for it. Every round trip finishes within ``timeout_s``. A timeout or
a lost connection resets the connection: the requests still waiting on it fail at once (``reset``) and the
next call connects anew. Concurrent callers share one connect; callers queued behind a connect that failed
fail at once instead of each waiting out a timeout of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from kvstack.cache.client.calls import NO_PREFIX, Call, Failure, Outcome, Plan
from kvstack.cache.client.core import ClientCore
from kvstack.cache.client.dealer import dealer
from kvstack.cache.client.results import Chunks, Reservation
from kvstack.cache.client.unix import AsyncUnixLink
from kvstack.cache.payload import Payload
from kvstack.cache.protocol import ProtocolError, StoredTail

__all__ = ["AsyncCacheClient"]

T = TypeVar("T")


class AsyncCacheClient:
    """Asynchronous client: concurrent requests over one socket. See ``kvstack.cache.client``."""

    def __init__(
        self,
        endpoint: str,
        *,
        secret: bytes | None = None,
        timeout_s: float = 1.0,
        shm: bool = True,
        arena_bytes: int = 128 << 20,
        shm_dir: str = "/dev/shm",
        retry_initial_s: float = 0.05,
        retry_max_s: float = 2.0,
        name: str = "",
        log_interval_s: float = 10.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._core = ClientCore(
            endpoint,
            secret=secret,
            timeout_s=timeout_s,
            shm=shm,
            arena_bytes=arena_bytes,
            shm_dir=shm_dir,
            retry_initial_s=retry_initial_s,
            retry_max_s=retry_max_s,
            name=name,
            log_interval_s=log_interval_s,
        )
        self.stats = self._core.stats
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._own_ctx = context is None
        self._sock: zmq.asyncio.Socket | None = None
        self._link: AsyncUnixLink | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, tuple[Call, asyncio.Future[Outcome]]] = {}
        self._connecting: asyncio.Lock | None = None

    @property
    def node(self) -> str | None:
        return None if self._core.server is None else self._core.server.node

    @property
    def shm_active(self) -> bool:
        return self._core.shm_ok

    async def lookup(self, keys: Sequence[bytes]) -> int:
        return (await self._run(lambda: self._core.lookup_plan(keys), NO_PREFIX, "lookup"))[0]

    async def locate(self, keys: Sequence[bytes]) -> list[str]:
        return (await self._run(lambda: self._core.lookup_plan(keys), NO_PREFIX, "lookup"))[1]

    async def find(
        self, keys: Sequence[bytes], *, parent: bytes | None = None
    ) -> tuple[list[str], list[StoredTail]]:
        """`locate`, and the partial tails held right after that prefix (``parent``: the key before
        ``keys[0]``, None at a prompt's start)."""
        _, tiers, tails = await self._run(
            lambda: self._core.lookup_plan(keys, True, parent), NO_PREFIX, "lookup"
        )
        return tiers, tails

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._run(lambda: self._core.exists_plan(keys), [False] * len(keys), "exists")

    async def get(self, keys: Sequence[bytes]) -> Chunks | None:
        return await self._run(lambda: self._core.get_plan(keys), None, "get", missed=len(keys))

    async def put(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[Payload],
        *,
        token_ids: Sequence[Sequence[int]] | None = None,
        parent: bytes | None = None,
        model: str | None = None,
    ) -> bool:
        try:
            return await self._run(
                lambda: self._core.put_plan(keys, payloads, token_ids, parent, model), False, "put"
            )
        finally:  # sent or not, reserved regions among the payloads are the put's: freed now
            self._core.release(payloads)

    async def reserve(self, sizes: Sequence[int]) -> Reservation | None:
        """Writable arena regions to fill and pass to ``put`` (one copy less); None: use ordinary payloads."""
        try:
            if self._core.down() or await self._connect():
                return None
            return self._core.reserve(sizes)
        except Exception as e:
            return self._core.bug("reserve", e, None)

    async def evict(self, keys: Sequence[bytes]) -> int:
        return await self._run(lambda: self._core.evict_plan(keys), 0, "evict")

    async def clear(self) -> bool:
        return await self._run(self._core.clear_plan, False, "clear")

    async def server_stats(self) -> dict[str, Any] | None:
        return await self._run(self._core.stats_plan, None, "stats")

    async def aclose(self) -> None:
        await self._reset()
        if self._core.arena is not None:
            self._core.arena.retire()
        if self._own_ctx:
            self._ctx.term()

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- driving a plan

    async def _run(self, make_plan: Callable[[], Plan[T]], miss: T, what: str, missed: int = 0) -> T:
        core = self._core
        try:
            down = core.down() or await self._connect()
            if down is not None:
                core.stats.chunks_missed += missed
                return miss
            plan = make_plan()
            call = next(plan)
            while True:
                call = plan.send(await self._roundtrip(call))
        except StopIteration as stop:
            result: T = stop.value
            return result
        except Exception as e:
            return core.bug(what, e, miss)

    def _connected(self) -> bool:
        return (self._sock is not None or self._link is not None) and self._core.server is not None

    async def _connect(self) -> Failure | None:
        if self._connected():
            return None
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._connected():
                return None
            # Callers queued here while a connect failed must not each wait out a timeout of their own.
            return self._core.down() or self._core.on_hello(await self._exchange(self._core.hello_call()))

    async def _roundtrip(self, call: Call) -> Outcome:
        failure = await self._connect()
        return failure if failure is not None else await self._exchange(call)

    async def _exchange(self, call: Call) -> Outcome:
        core = self._core
        if core.unix_path is not None:
            return await self._exchange_unix(call, core.unix_path)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + core.timeout_s
        sock = self._sock
        if sock is None:
            sock = self._sock = dealer(self._ctx, core.endpoint)
            self._reader = loop.create_task(self._read(sock), name="cache-client-reader")
        future: asyncio.Future[Outcome] = loop.create_future()
        rid = call.request.id
        self._pending[rid] = (call, future)
        core.stats.requests += 1
        try:
            await asyncio.wait_for(sock.send_multipart(core.frames(call), copy=False), core.timeout_s)
            outcome = await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
        except TimeoutError:
            await self._reset(sock)
            return core.failed(call, Failure("timeout", f"no reply within {core.timeout_s}s"))
        except zmq.ZMQError as e:
            await self._reset(sock)
            return core.failed(call, Failure("unreachable", f"cannot send ({e}); is the server running?"))
        finally:
            self._pending.pop(rid, None)
        if isinstance(outcome, Failure) and outcome.reason == "reset":
            return core.failed(call, outcome)
        return outcome

    async def _exchange_unix(self, call: Call, path: str) -> Outcome:
        core = self._core
        loop = asyncio.get_running_loop()
        deadline = loop.time() + core.timeout_s
        core.stats.requests += 1
        link = self._link
        if link is None:
            try:
                _, new_link = await asyncio.wait_for(
                    loop.create_unix_connection(
                        lambda: AsyncUnixLink(self._on_reply, self._link_lost, self._link_broken), path
                    ),
                    core.timeout_s,
                )
            except TimeoutError:
                return core.failed(call, Failure("timeout", f"no connection within {core.timeout_s}s"))
            except OSError as e:
                return core.failed(call, Failure("unreachable", f"{path}: {e}; is the server running?"))
            link = self._link = new_link
        future: asyncio.Future[Outcome] = loop.create_future()
        rid = call.request.id
        self._pending[rid] = (call, future)
        try:
            link.send(core.frames(call))
            outcome = await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
        except TimeoutError:
            await self._reset(link=link)
            return core.failed(call, Failure("timeout", f"no reply within {core.timeout_s}s"))
        except OSError as e:  # the connection closed under us
            await self._reset(link=link)
            return core.failed(call, Failure("unreachable", f"{path}: {e}"))
        finally:
            self._pending.pop(rid, None)
        if isinstance(outcome, Failure) and outcome.reason == "reset":
            return core.failed(call, outcome)
        return outcome

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            parts = await sock.recv_multipart(copy=False)
            self._on_reply(parts[0].buffer, [part.buffer for part in parts[1:]])

    def _on_reply(self, header: memoryview, payloads: list[memoryview]) -> None:
        reply = self._core.decode(header)
        if reply is None:
            return
        entry = self._pending.get(reply.id)
        if entry is None or entry[1].done():
            self._core.stats.stale_replies += 1
            return
        call, future = entry
        future.set_result(self._core.outcome(call, reply, payloads))

    def _fail_pending(self, why: str) -> None:
        for _, future in list(self._pending.values()):
            if not future.done():
                future.set_result(Failure("reset", why))

    def _link_lost(self, link: AsyncUnixLink) -> None:
        if link is self._link:
            self._link = None
            self._core.server = None
            self._fail_pending("the server closed the connection")

    def _link_broken(self, error: ProtocolError) -> None:
        self._core.warn("cache client: %s: %s; reconnecting", self._core.endpoint, error)

    async def _reset(self, sock: zmq.asyncio.Socket | None = None, link: AsyncUnixLink | None = None) -> None:
        if (sock is not None and sock is not self._sock) or (link is not None and link is not self._link):
            return  # another request already replaced it
        sock, self._sock = self._sock, None
        link, self._link = self._link, None
        self._core.server = None
        reader, self._reader = self._reader, None
        self._fail_pending("the connection was reset after another request timed out")
        if link is not None:
            link.close()
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if sock is not None:
            sock.close(linger=0)
