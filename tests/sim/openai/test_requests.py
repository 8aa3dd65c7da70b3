"""What a parsed request holds: defaults, prompt forms, typed and normalised options, chat, tokenize and
detokenize fields."""

from __future__ import annotations

import json
from typing import Any

from kvstack.sim.openai.protocol import (
    ChatRequest,
    SamplingOptions,
    StreamOptions,
    check_lengths,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)
from support.openai_bodies import LIMITS, MSG, chat, cmpl


def test_completion_defaults() -> None:
    req = parse_completion_request(b'{"prompt": "hi"}')
    assert req.model is None
    assert req.prompts == ["hi"]
    assert req.stream is False
    assert req.stream_options == StreamOptions()
    assert req.options == SamplingOptions(max_tokens=16)
    assert req.add_special_tokens is True
    assert req.max_tokens_param == "max_tokens"
    assert req.extra == {}


def test_completion_prompt_forms() -> None:
    def prompts(value: Any) -> Any:
        return parse_completion_request(json.dumps(cmpl(prompt=value))).prompts

    assert prompts("hi") == ["hi"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts([[1, 2], [3]]) == [[1, 2], [3]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([True, "2", 3.0]) == [[1, 2, 3]]
    assert prompts(["1"]) == ["1"]
    assert prompts([[]]) == [[]]


def test_completion_options_are_typed_and_normalised() -> None:
    req = parse_completion_request(
        json.dumps(
            cmpl(
                max_tokens="7",
                temperature="0.5",
                top_p=1,
                n="2",
                seed=-1,
                stop="END",
                stop_token_ids=[3, 3, 4],
                logprobs=True,
                echo=True,
                logit_bias={"5": 500, "6": -1},
                stream="yes",
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                kv_transfer_params={"do_remote_decode": True},
                request_id="abc",
                priority=3,
                cache_salt="salt",
                user="u",
                response_format={"type": "text"},
                bogus=[1],
            )
        ),
        LIMITS,
    )
    o = req.options
    assert (o.max_tokens, o.temperature, o.top_p, o.n, o.seed) == (7, 0.5, 1.0, 2, None)
    assert o.stop == ["END"]
    assert o.stop_token_ids == [3, 4]
    assert (o.logprobs, o.prompt_logprobs, o.echo) == (1, 1, True)
    assert o.logit_bias == {5: 100.0, 6: -1.0}
    assert req.model == "tiny"
    assert req.stream is True
    assert req.stream_options == StreamOptions(include_usage=True, continuous_usage_stats=True)
    assert req.kv_transfer_params == {"do_remote_decode": True}
    assert (req.request_id, req.priority, req.cache_salt, req.user) == ("abc", 3, "salt", "u")
    assert req.extra == {"response_format": {"type": "text"}, "bogus": [1]}


def test_continuous_usage_needs_include_usage() -> None:
    req = parse_completion_request(
        json.dumps(cmpl(stream=True, stream_options={"continuous_usage_stats": True}))
    )
    assert req.stream_options == StreamOptions(include_usage=False, continuous_usage_stats=False)


def test_echo_with_zero_max_tokens() -> None:
    req = parse_completion_request(json.dumps(cmpl(echo=True, max_tokens=0)))
    assert req.echo_only
    assert check_lengths(2, req.options.max_tokens, 2048, echo_only=req.echo_only) == 1


def test_chat_request_fields() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    req = parse_chat_request(
        json.dumps(
            chat(
                max_tokens=9,
                max_completion_tokens=5,
                logprobs=True,
                top_logprobs=3,
                tools=tools,
                tool_choice="none",
                add_generation_prompt=False,
                continue_final_message=True,
                chat_template_kwargs={"x": 1},
                n=None,
            )
        )
    )
    assert req.messages == MSG
    assert req.options.max_tokens == 5
    assert req.max_tokens_param == "max_completion_tokens"
    assert req.options.logprobs == 3
    assert req.options.n == 1
    assert req.tools == tools
    assert (req.add_generation_prompt, req.continue_final_message) == (False, True)
    assert req.chat_template_kwargs == {"x": 1}
    assert req.has_media is False


def test_chat_defaults_leave_the_output_limit_to_the_context() -> None:
    req = parse_chat_request(json.dumps(chat()))
    assert req.options.max_tokens is None
    assert req.options.logprobs is None
    assert req.add_generation_prompt is True
    assert req.tool_choice == "none"
    assert check_lengths(19, req.options.max_tokens, 2048, chat=True, from_text=True) == 2029


def test_chat_reports_media_for_the_engine_to_refuse() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/a.png"}}
    req = parse_chat_request(json.dumps(chat(messages=[{"role": "user", "content": [image]}])))
    assert req.has_media


def test_chat_normalises_messages_without_touching_the_callers_body() -> None:
    body = chat(messages=[{"role": "assistant", "content": "x", "reasoning_content": "r", "tool_calls": []}])
    snapshot = json.loads(json.dumps(body))
    req = parse_chat_request(body)
    assert req.messages == [{"role": "assistant", "content": "x", "reasoning": "r", "tool_calls": []}]
    assert body == snapshot


def test_tokenize_forms() -> None:
    text = parse_tokenize_request(b'{"prompt": "hello", "add_special_tokens": false}')
    assert (text.prompt, text.messages, text.add_special_tokens) == ("hello", None, False)
    both = parse_tokenize_request(json.dumps({"prompt": "x", "messages": MSG}))
    assert both.messages == MSG
    assert both.prompt is None
    assert both.add_special_tokens is False
    as_chat = ChatRequest.for_tokenize(both)
    assert as_chat.messages == MSG
    assert as_chat.add_generation_prompt is True


def test_detokenize_keeps_out_of_vocabulary_ids() -> None:
    assert parse_detokenize_request(b'{"tokens": [1, "2", 99999]}').tokens == [1, 2, 99999]
