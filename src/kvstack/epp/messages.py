"""The ext_proc messages of the endpoint picker protocol, read and built (protos from ``xds-protos``).

- Reading: request and response headers as a lower-cased dict (Envoy sends values in ``raw_value``; older
  Envoys in ``value``), the subset hint (``envoy.lb.subset_hint`` →
  ``x-gateway-destination-endpoint-subset``), the served endpoint (``envoy.lb`` →
  ``x-gateway-destination-endpoint-served``).
- Building: the pick as the ``x-gateway-destination-endpoint`` header (overwritten, route cache cleared) and
  the same value in ``envoy.lb`` dynamic metadata; CONTINUE answers for every phase; an ImmediateResponse
  carrying an OpenAI error as JSON, marked ``kvstack.epp``/``picker_reply`` so Envoy's own error rewriting
  (`envoy_config`) leaves it alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from kvstack.epp.envoy_config import (
    DESTINATION,
    LB_NAMESPACE,
    PICKER_NAMESPACE,
    PICKER_REPLY,
    SERVED,
    SUBSET_NAMESPACE,
)
from kvstack.openai.errors import OpenAIError

SUBSET = "x-gateway-destination-endpoint-subset"

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse

_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def header_dict(headers: pb.HttpHeaders) -> dict[str, str]:
    """The headers of a headers message, names lower-cased; a repeated name keeps its first value."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        key = h.key.lower()
        if key not in out:
            out[key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints Envoy allows (``ip:port``), or None when it set no subset hint."""
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET not in fields:
        return None
    value = fields[SUBSET]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.string_value]
    if kind == "string_value":
        return [a.strip() for a in value.string_value.split(",") if a.strip()]
    return []


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint that served the request, as Envoy reports it on the response (None when absent)."""
    namespaces = request.metadata_context.filter_metadata
    if LB_NAMESPACE not in namespaces:
        return None
    fields = namespaces[LB_NAMESPACE].fields
    if SERVED not in fields:
        return None
    value = fields[SERVED]
    if value.WhichOneof("kind") == "list_value":
        items = [v.string_value for v in value.list_value.values if v.string_value]
        return items[-1] if items else None
    return value.string_value or None


def _set_headers(mutation: pb.HeaderMutation, headers: Iterable[tuple[str, str]]) -> None:
    for name, value in headers:
        mutation.set_headers.append(
            HeaderValueOption(
                header=HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
            )
        )


def _destination_metadata(response: pb.ProcessingResponse, value: str) -> None:
    lb = Struct()
    lb.fields[DESTINATION].string_value = value
    response.dynamic_metadata.fields[LB_NAMESPACE].struct_value.CopyFrom(lb)


def route(
    phase: str, addresses: Sequence[str], extra: Iterable[tuple[str, str]] = (), remove: Sequence[str] = ()
) -> pb.ProcessingResponse:
    """The answer to ``phase`` (``request_headers``, or ``request_body`` while Envoy holds the headers of a
    buffered body) naming the destination (pick first, then fallbacks), setting the ``extra`` headers and
    removing those named in ``remove``."""
    value = ",".join(addresses)
    response = pb.ProcessingResponse()
    common = getattr(response, phase).response
    common.clear_route_cache = True
    _set_headers(common.header_mutation, [(DESTINATION, value), *extra])
    common.header_mutation.remove_headers.extend(remove)
    _destination_metadata(response, value)
    return response


def streamed_body(body: bytes) -> pb.ProcessingResponse:
    """The whole request body, sent back in full-duplex streamed mode."""
    response = pb.ProcessingResponse()
    streamed = response.request_body.response.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = True
    return response


def proceed(phase: str) -> pb.ProcessingResponse:
    """CONTINUE, unchanged, for the message of ``phase`` (a ``ProcessingRequest`` oneof name: the answer's
    field of the same name)."""
    response = pb.ProcessingResponse()
    getattr(response, phase).SetInParent()
    return response


def immediate_error(err: OpenAIError, headers: Iterable[tuple[str, str]] = ()) -> pb.ProcessingResponse:
    """Answer the client directly with ``err`` as OpenAI error JSON (503 no endpoint, 429 shed, 400 ...)."""
    response = pb.ProcessingResponse()
    immediate = response.immediate_response
    immediate.status.code = err.status  # HttpStatus codes are the HTTP status numbers
    immediate.body = err.to_json()
    immediate.details = f"kvstack_epp_{err.status}"
    _set_headers(immediate.headers, [("content-type", "application/json"), *headers])
    # Marked, so that Envoy's local-reply rewriting (for its own errors) leaves this JSON as it is.
    response.dynamic_metadata.fields[PICKER_NAMESPACE].struct_value.fields[PICKER_REPLY].bool_value = True
    return response


__all__ = [
    "DESTINATION",
    "SERVED",
    "SUBSET",
    "ProcessingRequest",
    "ProcessingResponse",
    "header_dict",
    "immediate_error",
    "proceed",
    "route",
    "served_endpoint",
    "streamed_body",
    "subset_hint",
]
