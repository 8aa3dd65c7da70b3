"""A test-only endpoint picker: an ext_proc gRPC server that gives Envoy the answer a test sets.

It exists to test Envoy's configuration (kvstack.epp.envoy_config), not picking. Per request it answers
``Answer.endpoints`` as the ``x-gateway-destination-endpoint`` header and the same value in dynamic metadata
``envoy.lb``, or an ImmediateResponse (``Answer.status`` with ``Answer.body``). It answers as late as the
body mode lets a picker read the prompt: on the buffered body (BUFFERED), on the headers (STREAMED: Envoy
routes before the body arrives), or after the whole body, which it then streams back (FULL_DUPLEX_STREAMED).
``seen`` keeps every message Envoy sent (phase, headers, body, forwarded metadata). It serves grpc.health.v1:
``liveness`` SERVING, ``readiness`` and the ext_proc service SERVING unless started not ready (a follower).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvstack.epp.envoy_config import DESTINATION, LB_NAMESPACE, PICKER_NAMESPACE, PICKER_REPLY
from support.ports import free_port

_BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
_STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# gRPC's default of 4 MiB would refuse a buffered body Envoy's limit (max_request_bytes) lets through.
_MAX_MESSAGE = 64 * 1024 * 1024


@dataclass
class Answer:
    """What the picker says about every request until a test changes it."""

    endpoints: str | None = None
    status: int | None = None
    body: bytes = b""
    delay_s: float = 0.0  # before answering, to outlast Envoy's message_timeout
    mark_reply: bool = True  # mark an ImmediateResponse as the picker's own (kvstack.epp/picker_reply)


@dataclass
class Seen:
    """One message Envoy sent: its phase (``request_headers``, ``response_headers``, ...) and contents."""

    phase: str
    metadata: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class FixedPicker(ep_grpc.ExternalProcessorServicer):
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.seen: list[Seen] = []

    def phases(self, phase: str) -> list[Seen]:
        return [s for s in self.seen if s.phase == phase]

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        body_mode = _BUFFERED
        held: list[bytes] = []  # a full-duplex body, sent back once the picker has answered
        answered = False
        async for request in request_iterator:
            phase = request.WhichOneof("request")
            self.seen.append(_seen(request))
            if request.HasField("protocol_config"):
                body_mode = request.protocol_config.request_body_mode
            if phase == "request_headers":
                if request.request_headers.end_of_stream or body_mode == _STREAMED:
                    yield await self._decision("request_headers")
                elif body_mode != _FULL_DUPLEX:
                    yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
            elif body_mode == _FULL_DUPLEX and phase in ("request_body", "request_trailers") and not answered:
                held.append(request.request_body.body)
                if phase == "request_trailers" or request.request_body.end_of_stream:
                    answered = True
                    for reply in await self._full_duplex_decision(b"".join(held)):
                        yield reply
            elif phase == "request_body" and request.request_body.end_of_stream and body_mode == _BUFFERED:
                yield await self._decision("request_body")
            else:
                yield _unchanged(phase)

    async def _full_duplex_decision(self, body: bytes) -> list[ep.ProcessingResponse]:
        """The headers' answer only now, then the body back whole: Envoy forwards what the picker sends."""
        decision = await self._decision("request_headers")
        if decision.HasField("immediate_response"):
            return [decision]
        streamed = ep.StreamedBodyResponse(body=body, end_of_stream=True)
        body_reply = ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=streamed))
        return [decision, ep.ProcessingResponse(request_body=ep.BodyResponse(response=body_reply))]

    async def _decision(self, phase: str) -> ep.ProcessingResponse:
        """The answer, as the reply to ``phase`` (``request_headers`` or ``request_body``)."""
        answer = self.answer
        if answer.delay_s:
            await asyncio.sleep(answer.delay_s)
        if answer.status is not None:
            reply = ep.ProcessingResponse(
                immediate_response=ep.ImmediateResponse(
                    status=http_status_pb2.HttpStatus(code=answer.status),
                    body=answer.body,
                    headers=ep.HeaderMutation(set_headers=[_header("content-type", "application/json")]),
                    details="fixed_picker",
                )
            )
            if answer.mark_reply:  # as kvstack's picker does: Envoy leaves the body alone
                reply.dynamic_metadata.update({PICKER_NAMESPACE: {PICKER_REPLY: True}})
            return reply
        common = ep.CommonResponse()
        if answer.endpoints is not None:
            common.header_mutation.set_headers.append(_header(DESTINATION, answer.endpoints))
        kind = ep.HeadersResponse if phase == "request_headers" else ep.BodyResponse
        reply = ep.ProcessingResponse(**{phase: kind(response=common)})
        if answer.endpoints is not None:
            reply.dynamic_metadata.update({LB_NAMESPACE: {DESTINATION: answer.endpoints}})
        return reply


def _unchanged(phase: str) -> ep.ProcessingResponse:
    if phase in ("request_trailers", "response_trailers"):
        return ep.ProcessingResponse(**{phase: ep.TrailersResponse()})
    if phase in ("request_body", "response_body"):
        return ep.ProcessingResponse(**{phase: ep.BodyResponse()})
    return ep.ProcessingResponse(**{phase: ep.HeadersResponse()})


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _seen(request: ep.ProcessingRequest) -> Seen:
    phase = request.WhichOneof("request")
    metadata = {name: _plain_struct(s) for name, s in request.metadata_context.filter_metadata.items()}
    message = getattr(request, phase)
    headers = {}
    if phase in ("request_headers", "response_headers"):
        headers = {h.key: h.raw_value.decode() or h.value for h in message.headers.headers}
    body = message.body if phase in ("request_body", "response_body") else b""
    return Seen(phase, metadata, headers, body)


def _plain_struct(struct: Any) -> dict[str, Any]:
    return {key: _plain(value) for key, value in struct.fields.items()}


def _plain(value: Any) -> Any:
    """A protobuf ``Value`` as plain Python."""
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return _plain_struct(value.struct_value)
    if kind == "list_value":
        return [_plain(v) for v in value.list_value.values]
    return None if kind == "null_value" else getattr(value, kind)


@dataclass
class RunningPicker:
    """A fixed picker served on 127.0.0.1:``port``."""

    picker: FixedPicker
    server: grpc.aio.Server
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.server.stop(grace=None)


async def start_fixed_picker(answer: Answer | None = None, *, ready: bool = True) -> RunningPicker:
    """Serve a FixedPicker and gRPC health in this event loop (``ready=False``: readiness NOT_SERVING)."""
    picker = FixedPicker(answer or Answer())
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE)])
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health = health_aio.HealthServicer()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    await health.set("liveness", serving)
    for service in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        await health.set(service, serving if ready else not_serving)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return RunningPicker(picker, server, port)
