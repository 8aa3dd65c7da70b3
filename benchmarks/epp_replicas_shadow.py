"""Asking a picker replica, as Envoy would, where a request would go; and reading what it based that on.

``ShadowAsker.pick`` opens an ext_proc stream on one replica, sends the request's headers and whole body
(BUFFERED, as Envoy does), reads the destination it answers, and half-closes the stream without a response:
the replica counts the request in flight only until that close, which ``pick`` waits for. ``engine_view``
turns a replica's ``/engines`` into what it scores by, per engine address; ``why_differ`` names the first
signal two replicas' views differ in.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

DESTINATION = "x-gateway-destination-endpoint"


class ShadowAsker:
    """ext_proc streams to one picker replica over one gRPC channel."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    async def pick(self, path: str, body: dict[str, Any], request_id: str) -> str:
        """The address the replica answers for this request (or ``status:<code>`` for an immediate answer)."""
        headers = [
            (":method", "POST"),
            (":path", path),
            (":authority", "envoy"),
            (":scheme", "http"),
            ("content-type", "application/json"),
            ("x-request-id", request_id),
        ]
        header_map = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])
        messages = [
            pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map)),
            pb.ProcessingRequest(
                request_body=pb.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)
            ),
        ]
        answered = asyncio.Event()

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            for message in messages:
                yield message
            await answered.wait()  # then half-close, as Envoy does when the request ends

        call = self.stub.Process(requests())
        pick = "none"
        async with asyncio.timeout(10):
            async for response in call:
                kind = response.WhichOneof("response")
                if kind == "immediate_response":
                    pick = f"status:{response.immediate_response.status.code}"
                    answered.set()
                elif kind == "request_body":
                    for option in response.request_body.response.header_mutation.set_headers:
                        if option.header.key == DESTINATION:
                            pick = option.header.raw_value.decode().split(",")[0]
                    answered.set()
        return pick

    async def close(self) -> None:
        await self.channel.close()


async def engines(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/engines", timeout=aiohttp.ClientTimeout(total=5)) as r:
        return dict(await r.json())


def engine_view(state: dict[str, Any], baseline: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Per engine address: the load signals scored (scraped queue and KV usage, in flight) and the KV event
    batches received, less ``baseline`` (address -> batches when the run started)."""
    out = {}
    for item in state["engines"]:
        metrics = item.get("metrics") or {}
        events = item.get("kv_events") or {}
        batches = events.get("batches")
        if batches is not None and baseline is not None:
            batches -= baseline.get(item["address"], 0)
        out[item["address"]] = {
            "queue": metrics.get("queue"),
            "kv_usage": metrics.get("kv_usage"),
            "metrics_age_s": metrics.get("age_seconds"),
            "in_flight": item.get("in_flight"),
            "kv_batches": batches,
        }
    return out


def batches(state: dict[str, Any]) -> dict[str, int]:
    """Per engine address, the KV event batches a replica has received so far."""
    return {item["address"]: (item.get("kv_events") or {}).get("batches") or 0 for item in state["engines"]}


def why_differ(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> str:
    """The first of in-flight, scrape, KV events in which two replicas' views differ; "not in /engines" if
    alike (a random tie-break, or replica-local history that /engines does not show)."""
    for cause, keys in (
        ("in-flight", ("in_flight",)),
        ("scrape", ("queue", "kv_usage")),
        ("kv-events", ("kv_batches",)),
    ):
        for address in a.keys() | b.keys():
            x, y = a.get(address, {}), b.get(address, {})
            if any(x.get(k) != y.get(k) for k in keys):
                return cause
    return "not in /engines"
