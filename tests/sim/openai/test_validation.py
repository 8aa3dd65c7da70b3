"""Error wording as vLLM 0.32 words it: bad JSON, listed and bounded field errors, range messages, the
content type, and body decoding as Python's json module decodes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvstack.openai.errors import OpenAIError
from kvstack.sim.openai.protocol import (
    check_content_type,
    decode_body,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
)
from support.openai_bodies import LIMITS, chat, cmpl


def test_bad_json_names_the_offset_and_reason() -> None:
    with pytest.raises(OpenAIError) as info:
        parse_completion_request(b'{"model":"tiny","prompt":"hi","max_tokens":2,')
    assert info.value.message == (
        "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.45', 'msg': 'JSON decode error', "
        "'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double quotes'}}"
    )


def test_field_errors_are_listed_like_vllm() -> None:
    with pytest.raises(OpenAIError) as info:
        parse_completion_request(json.dumps(cmpl(max_tokens="x", temperature="y")))
    assert info.value.message == (
        "2 validation errors:\n"
        "  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, "
        "unable to parse string as an integer', 'input': 'x'}\n"
        "  {'type': 'float_parsing', 'loc': 'body.temperature', 'msg': 'Input should be a valid number, "
        "unable to parse string as a number', 'input': 'y'}"
    )


def test_error_dump_is_bounded() -> None:
    with pytest.raises(OpenAIError) as info:
        parse_detokenize_request(json.dumps({"tokens": ["x"] * 50}))
    assert info.value.message.startswith("50 validation errors:\n")
    assert info.value.message.endswith("  ...and 40 more errors")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (cmpl(max_tokens=-1), "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)"),
        (
            cmpl(temperature=-1),
            "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
        ),
        (cmpl(temperature=3), "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)"),
        (cmpl(top_p=0), "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)"),
        (cmpl(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
        (cmpl(n=0), "n must be at least 1, got 0."),
        (cmpl(n=2, temperature=0), "n must be 1 when using greedy sampling, got 2."),
        (
            cmpl(n=20000),
            "n must be at most 16384, got 20000. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable.",
        ),
        (cmpl(presence_penalty=3), "presence_penalty must be in [-2, 2], got 3.0."),
        (cmpl(repetition_penalty=0), "repetition_penalty must be greater than zero, got 0.0."),
        (cmpl(min_p=2), "min_p must be in [0, 1], got 2.0."),
        (cmpl(min_tokens=5, max_tokens=1), "min_tokens must be less than or equal to max_tokens=1, got 5."),
        (cmpl(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
        (cmpl(stop=["a", "a", ""]), "stop cannot contain an empty string."),
        (cmpl(bad_words=["a", "a", ""]), "bad_words cannot contain an empty string. Got bad_words=['a', '']"),
        (
            cmpl(logit_bias={"x": 1}),
            "logit_bias contains key(s) that cannot be converted to integer token IDs: ['x'] "
            "(parameter=logit_bias, value=['x'])",
        ),
        (cmpl(model="nope"), "The model `nope` does not exist. Valid aliases: tiny."),
        (
            cmpl(max_tokens=5000),
            "max_tokens=5000 cannot be greater than max_model_len=2048. Please request fewer output tokens. "
            "(parameter=max_tokens, value=5000)",
        ),
        (
            cmpl(prompt=""),
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
        ),
        (
            cmpl(stream_options={"include_usage": True}),
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        ),
        (cmpl(logprobs="x"), "`logprobs` must be an integer. (parameter=logprobs, value=x)"),
        (cmpl(prompt=[]), "You must pass at least one prompt"),
        (
            chat(messages=[]),
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
        ),
        (chat(messages=None), "'NoneType' object is not iterable"),
        (
            chat(top_logprobs=2),
            "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
        ),
        (
            chat(tools=[{"type": "function", "function": {"name": "f"}}]),
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
        ),
        (
            chat(messages=[{"role": "bogus", "content": [{"type": "bogus"}]}]),
            "Unsupported chat content part type: 'bogus'. Supported types: audio_embeds, audio_url, "
            "image_embeds, image_pil, image_url, input_audio, input_image, input_text, output_text, "
            "prompt_embeds, refusal, text, thinking, tool_reference, video_embeds, video_url. "
            "(parameter=type, value=bogus)",
        ),
    ],
)
def test_messages_match_vllm(body: dict[str, Any], message: str) -> None:
    parse = parse_chat_request if "messages" in body else parse_completion_request
    with pytest.raises(OpenAIError) as info:
        parse(json.dumps(body), LIMITS)
    assert info.value.message == message


def test_check_content_type() -> None:
    check_content_type("application/json")
    check_content_type("Application/JSON; charset=utf-8")
    for bad in (None, "", "text/plain", "application/json-patch+json"):
        with pytest.raises(OpenAIError) as info:
            check_content_type(bad)
        assert (info.value.status, info.value.err_type, info.value.param) == (400, "Bad Request", None)
        assert (
            info.value.message
            == "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
        )


def test_undecodable_body_keeps_fastapis_detail_shape() -> None:
    for body in (b'{"prompt":"\xff"}', b"[" * 100_000):
        with pytest.raises(OpenAIError) as info:
            parse_completion_request(body)
        assert info.value.status == 400
        assert info.value.body() == {"detail": "There was an error parsing the body"}


def test_integers_too_long_for_python_json_are_refused_like_vllm() -> None:
    with pytest.raises(OpenAIError) as info:
        parse_completion_request(b'{"prompt":"hi","max_tokens":' + b"9" * 5000 + b"}")
    assert info.value.body() == {"detail": "There was an error parsing the body"}


def test_decode_body_accepts_what_python_json_accepts() -> None:
    assert decode_body(b'{"a": NaN}')["a"] != decode_body(b'{"a": NaN}')["a"]
    assert decode_body('{"a": 1e400}') == {"a": float("inf")}
    assert decode_body(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}
    assert decode_body('{"a": "\\ud800"}') == {"a": "\ud800"}
    assert decode_body(b"") is None
    assert decode_body({"a": 1}) == {"a": 1}
