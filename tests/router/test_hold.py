"""What holds a stream's start back and what releases it (`kvstack.router.hold.scan`), on events as vLLM and
the simulator frame them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvstack.openai import errors
from kvstack.openai.sse import DONE, encode_error_event, encode_event
from kvstack.router import hold
from kvstack.sim import responses as R


def chat(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return encode_event({"id": "c", "object": "chat.completion.chunk", "choices": [choice], **extra})


def completion(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return encode_event({"id": "c", "object": "text_completion", "choices": [choice]})


ROLE = encode_event(R.chat_role_chunk("c", "m", 1, 0))


@pytest.mark.parametrize(
    "data",
    [
        ROLE,
        ROLE + ROLE,  # n > 1: one role chunk per choice
        chat({"content": ""}),
        chat({"content": None, "tool_calls": []}),
        chat({"role": "assistant", "content": ""}, usage={"prompt_tokens": 3, "completion_tokens": 0}),
        completion(""),
        b": keepalive\n\n",
        b"\n\n",
        ROLE.replace(b"\n\n", b"\r\n\r\n"),
        encode_event({"id": "c", "object": "chat.completion.chunk", "choices": []}),
    ],
    ids=[
        "role",
        "two-roles",
        "empty-content",
        "empty-tool-calls",
        "role-with-continuous-usage",
        "empty-text",
        "comment",
        "blank",
        "crlf",
        "no-choices-no-usage",
    ],
)
def test_events_before_any_content_are_held(data: bytes) -> None:
    assert hold.scan(data) == "hold"


@pytest.mark.parametrize(
    "data",
    [
        chat({"content": "Hi"}),
        ROLE + chat({"content": "Hi"}),
        chat({"reasoning_content": "hmm"}),
        chat({"reasoning": "hmm"}),
        chat({"tool_calls": [{"index": 0, "id": "t", "function": {"name": "f", "arguments": ""}}]}),
        chat({"content": ""}, finish="stop"),
        completion("Hi"),
        completion("", finish="length"),
        encode_event({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {"total": 1}}),
        DONE,
        b'event: response.created\ndata: {"type":"response.created","response":{}}\n\n',
        b"data: not json\n\n",
        b'data: {"choices":[{"delta":{"content":["a list"]}}]}\n\n',
        b"data: " + json.dumps({"choices": [], "pad": "x" * hold.SCAN_MAX}).encode() + b"\n\n",
        encode_error_event(errors.bad_request("prompt too long")),
    ],
    ids=[
        "content",
        "role-then-content",
        "reasoning-content",
        "reasoning",
        "tool-call",
        "finish-reason",
        "completion-text",
        "completion-finish",
        "usage-only",
        "done",
        "responses-api",
        "not-json",
        "unexpected-shape",
        "too-long-to-scan",
        "client-error-event",
    ],
)
def test_content_or_anything_unknown_releases(data: bytes) -> None:
    assert hold.scan(data) == "content"


@pytest.mark.parametrize(
    "data",
    [
        encode_error_event(errors.internal_error("EngineCore died")),
        ROLE + encode_error_event(errors.service_unavailable("overloaded")),
        b'data: {"error": "engine dead"}\n\n',
    ],
    ids=["500", "after-role", "no-code"],
)
def test_a_server_error_event_before_content_is_an_error(data: bytes) -> None:
    assert hold.scan(data) == "error"


def test_content_before_an_error_event_is_content() -> None:
    assert hold.scan(chat({"content": "Hi"}) + encode_error_event(errors.internal_error("x"))) == "content"
