"""The picker served by grpcio's asyncio server: the ext_proc ``Process`` stream and grpc.health.v1 Check."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvstack.epp.health import PickerHealth
from kvstack.epp.picker import EndpointPicker

PROCESS_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def _identity(data: bytes) -> bytes:
    return data


class GrpcAioTransport:
    """A grpc.aio server with the picker's two services, listening on ``host:port`` (0 = a free port)."""

    def __init__(self, picker: EndpointPicker, health: PickerHealth, host: str, port: int) -> None:
        self.picker = picker
        self.health = health
        # Buffered request bodies arrive in one message: accept up to the picker's body limit.
        limit = picker.config.max_body_bytes + (1 << 20)
        self.server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ]
        )
        process = grpc.stream_stream_rpc_method_handler(
            self._process,
            request_deserializer=pb.ProcessingRequest.FromString,
            response_serializer=pb.ProcessingResponse.SerializeToString,
        )
        check = grpc.unary_unary_rpc_method_handler(
            self._check, request_deserializer=_identity, response_serializer=_identity
        )
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(PROCESS_SERVICE, {"Process": process}),
                grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": check}),
            )
        )
        self.port = self.server.add_insecure_port(f"{host}:{port}")

    async def start(self) -> None:
        await self.server.start()

    async def close(self, grace_s: float = 1.0) -> None:
        await self.server.stop(grace_s)

    async def _process(
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = self.picker.stream()
        try:
            async for request in requests:
                for response in await stream.handle(request):
                    yield response
        finally:
            stream.close()

    async def _check(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        answer = self.health.check(request)
        if answer is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return answer or b""
