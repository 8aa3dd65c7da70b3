"""Token usage from the tail of response bodies."""

from __future__ import annotations

import json

from kvstack.epp.usage import TAIL_BYTES, UsageTail


def _tail(*chunks: bytes) -> UsageTail:
    tail = UsageTail()
    for chunk in chunks:
        tail.feed(chunk)
    return tail


def test_a_json_answer_gives_its_usage() -> None:
    body = {
        "id": "x",
        "choices": [{"text": "a" * 20000}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}},
        "kv_transfer_params": None,
    }
    raw = json.dumps(body).encode()
    usage = _tail(*(raw[i : i + 1000] for i in range(0, len(raw), 1000))).usage()
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (12, 5)


def test_the_last_sse_event_with_usage_wins() -> None:
    events = [b'data: {"choices":[{"text":"x"}],"usage":null}\n\n'] * 50
    events.append(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":50}}\n\n')
    events.append(b"data: [DONE]\n\n")
    usage = _tail(*events).usage()
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 50)


def test_no_usage_or_a_cut_usage_is_none() -> None:
    assert _tail(b'{"choices": []}').usage() is None
    assert _tail(b'{"usage": {"prompt_tokens": 3').usage() is None
    assert _tail(b'{"usage": {"prompt_tokens": "many"}}').usage() is None


def test_memory_is_bounded_by_the_tail() -> None:
    tail = _tail(*(b"z" * 4096 for _ in range(100)))
    assert len(tail.tail) == TAIL_BYTES
