"""SSE framing as vLLM writes it, and the incremental parser fed arbitrary chunkings."""

from __future__ import annotations

import json
import random

import pytest

from kvstack.openai import errors
from kvstack.openai.sse import DONE, DONE_PAYLOAD, SSEParser, encode_error_event, encode_event


def test_encode_event_is_compact_utf8_json() -> None:
    event = encode_event({"id": "cmpl-1", "choices": [{"text": "é\x13", "logprobs": None}], "n": 1.5})
    assert (
        event == b'data: {"id":"cmpl-1","choices":[{"text":"\xc3\xa9\\u0013","logprobs":null}],"n":1.5}\n\n'
    )


def test_done_marker() -> None:
    assert DONE == b"data: [DONE]\n\n"


def test_error_event_uses_json_dumps_spacing_like_vllm() -> None:
    # vLLM writes in-stream errors with json.dumps: spaced separators, ASCII escapes.
    event = encode_error_event(errors.bad_request("Token id 99999 is out of vocabulary"))
    assert event == (
        b'data: {"error": {"message": "Token id 99999 is out of vocabulary", "type": "BadRequestError", '
        b'"param": null, "code": 400}}\n\n'
    )


def test_parser_reads_events_in_one_chunk() -> None:
    parser = SSEParser()
    stream = encode_event({"a": 1}) + encode_event({"b": 2}) + DONE
    assert parser.feed(stream) == [b'{"a":1}', b'{"b":2}', DONE_PAYLOAD]
    assert not parser.has_partial


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_parser_accepts_every_line_ending_split_anywhere(newline: bytes) -> None:
    stream = b"".join(b"data: " + p + newline + newline for p in (b'{"x":1}', b"second", b"[DONE]"))
    expected = [b'{"x":1}', b"second", b"[DONE]"]
    for cut in range(len(stream) + 1):
        parser = SSEParser()
        got = parser.feed(stream[:cut]) + parser.feed(stream[cut:])
        assert got == expected, cut
        assert not parser.has_partial


def test_parser_byte_by_byte_with_crlf() -> None:
    stream = b"data: one\r\n\r\ndata: two\r\n\r\n"
    parser = SSEParser()
    got = [p for i in range(len(stream)) for p in parser.feed(stream[i : i + 1])]
    assert got == [b"one", b"two"]


def test_parser_joins_multiline_data_and_skips_comments_and_other_fields() -> None:
    parser = SSEParser()
    stream = b": keep-alive\n\nevent: message\nid: 7\ndata: line1\ndata:line2\nretry: 10\n\n"
    assert parser.feed(stream) == [b"line1\nline2"]


def test_parser_skips_events_without_data() -> None:
    parser = SSEParser()
    assert parser.feed(b"\n\nevent: ping\n\ndata:\n\ndata: x\n\n") == [b"x"]


def test_parser_reports_a_truncated_event() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"partial"') == []
    assert parser.has_partial
    assert parser.feed(b":1}\n") == []
    assert parser.has_partial
    assert parser.feed(b"\n") == [b'{"partial":1}']
    assert not parser.has_partial


def test_parser_bounds_an_endless_event() -> None:
    parser = SSEParser(max_event_bytes=64)
    with pytest.raises(ValueError, match="larger than 64 bytes"):
        for _ in range(10):
            parser.feed(b"data: " + b"x" * 20 + b"\n")


def test_parser_round_trips_random_payloads_under_random_chunking() -> None:
    rng = random.Random(7)
    for _ in range(200):
        payloads = [
            {"i": i, "text": "".join(rng.choice('ab \u00e9\u2028:\\"') for _ in range(rng.randint(0, 12)))}
            for i in range(rng.randint(1, 6))
        ]
        stream = b"".join(encode_event(p) for p in payloads) + DONE
        parser = SSEParser()
        got: list[bytes] = []
        pos = 0
        while pos < len(stream):
            step = rng.randint(1, 9)
            got += parser.feed(stream[pos : pos + step])
            pos += step
        assert got[-1] == DONE_PAYLOAD
        assert [json.loads(g) for g in got[:-1]] == payloads
