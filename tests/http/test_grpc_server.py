"""kvstack's lean gRPC server (kvstack.http.grpc_server) against the real grpcio client: unary and bidi calls,
messages larger than the flow-control windows both ways, limits and errors, cancels, many streams on one
connection, grpc.health.v1 and Envoy's ext_proc messages, graceful close, and no state left behind."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstack.http.grpc_server import GrpcError, GrpcServer, GrpcStream, Status, StreamHandler, unary
from support.waiting import eventually

pytestmark = pytest.mark.asyncio

MiB = 1 << 20
BIG_CHANNEL = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]


class Echo:
    """Answers every message with itself (``times`` copies), finishes when the client half-closes."""

    live: weakref.WeakSet[Echo] = weakref.WeakSet()

    def __init__(self, stream: GrpcStream, times: int = 1) -> None:
        self.stream = stream
        self.times = times
        self.events: list[str] = []
        Echo.live.add(self)

    def on_message(self, data: bytes) -> None:
        self.events.append("message")
        for _ in range(self.times):
            self.stream.send(data)

    def on_end(self) -> None:
        self.events.append("end")
        self.stream.finish()

    def on_reset(self) -> None:
        self.events.append("reset")


class Recording:
    """Keeps every handler a factory made, to look at their callbacks afterwards."""

    def __init__(self, make: Callable[[GrpcStream], Echo] = Echo) -> None:
        self.make = make
        self.handlers: list[Echo] = []

    def __call__(self, stream: GrpcStream) -> StreamHandler:
        handler = self.make(stream)
        self.handlers.append(handler)
        return handler


@asynccontextmanager
async def serving(
    methods: Mapping[str, Callable[[GrpcStream], StreamHandler]], **kw: int
) -> AsyncIterator[GrpcServer]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    server = GrpcServer(methods, **kw)
    await server.start(sock)
    server.port = sock.getsockname()[1]  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        await server.close(0.5)


def channel(server: GrpcServer, options: list[tuple[str, int]] | None = None) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options)  # type: ignore[attr-defined]


def ident(data: bytes) -> bytes:
    return data


async def test_unary_answers_with_the_function_result_and_sees_metadata() -> None:
    seen: list[list[tuple[str, str]]] = []

    def make(stream: GrpcStream) -> StreamHandler:
        seen.append(stream.metadata)
        return unary(lambda data: data[::-1])(stream)

    async def later(data: bytes) -> bytes:
        await asyncio.sleep(0.01)
        return b"async:" + data

    def refuse(data: bytes) -> bytes:
        raise GrpcError(Status.FAILED_PRECONDITION, "not now: 100% ünïcode")

    methods = {"/t.S/Reverse": make, "/t.S/Later": unary(later), "/t.S/Refuse": unary(refuse)}
    async with serving(methods) as server, channel(server) as ch:
        assert await ch.unary_unary("/t.S/Reverse")(b"hello", metadata=(("x-user", "ada"),)) == b"olleh"
        assert await ch.unary_unary("/t.S/Later")(b"x") == b"async:x"
        assert await ch.unary_unary("/t.S/Reverse")(b"") == b""
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/t.S/Refuse")(b"x")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            err.value.details() == "not now: 100% ünïcode"
        )  # percent-encoded on the wire, decoded by grpcio
    assert ("x-user", "ada") in seen[0]
    assert not any(name.startswith(":") or name in ("content-type", "te") for name, _ in seen[0])


async def test_bidi_ping_pong_of_many_messages() -> None:
    rec = Recording()
    async with serving({"/t.S/Echo": rec}) as server, channel(server) as ch:
        call = ch.stream_stream("/t.S/Echo")()
        for i in range(1000):
            await call.write(b"ping %d" % i)
            assert await call.read() == b"ping %d" % i
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    assert rec.handlers[0].events == ["message"] * 1000 + ["end"]


@pytest.mark.parametrize("size", [70_000, 1 * MiB, 5 * MiB + 3])
async def test_messages_larger_than_frames_and_windows_both_ways(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    server_cm = serving({"/t.S/Echo": lambda s: Echo(s, times=2)}, max_message_bytes=8 * MiB)
    async with server_cm as server, channel(server, BIG_CHANNEL) as ch:
        calls = [ch.stream_stream("/t.S/Echo")() for _ in range(3)]

        async def one(call: grpc.aio.StreamStreamCall) -> list[bytes]:
            await call.write(payload)
            await call.done_writing()
            return [m async for m in call]

        results = await asyncio.gather(*(one(c) for c in calls))
    assert all(r == [payload, payload] for r in results)


async def test_unknown_method_is_unimplemented() -> None:
    async with serving({"/t.S/Echo": Echo}) as server, channel(server) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/t.S/Nope")(b"x")
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/t.S/Nope" in (err.value.details() or "")
        call = ch.stream_stream("/t.S/Other")()  # a bidi call is refused at its headers
        assert await call.code() == grpc.StatusCode.UNIMPLEMENTED
        assert await ch.stream_stream("/t.S/Echo")(iter([b"still served"])).read() == b"still served"


async def test_oversized_message_is_resource_exhausted_and_the_handler_reset() -> None:
    rec = Recording()
    server_cm = serving({"/t.S/Echo": rec}, max_message_bytes=64 << 10)
    async with server_cm as server, channel(server, BIG_CHANNEL) as ch:
        call = ch.stream_stream("/t.S/Echo")()
        await call.write(b"small")
        assert await call.read() == b"small"
        await call.write(b"x" * (100 << 10))
        assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than the limit of 65536 bytes" in (await call.details())
        assert await ch.unary_unary("/t.S/Echo")(b"y" * (64 << 10)) == b"y" * (64 << 10)
    assert rec.handlers[0].events == ["message", "reset"]


async def test_compressed_message_is_unimplemented() -> None:
    async with serving({"/t.S/Echo": Echo}) as server, channel(server) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/t.S/Echo")(b"a" * 10_000, compression=grpc.Compression.Gzip)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "compressed" in (err.value.details() or "")


async def test_handler_failure_is_internal_and_the_connection_lives_on() -> None:
    class Broken(Echo):
        def on_message(self, data: bytes) -> None:
            super().on_message(data)
            if data == b"boom":
                raise RuntimeError("boom")

    rec = Recording(Broken)
    async with serving({"/t.S/Echo": rec}) as server, channel(server) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/t.S/Echo")(b"boom")
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert await ch.unary_unary("/t.S/Echo")(b"fine") == b"fine"
        assert server.connections == 1
    assert rec.handlers[0].events == ["message", "reset"]


async def test_client_cancel_mid_stream_resets_the_handler() -> None:
    rec = Recording()
    async with serving({"/t.S/Echo": rec}) as server, channel(server) as ch:
        call = ch.stream_stream("/t.S/Echo")()
        await call.write(b"one")
        assert await call.read() == b"one"
        call.cancel()
        await eventually(lambda: rec.handlers[0].events[-1:] == ["reset"], what="the handler's on_reset")
        await eventually(lambda: server.open_streams == 0, what="the stream forgotten")
    assert rec.handlers[0].events == ["message", "reset"]


async def test_closing_the_channel_resets_every_open_call() -> None:
    rec = Recording()
    async with serving({"/t.S/Echo": rec}) as server:
        ch = channel(server)
        calls = [ch.stream_stream("/t.S/Echo")() for _ in range(3)]
        for call in calls:
            await call.write(b"hi")
            assert await call.read() == b"hi"
        await ch.close()
        await eventually(lambda: all(h.events[-1:] == ["reset"] for h in rec.handlers), what="every on_reset")
        assert server.open_streams == 0


async def test_many_concurrent_streams_on_one_connection() -> None:
    rec = Recording()
    async with serving({"/t.S/Echo": rec, "/t.S/Unary": unary(ident)}) as server, channel(server) as ch:
        bidis = [ch.stream_stream("/t.S/Echo")() for _ in range(200)]
        for i, call in enumerate(bidis):
            await call.write(b"%d" % i)
        unaries = await asyncio.gather(*(ch.unary_unary("/t.S/Unary")(b"u%d" % i) for i in range(500)))
        assert unaries == [b"u%d" % i for i in range(500)]
        assert [await c.read() for c in bidis] == [b"%d" % i for i in range(200)]
        assert server.open_streams == 200
        for call in bidis:
            await call.done_writing()
        assert [await c.code() for c in bidis] == [grpc.StatusCode.OK] * 200
        assert server.connections == 1


async def test_calls_beyond_max_concurrent_streams_wait_their_turn() -> None:
    async def slow(data: bytes) -> bytes:
        await asyncio.sleep(0.02)
        return data

    async with serving({"/t.S/Slow": unary(slow)}, max_concurrent_streams=4) as server, channel(server) as ch:
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, server.open_streams)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        out = await asyncio.gather(*(ch.unary_unary("/t.S/Slow")(b"%d" % i) for i in range(40)))
        watcher.cancel()
    assert out == [b"%d" % i for i in range(40)]
    assert 1 <= peak <= 4


async def test_health_check_served_by_the_unary_helper() -> None:
    def check(data: bytes) -> bytes:
        request = health_pb2.HealthCheckRequest.FromString(data)
        if request.service not in ("", "kvstack.epp"):
            raise GrpcError(Status.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING
        ).SerializeToString()

    async with serving({"/grpc.health.v1.Health/Check": unary(check)}) as server, channel(server) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="kvstack.epp"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="other"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Watch(health_pb2.HealthCheckRequest()).read()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


class Picker:
    """An ext_proc endpoint picker: headers continue, the body is answered with the destination."""

    def __init__(self, stream: GrpcStream) -> None:
        self.stream = stream

    def on_message(self, data: bytes) -> None:
        request = ext_proc.ProcessingRequest.FromString(data)
        if request.HasField("request_headers"):
            self.stream.send(
                ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse()).SerializeToString()
            )
            return
        assert request.HasField("request_body")
        header = base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="x-gateway-destination-endpoint", raw_value=b"10.0.0.7:8000")
        )
        common = ext_proc.CommonResponse(header_mutation=ext_proc.HeaderMutation(set_headers=[header]))
        response = ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common))
        response.dynamic_metadata.update({"envoy.lb": {"x-gateway-destination-endpoint": "10.0.0.7:8000"}})
        self.stream.send(response.SerializeToString())

    def on_end(self) -> None:
        self.stream.finish()

    def on_reset(self) -> None:
        pass


async def test_envoy_ext_proc_stream_with_the_real_stubs() -> None:
    path = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    async with serving({path: Picker}) as server, channel(server) as ch:
        stub = ext_proc_grpc.ExternalProcessorStub(ch)
        for _ in range(3):
            call = stub.Process()
            headers = ext_proc.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")]
                )
            )
            await call.write(ext_proc.ProcessingRequest(request_headers=headers))
            first = await call.read()
            assert first.HasField("request_headers")
            body = b'{"model":"m","prompt":"' + b"p" * 100_000 + b'"}'
            await call.write(
                ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body, end_of_stream=True))
            )
            second = await call.read()
            mutation = second.request_body.response.header_mutation.set_headers[0].header
            assert (mutation.key, mutation.raw_value) == ("x-gateway-destination-endpoint", b"10.0.0.7:8000")
            lb = second.dynamic_metadata.fields["envoy.lb"].struct_value.fields
            assert lb["x-gateway-destination-endpoint"].string_value == "10.0.0.7:8000"
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK


async def test_close_lets_calls_in_flight_finish_and_refuses_new_ones() -> None:
    rec = Recording()
    async with serving({"/t.S/Echo": rec}) as server, channel(server) as ch:
        calls = [ch.stream_stream("/t.S/Echo")() for _ in range(3)]
        for call in calls:
            await call.write(b"before")
            assert await call.read() == b"before"
        closing = asyncio.create_task(server.close(grace_s=10))
        await asyncio.sleep(0.1)
        assert not closing.done()
        for call in calls:  # the calls in flight still go both ways
            await call.write(b"after")
            assert await call.read() == b"after"
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
        await asyncio.wait_for(closing, 5)  # done once the last call ended, well before the grace
        assert server.connections == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/t.S/Echo")(b"new", timeout=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert all(h.events == ["message", "message", "end"] for h in rec.handlers)


async def test_close_resets_calls_still_open_after_the_grace() -> None:
    rec = Recording()
    async with serving({"/t.S/Echo": rec}) as server, channel(server) as ch:
        call = ch.stream_stream("/t.S/Echo")()
        await call.write(b"x")
        assert await call.read() == b"x"
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await server.close(grace_s=0.3)
        assert 0.25 < loop.time() - t0 < 3
        assert await call.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert server.connections == 0
    assert rec.handlers[0].events == ["message", "reset"]


async def test_no_state_left_after_20k_streams() -> None:
    Echo.live = weakref.WeakSet()
    async with serving({"/t.S/Echo": Echo, "/t.S/Unary": unary(ident)}) as server, channel(server) as ch:
        echo, single = ch.stream_stream("/t.S/Echo"), ch.unary_unary("/t.S/Unary")

        async def bidi(i: int) -> None:
            call = echo()
            await call.write(b"%d" % i)
            assert await call.read() == b"%d" % i
            if i % 3 == 0:
                call.cancel()  # some end by a client reset
            else:
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK

        async def worker(w: int) -> None:
            for i in range(w, 20_000, 50):
                if i % 2:
                    assert await single(b"%d" % i) == b"%d" % i
                else:
                    await bidi(i)

        await asyncio.gather(*(worker(w) for w in range(50)))
        await eventually(lambda: server.open_streams == 0, what="every stream forgotten")
        (conn,) = server._connections
        assert conn._streams == {} and conn._blocked == {} and conn._buffered == 0
        assert not conn._buf and not conn._out and conn._header_block is None
        assert conn._highest_stream >= 2 * 20_000 - 1
        gc.collect()
        assert len(Echo.live) == 0
