"""The P/D requests as built from a client's (pure): the prefill body, the decode body, what a prefill
answer gives, which requests are served whole, and how engines are named in ``x-prefiller-host-port``."""

from __future__ import annotations

import json

import pytest

from kvstack.frontend import pd


def test_the_prefill_body_asks_for_one_unstreamed_token_and_keeps_the_kv() -> None:
    client = {
        "model": "m", "prompt": "hello", "max_tokens": 200, "min_tokens": 5, "n": 3, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0.2, "user": "u",
    }  # fmt: skip
    sent = json.loads(pd.prefill_body("/v1/completions", client))
    assert sent == {
        "model": "m", "prompt": "hello", "max_tokens": 1, "stream": False, "temperature": 0.2, "user": "u",
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }  # fmt: skip
    assert client["max_tokens"] == 200 and "stream_options" in client  # the client's body is left alone


def test_a_chat_prefill_caps_max_completion_tokens_too() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50}
    sent = json.loads(pd.prefill_body("/v1/chat/completions", chat))
    assert sent["max_completion_tokens"] == 1 and sent["max_tokens"] == 1


def test_the_decode_body_is_the_clients_with_the_prefills_params() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p0"}
    client = {"model": "m", "prompt": "hello", "stream": True, "stream_options": {"include_usage": True}}
    assert json.loads(pd.decode_body(client, params)) == {**client, "kv_transfer_params": params}


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (b'{"kv_transfer_params": {"remote_block_ids": [3]}, "usage": {"prompt_tokens": 40}}',
         ({"remote_block_ids": [3]}, 40)),
        (b'{"kv_transfer_params": null, "usage": {"prompt_tokens": 40}}', (None, 40)),
        (b'{"kv_transfer_params": {}}', (None, None)),
        (b'{"kv_transfer_params": {"a": 1}, "usage": {"prompt_tokens": true}}', ({"a": 1}, None)),
        (b"[1, 2]", (None, None)),
        (b"<html>bad gateway</html>", (None, None)),
    ],
)  # fmt: skip
def test_what_a_prefill_answer_gives(answer: bytes, expected: tuple[object, object]) -> None:
    assert pd.transfer_params(answer) == expected


def test_requests_served_whole() -> None:
    assert not pd.unsupported("/v1/completions", {"prompt": "one"})
    assert not pd.unsupported("/v1/completions", {"prompt": [1, 2, 3]})  # one prompt as token ids
    assert not pd.unsupported("/v1/chat/completions", {"messages": []})
    assert pd.unsupported("/v1/completions", {"prompt": ["one", "two"]})
    assert pd.unsupported("/v1/completions", {"prompt": [[1, 2], [3]]})
    assert pd.unsupported("/v1/embeddings", {"input": "x"})
    assert pd.unsupported(
        "/v1/completions", {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}
    )


def test_engines_are_named_by_host_and_port() -> None:
    assert pd.host_port("http://10.0.0.5:8000") == "10.0.0.5:8000"
    assert pd.host_port("http://prefill-0.pool/v1") == "prefill-0.pool:80"
    assert pd.host_port("https://p.example") == "p.example:443"
    assert pd.host_port("http://[fd00::5]:8000") == "[fd00::5]:8000"
