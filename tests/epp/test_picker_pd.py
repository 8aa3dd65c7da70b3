"""The picker names the prefill engine of a disaggregated request in ``x-prefiller-host-port`` (for the decode
engine's sidecar), on the body's answer and on the headers' answer, and removes a client's own value."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvstack.frontend.pd import PREFILLER_HEADER
from support.ext_proc import FULL_DUPLEX, body_message, destination, headers_message
from support.pd import FixedDecision
from support.pickers import PickerStack
from support.routers import MODEL

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}


def disaggregate(stack: PickerStack, monkeypatch: pytest.MonkeyPatch, prefill: list[str]) -> None:
    """Every request: decode on engine 0, prefill on ``prefill``."""
    picker = FixedDecision([stack.engines[0].url], prefill)
    monkeypatch.setattr(stack.epp.front, "picker", picker)


def header_mutation(answer: pb.ProcessingResponse) -> tuple[dict[str, str], list[str]]:
    """(the headers an answer sets, the ones it removes)."""
    kind = answer.WhichOneof("response")
    mutation = getattr(answer, kind).response.header_mutation
    sets = {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}
    return sets, list(mutation.remove_headers)


async def test_a_disaggregated_request_names_its_prefill_engine(
    picker_stack: PickerStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    disaggregate(picker_stack, monkeypatch, [picker_stack.engines[1].url, picker_stack.engines[0].url])
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message())
    answer = await stream.exchange(body_message(BODY))
    header, _ = destination(answer)
    assert header is not None and header.split(",")[0] == picker_stack.address(0)
    sets, removed = header_mutation(answer)
    assert sets[PREFILLER_HEADER] == picker_stack.address(1)  # the first prefill engine
    assert removed == []
    await stream.close()


async def test_the_prefill_engine_is_named_on_the_headers_answer_in_full_duplex(
    picker_stack: PickerStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    disaggregate(picker_stack, monkeypatch, [picker_stack.engines[1].url])
    stream = picker_stack.client.stream()
    stream.send(headers_message(body_mode=FULL_DUPLEX))
    answer = await stream.exchange(body_message(BODY))
    assert answer.WhichOneof("response") == "request_headers"
    sets, _ = header_mutation(answer)
    assert sets[PREFILLER_HEADER] == picker_stack.address(1)
    await stream.receive()  # the body, sent back
    await stream.close()


async def test_a_client_cannot_choose_the_prefill_engine(
    picker_stack: PickerStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    disaggregate(picker_stack, monkeypatch, [])
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message(extra=[(PREFILLER_HEADER, picker_stack.address(1))]))
    answer = await stream.exchange(body_message(BODY))
    sets, removed = header_mutation(answer)
    assert PREFILLER_HEADER not in sets
    assert removed == [PREFILLER_HEADER]
    await stream.close()


async def test_a_whole_request_carries_no_prefill_header(picker_stack: PickerStack) -> None:
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message())
    sets, removed = header_mutation(await stream.exchange(body_message(BODY)))
    assert PREFILLER_HEADER not in sets and removed == []
    await stream.close()
