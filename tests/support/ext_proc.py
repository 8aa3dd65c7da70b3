"""Talking to an endpoint picker as Envoy does: ext_proc streams over a real grpc.aio channel."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

BUFFERED, STREAMED, FULL_DUPLEX = 2, 1, 4


def headers_message(
    path: str = "/v1/completions",
    *,
    method: str = "POST",
    end_of_stream: bool = False,
    extra: Sequence[tuple[str, str]] = (),
    body_mode: int | None = None,
    subset: list[str] | None = None,
) -> pb.ProcessingRequest:
    pairs = [
        (":method", method),
        (":path", path),
        (":authority", "envoy"),
        ("content-type", "application/json"),
    ]
    header_map = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in [*pairs, *extra]])
    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=end_of_stream)
    )
    if body_mode is not None:
        request.protocol_config.request_body_mode = body_mode
        request.protocol_config.send_body_without_waiting_for_header_response = body_mode == STREAMED
    if subset is not None:
        hint = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        allowed = hint.fields["x-gateway-destination-endpoint-subset"].list_value
        allowed.SetInParent()
        for address in subset:
            allowed.values.add().string_value = address
    return request


def body_message(body: bytes | dict[str, Any], *, end_of_stream: bool = True) -> pb.ProcessingRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=end_of_stream))


def response_headers_message(status: int, served: str | None = None) -> pb.ProcessingRequest:
    header_map = HeaderMap(headers=[HeaderValue(key=":status", raw_value=str(status).encode())])
    request = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map))
    if served is not None:
        lb = request.metadata_context.filter_metadata["envoy.lb"]
        lb.fields["x-gateway-destination-endpoint-served"].string_value = served
    return request


def response_body_message(body: bytes, *, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def destination(response: pb.ProcessingResponse) -> tuple[str | None, str | None]:
    """(the destination header the answer sets, the envoy.lb metadata value)."""
    kind = response.WhichOneof("response")
    common = getattr(response, kind).response
    header = None
    for option in common.header_mutation.set_headers:
        if option.header.key == "x-gateway-destination-endpoint":
            header = option.header.raw_value.decode()
    meta = None
    if "envoy.lb" in response.dynamic_metadata.fields:
        lb = response.dynamic_metadata.fields["envoy.lb"].struct_value
        if "x-gateway-destination-endpoint" in lb.fields:
            meta = lb.fields["x-gateway-destination-endpoint"].string_value
    return header, meta


def immediate(response: pb.ProcessingResponse) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON body, headers) of an ImmediateResponse."""
    assert response.WhichOneof("response") == "immediate_response", response
    im = response.immediate_response
    headers = {o.header.key: o.header.raw_value.decode() for o in im.headers.set_headers}
    return im.status.code, json.loads(im.body), headers


class ExtProcStream:
    """One Process stream: send messages, read the picker's answers one by one."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self._queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._requests())
        self._iter = self.call.__aiter__()

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            yield item

    def send(self, request: pb.ProcessingRequest) -> None:
        self._queue.put_nowait(request)

    async def receive(self) -> pb.ProcessingResponse:
        async with asyncio.timeout(5.0):
            return await self._iter.__anext__()

    async def exchange(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        self.send(request)
        return await self.receive()

    async def close(self) -> None:
        """Half-close, as Envoy does when the HTTP request is done, and wait for the picker to end."""
        self._queue.put_nowait(None)
        async for _ in self._iter:
            pass

    def cancel(self) -> None:
        self.call.cancel()


class ExtProcClient:
    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def stream(self) -> ExtProcStream:
        return ExtProcStream(self.stub)

    async def check(self, service: str) -> int:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)

    async def close(self) -> None:
        await self.channel.close()
