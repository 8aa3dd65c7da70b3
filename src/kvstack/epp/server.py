"""Assemble and run the endpoint picker: the shared front end (`kvstack.frontend.assembly`), the picker, its
gRPC transport (ext_proc ``Process`` and grpc.health.v1 on ``grpc_port``) and its HTTP port (metrics,
engines, health), all built here and passed in.

At shutdown the picker first reports NOT_SERVING for ``drain_s`` seconds (Envoy's health checks move new
requests to the other replicas), then stops, letting open streams finish for ``grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from kvstack.epp.app import PickerHttpApp
from kvstack.epp.grpc_aio import GrpcAioTransport
from kvstack.epp.grpc_lean import LeanTransport
from kvstack.epp.health import PickerHealth
from kvstack.epp.picker import EndpointPicker, PickerConfig
from kvstack.frontend.assembly import FrontEnd, FrontEndOptions, build_front_end
from kvstack.frontend.metrics import RouterMetrics
from kvstack.http.listen import listening_socket
from kvstack.http.server import HttpServer

log = logging.getLogger(__name__)

TRANSPORTS = ("lean", "grpcio")  # kvstack's own gRPC server (the default), or grpcio's asyncio server


class Transport(Protocol):
    port: int

    async def start(self) -> None: ...

    async def close(self, grace_s: float = 1.0) -> None: ...


@dataclass
class EppOptions(FrontEndOptions):
    # Replicas decide alike: no replica-local scorers, hash tie-break (kvstack.scheduling.presets).
    auto_routing: tuple[str, str] = ("default-replicas", "kv-aware-replicas")
    host: str = "127.0.0.1"
    grpc_port: int = 9002  # 0 = a free port
    http_port: int = 9090  # metrics, engines, health; 0 = a free port
    transport: str = "lean"
    picker: PickerConfig = field(default_factory=PickerConfig)
    drain_s: float = 0.0
    grace_s: float = 1.0


@dataclass
class RunningEpp:
    grpc_address: str  # host:port of the ext_proc service
    http_url: str
    picker: EndpointPicker
    front: FrontEnd
    health: PickerHealth
    transport: Transport
    http: HttpServer
    options: EppOptions

    async def stop(self) -> None:
        self.health.ready = False
        try:
            if self.options.drain_s > 0:
                await asyncio.sleep(self.options.drain_s)
            await self.transport.close(self.options.grace_s)
            await self.http.close()
        finally:
            await self.front.stop()


async def start_epp(opts: EppOptions) -> RunningEpp:
    if opts.transport not in TRANSPORTS:
        raise ValueError(f"transport {opts.transport!r}: choose one of {', '.join(TRANSPORTS)}")
    front = build_front_end(opts, RouterMetrics())
    picker = EndpointPicker(front, opts.picker)
    health = PickerHealth()
    transport: Transport = (
        LeanTransport(picker, health, opts.host, opts.grpc_port)
        if opts.transport == "lean"
        else GrpcAioTransport(picker, health, opts.host, opts.grpc_port)
    )
    http = PickerHttpApp(front, picker).server()
    try:
        await transport.start()
        sock = listening_socket(opts.host, opts.http_port, backlog=1024)
        await http.start(sock)
    except BaseException:
        await transport.close(0)
        await http.close()
        await front.side_calls.close()
        raise
    front.start()
    health.ready = True
    http_port = sock.getsockname()[1]
    return RunningEpp(
        f"{opts.host}:{transport.port}",
        f"http://{opts.host}:{http_port}",
        picker,
        front,
        health,
        transport,
        http,
        opts,
    )


@contextlib.asynccontextmanager
async def running_epp(opts: EppOptions) -> AsyncIterator[RunningEpp]:
    epp = await start_epp(opts)
    try:
        yield epp
    finally:
        await epp.stop()


async def serve_forever(opts: EppOptions) -> None:
    async with running_epp(opts) as epp:
        log.info("endpoint picker: ext_proc on %s, HTTP on %s", epp.grpc_address, epp.http_url)
        print(
            f"kvstack epp: ext_proc grpc://{epp.grpc_address} http {epp.http_url} "
            f"({len(opts.engines)} engine(s), routing {opts.routing!r}, transport {opts.transport})",
            flush=True,
        )
        await asyncio.Event().wait()
