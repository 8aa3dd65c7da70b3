"""The picker served by kvstack's own gRPC server (`kvstack.http.grpc_server`): the ext_proc ``Process``
stream and grpc.health.v1 Check, on the picker's event loop.

Each ``Process`` call feeds Envoy's messages to one `PickerStream` in order. Messages answered at once
(headers in buffered mode, response phases) cost no task; a decision runs as one task, and messages that
arrive meanwhile wait for it. The call's end, a reset included (Envoy resets as often as it half-closes),
closes the picker stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError

from kvstack.epp.health import CHECK_METHOD, PickerHealth
from kvstack.epp.picker import Answers, EndpointPicker, PickerStream
from kvstack.http.grpc_server import GrpcError, GrpcServer, GrpcStream, Status, unary
from kvstack.http.listen import listening_socket

log = logging.getLogger(__name__)

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
_parse = pb.ProcessingRequest.FromString


class _ProcessCall:
    __slots__ = ("busy", "call", "ended", "stream", "waiting")

    def __init__(self, call: GrpcStream, stream: PickerStream) -> None:
        self.call = call
        self.stream = stream
        self.busy = False  # a decision is running: later messages wait in order
        self.waiting: deque[bytes] = deque()
        self.ended = False  # Envoy half-closed

    def on_message(self, data: bytes) -> None:
        if self.busy:
            self.waiting.append(data)
            return
        self._take(data)

    def _take(self, data: bytes) -> None:
        try:
            request = _parse(data)
        except DecodeError:
            self.call.finish(Status.INVALID_ARGUMENT, "not a ProcessingRequest")
            self.stream.close()
            return
        answers = self.stream.step(request)
        if isinstance(answers, list):
            self._send(answers)
            return
        self.busy = True
        task = asyncio.get_running_loop().create_task(answers)
        task.add_done_callback(self._decided)

    def _decided(self, task: asyncio.Task[Answers]) -> None:
        self.busy = False
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("picker decision failed", exc_info=error)
            self.call.finish(Status.INTERNAL, "picker decision failed")
            self.stream.close()
            return
        self._send(task.result())
        while self.waiting and not self.busy and not self.call.closed:
            self._take(self.waiting.popleft())
        if self.ended and not self.busy:
            self._finish()

    def _send(self, answers: Answers) -> None:
        for answer in answers:
            self.call.send(answer.SerializeToString())

    def on_end(self) -> None:
        self.ended = True
        if not self.busy:  # else once the decision is sent
            self._finish()

    def _finish(self) -> None:
        self.call.finish()
        self.stream.close()

    def on_reset(self) -> None:
        self.waiting.clear()
        self.stream.close()


class LeanTransport:
    """kvstack's gRPC server with the picker's two methods on ``host:port`` (0 = a free port)."""

    def __init__(self, picker: EndpointPicker, health: PickerHealth, host: str, port: int) -> None:
        self.picker = picker
        self.health = health
        self.host = host
        self.server = GrpcServer(
            {PROCESS_METHOD: self._process, CHECK_METHOD: unary(self._check)},
            # Buffered request bodies arrive in one message: accept up to the picker's body limit.
            max_message_bytes=picker.config.max_body_bytes + (1 << 20),
            max_concurrent_streams=1 << 16,
        )
        self._sock = listening_socket(host, port)
        self.port: int = self._sock.getsockname()[1]

    def _process(self, call: GrpcStream) -> _ProcessCall:
        return _ProcessCall(call, self.picker.stream())

    def _check(self, request: bytes) -> bytes:
        answer = self.health.check(request)
        if answer is None:
            raise GrpcError(Status.NOT_FOUND, "unknown service")
        return answer

    async def start(self) -> None:
        await self.server.start(self._sock)

    async def close(self, grace_s: float = 1.0) -> None:
        await self.server.close(grace_s)
