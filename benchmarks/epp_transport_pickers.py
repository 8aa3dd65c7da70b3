"""The trivial endpoint pickers ``epp_transport.py`` measures: one fixed answer, behind three transports.

Every picker reads each ProcessingRequest Envoy sends (request headers, then the buffered request body) and
answers it: request headers with an empty HeadersResponse, the body with a BodyResponse that sets the header
``x-gateway-destination-endpoint: <destination>`` and the dynamic metadata ``envoy.lb`` with the same key, as
an endpoint picker of the Gateway API inference extension answers. The message is parsed and the answer built
for every request, as a real picker would; only the transport differs:

- ``grpcio``: grpcio's asyncio server (``grpc.aio``), a generic bidi method on bytes;
- ``lean``: ``kvstack.http.grpc_server`` (callbacks per call) on uvloop;
- ``http``: Envoy's ``http_service``: each ProcessingRequest POSTed as JSON, served by kvstack's HTTP/1.1
  server (``kvstack.http.server``) on uvloop, answered in ProcessingResponse JSON.

    .venvs/dev/bin/python benchmarks/epp_transport_pickers.py --transport lean --port 9100 \\
        --destination 127.0.0.1:9000
"""

# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import socket
import sys

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEADER = "x-gateway-destination-endpoint"


# -- the answer --------------------------------------------------------------------------------------------
def answer(data: bytes, destination: str, route_on: str, header: str | None = None) -> bytes:
    """The ProcessingResponse (serialized) to one ProcessingRequest (serialized); the destination goes in the
    answer to ``route_on`` (``body``, or ``headers`` when Envoy sends no body); the header carries ``header``
    when given (a probe of the dynamic metadata), else the destination too."""
    request = ext_proc.ProcessingRequest.FromString(data)
    kind = request.WhichOneof("request")
    if kind == "request_headers" and route_on == "body":
        return ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse()).SerializeToString()
    if kind != f"request_{route_on}":
        raise ValueError(f"unexpected ProcessingRequest {kind}")
    set_header = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=HEADER, raw_value=(header or destination).encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    common = ext_proc.CommonResponse(header_mutation=ext_proc.HeaderMutation(set_headers=[set_header]))
    lb = struct_pb2.Struct()
    lb.fields[HEADER].string_value = destination
    if route_on == "body":
        response = ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common))
    else:
        response = ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse(response=common))
    response.dynamic_metadata.fields["envoy.lb"].struct_value.CopyFrom(lb)
    return response.SerializeToString()


def answer_json(body: bytes, destination: str, header: str | None = None) -> bytes:
    """The same answer in ProcessingResponse JSON to the request headers in JSON (Envoy's http_service, which
    sends no body)."""
    request = json.loads(body)  # proto field names, bytes in base64 (as Envoy 1.40 writes it)
    if "request_headers" not in request:
        raise ValueError(f"unexpected ProcessingRequest {sorted(request)}")
    raw = base64.b64encode((header or destination).encode()).decode()
    mutation = {
        "setHeaders": [
            {"header": {"key": HEADER, "rawValue": raw}, "appendAction": "OVERWRITE_IF_EXISTS_OR_ADD"}
        ]
    }
    response = {
        "requestHeaders": {"response": {"headerMutation": mutation}},
        "dynamicMetadata": {"envoy.lb": {HEADER: destination}},
    }
    return json.dumps(response, separators=(",", ":")).encode()


# -- the transports --------------------------------------------------------------------------------------
def listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


async def until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_grpcio(port: int, destination: str, route_on: str, header: str | None) -> None:
    import grpc

    async def process(requests, context):  # type: ignore[no-untyped-def]
        async for data in requests:
            yield answer(data, destination, route_on, header)

    handler = grpc.method_handlers_generic_handler(
        "envoy.service.ext_proc.v3.ExternalProcessor",
        {"Process": grpc.stream_stream_rpc_method_handler(process)},
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"picker grpcio: 127.0.0.1:{port}", flush=True)
    await until_signalled()
    await server.stop(1)


async def serve_lean(port: int, destination: str, route_on: str, header: str | None) -> None:
    from kvstack.http.grpc_server import GrpcServer, GrpcStream

    class Picker:
        __slots__ = ("stream",)

        def __init__(self, stream: GrpcStream) -> None:
            self.stream = stream

        def on_message(self, data: bytes) -> None:
            self.stream.send(answer(data, destination, route_on, header))

        def on_end(self) -> None:
            self.stream.finish()

        def on_reset(self) -> None:
            pass

    server = GrpcServer({PROCESS: Picker})
    await server.start(listen(port))
    print(f"picker lean: 127.0.0.1:{port}", flush=True)
    await until_signalled()
    await server.close(1)


async def serve_http(port: int, destination: str, route_on: str, header: str | None) -> None:
    from kvstack.http.server import Connection, HttpServer, Request, Response

    json_type = [("Content-Type", "application/json")]

    async def handle(request: Request, conn: Connection) -> Response:
        return Response(200, answer_json(request.body, destination, header), json_type)

    server = HttpServer(handle, max_body=64 << 20)
    await server.start(listen(port))
    print(f"picker http: 127.0.0.1:{port}", flush=True)
    await until_signalled()
    await server.close(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--transport", choices=("grpcio", "lean", "http"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--destination", required=True, help="host:port every request is sent to")
    parser.add_argument(
        "--route-on",
        choices=("body", "headers"),
        default="body",
        help="the message answered with the destination",
    )
    parser.add_argument("--header-destination", help="a different address for the header (metadata probe)")
    args = parser.parse_args(argv)
    if args.transport == "http" and args.route_on != "headers":
        parser.error("Envoy's http_service sends no body: --route-on headers")
    if args.transport == "grpcio":
        # grpc.aio runs on asyncio's own loop
        asyncio.run(serve_grpcio(args.port, args.destination, args.route_on, args.header_destination))
        return 0
    import uvloop

    serve = serve_lean if args.transport == "lean" else serve_http
    uvloop.run(serve(args.port, args.destination, args.route_on, args.header_destination))
    return 0


if __name__ == "__main__":
    sys.exit(main())
