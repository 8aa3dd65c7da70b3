"""`CacheClient`: the synchronous cache client (one request at a time; not thread-safe), which drives
`ClientCore`'s plans over a ZMQ DEALER socket or, for a ``unix://`` endpoint, a `UnixLink`.

Every round trip finishes within ``timeout_s``, sending included. An operation is one round trip, plus one
for ``hello`` when (re)connecting, plus one per split batch. After a timeout the connection is closed and a
new one made on the next call: a late reply cannot be mistaken for another one, and nothing queued for a
dead server is delivered to its successor. Replies to other requests are dropped (``stats.stale_replies``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq

from kvstack.cache.client.calls import NO_PREFIX, Call, Failure, Outcome, Plan
from kvstack.cache.client.core import ClientCore
from kvstack.cache.client.dealer import dealer
from kvstack.cache.client.results import Chunks, Reservation
from kvstack.cache.client.unix import UnixLink
from kvstack.cache.payload import Payload
from kvstack.cache.protocol import ProtocolError, StoredTail, recv_frames, send_frames

__all__ = ["CacheClient"]

T = TypeVar("T")


class CacheClient:
    """Synchronous client (one request at a time; not thread-safe). See ``kvstack.cache.client``."""

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
        context: zmq.Context[Any] | None = None,
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
        self._ctx = context if context is not None else zmq.Context()
        self._own_ctx = context is None
        self._sock: zmq.Socket[Any] | None = None
        self._link: UnixLink | None = None

    @property
    def node(self) -> str | None:
        """The server's node name, once connected."""
        return None if self._core.server is None else self._core.server.node

    @property
    def shm_active(self) -> bool:
        return self._core.shm_ok

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self._run(lambda: self._core.lookup_plan(keys), NO_PREFIX, "lookup")[0]

    def locate(self, keys: Sequence[bytes]) -> list[str]:
        return self._run(lambda: self._core.lookup_plan(keys), NO_PREFIX, "lookup")[1]

    def find(
        self, keys: Sequence[bytes], *, parent: bytes | None = None
    ) -> tuple[list[str], list[StoredTail]]:
        """`locate`, and the partial tails held right after that prefix (``parent``: the key before
        ``keys[0]``, None at a prompt's start)."""
        _, tiers, tails = self._run(lambda: self._core.lookup_plan(keys, True, parent), NO_PREFIX, "lookup")
        return tiers, tails

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._run(lambda: self._core.exists_plan(keys), [False] * len(keys), "exists")

    def get(self, keys: Sequence[bytes]) -> Chunks | None:
        return self._run(lambda: self._core.get_plan(keys), None, "get", missed=len(keys))

    def put(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[Payload],
        *,
        token_ids: Sequence[Sequence[int]] | None = None,
        parent: bytes | None = None,
        model: str | None = None,
    ) -> bool:
        try:
            return self._run(
                lambda: self._core.put_plan(keys, payloads, token_ids, parent, model), False, "put"
            )
        finally:  # sent or not, reserved regions among the payloads are the put's: freed now
            self._core.release(payloads)

    def reserve(self, sizes: Sequence[int]) -> Reservation | None:
        """Writable arena regions to fill and pass to ``put`` (one copy less); None: use ordinary payloads."""
        try:
            if self._core.down() or self._connect():
                return None
            return self._core.reserve(sizes)
        except Exception as e:
            return self._core.bug("reserve", e, None)

    def evict(self, keys: Sequence[bytes]) -> int:
        return self._run(lambda: self._core.evict_plan(keys), 0, "evict")

    def clear(self) -> bool:
        return self._run(self._core.clear_plan, False, "clear")

    def server_stats(self) -> dict[str, Any] | None:
        return self._run(self._core.stats_plan, None, "stats")

    def close(self) -> None:
        self._reset()
        if self._core.arena is not None:
            self._core.arena.retire()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- driving a plan

    def _run(self, make_plan: Callable[[], Plan[T]], miss: T, what: str, missed: int = 0) -> T:
        core = self._core
        try:
            down = core.down() or self._connect()
            if down is not None:
                core.stats.chunks_missed += missed
                return miss
            plan = make_plan()
            call = next(plan)
            while True:
                call = plan.send(self._roundtrip(call))
        except StopIteration as stop:
            result: T = stop.value
            return result
        except Exception as e:  # never into the caller's hot path
            return core.bug(what, e, miss)

    def _connect(self) -> Failure | None:
        if (self._sock is not None or self._link is not None) and self._core.server is not None:
            return None
        call = self._core.hello_call()
        return self._core.on_hello(self._exchange(call))

    def _roundtrip(self, call: Call) -> Outcome:
        failure = self._connect()
        return failure if failure is not None else self._exchange(call)

    def _exchange(self, call: Call) -> Outcome:
        core = self._core
        if core.unix_path is not None:
            return self._exchange_unix(call, core.unix_path)
        deadline = time.monotonic() + core.timeout_s
        if self._sock is None:
            self._sock = dealer(self._ctx, core.endpoint)
            self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(core.timeout_s * 1000)))
        sock = self._sock
        core.stats.requests += 1
        try:
            send_frames(sock, core.frames(call))
        except zmq.ZMQError as e:
            self._reset()
            return core.failed(call, Failure("unreachable", f"cannot send ({e}); is the server running?"))
        while True:
            # A receive timeout rather than a poll: no Poller is built per call on the lookup path.
            left_ms = int((deadline - time.monotonic()) * 1000)
            try:
                if left_ms <= 0:
                    raise zmq.Again()
                sock.setsockopt(zmq.RCVTIMEO, left_ms)
                parts = recv_frames(sock)
            except zmq.Again:
                self._reset()
                return core.failed(call, Failure("timeout", f"no reply within {core.timeout_s}s"))
            reply = core.decode(parts[0].buffer)
            if reply is None or reply.id != call.request.id:
                core.stats.stale_replies += reply is not None
                continue
            return core.outcome(call, reply, [part.buffer for part in parts[1:]])

    def _exchange_unix(self, call: Call, path: str) -> Outcome:
        core = self._core
        deadline = time.monotonic() + core.timeout_s
        core.stats.requests += 1
        try:
            if self._link is None:
                self._link = UnixLink(path, core.timeout_s)
            link = self._link
            link.send(core.frames(call), deadline)
            while True:
                parts = link.recv(deadline)
                reply = core.decode(parts[0])
                if reply is None or reply.id != call.request.id:
                    core.stats.stale_replies += reply is not None
                    continue
                return core.outcome(call, reply, parts[1:])
        except TimeoutError:
            self._reset()
            return core.failed(call, Failure("timeout", f"no reply within {core.timeout_s}s"))
        except ProtocolError as e:
            self._reset()
            return core.failed(call, Failure("bad_reply", e.message))
        except OSError as e:
            self._reset()
            return core.failed(call, Failure("unreachable", f"{path}: {e}; is the server running?"))

    def _reset(self) -> None:
        sock, self._sock = self._sock, None
        link, self._link = self._link, None
        self._core.server = None
        if sock is not None:
            sock.close(linger=0)
        if link is not None:
            link.close()
