"""Request parsing and validation: every rule answers as vLLM 0.32 does (status, type, param).

The expected outcomes were observed on a real vLLM 0.32 server serving the tiny model as "tiny"
(max_model_len 2048, vocabulary 4096). Pure tests: no server runs here.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError
from kvstack.sim.openai.protocol import (
    ChatRequest,
    SamplingOptions,
    ServingLimits,
    StreamOptions,
    check_content_type,
    check_engine_input,
    check_lengths,
    check_sampling,
    check_token_ids,
    decode_body,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
    resolve_model,
)

LIMITS = ServingLimits(served_models=("tiny",), max_model_len=2048)
VOCAB = 4096
MSG = [{"role": "user", "content": "hi"}]
Parse = Callable[..., Any]
PARSERS: dict[str, Parse] = {
    "cmpl": parse_completion_request,
    "chat": parse_chat_request,
    "tokenize": parse_tokenize_request,
    "detokenize": parse_detokenize_request,
}


def outcome(parse: Parse, body: Any, limits: ServingLimits | None = LIMITS) -> tuple[int, str, str | None]:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    with pytest.raises(OpenAIError) as info:
        parse(raw, limits)
    err = info.value
    return err.status, err.err_type, err.param


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MSG, **fields}


BAD = "Bad Request"  # FastAPI-level validation
BRE = "BadRequestError"  # vLLM's own checks

# (endpoint, body, status, type, param), each observed on vLLM 0.32.
VLLM_CASES: list[tuple[str, Any, int, str, str | None]] = [
    # body shape
    ("cmpl", '{"model":"tiny","prompt":"hi","max_tokens":2,', 400, BAD, "body.45"),
    ("cmpl", "   ", 400, BAD, "body.3"),
    ("cmpl", '{"model":"tiny"} x', 400, BAD, "body.17"),
    ("cmpl", "[1,2]", 400, BAD, "body"),
    ("cmpl", '"x"', 400, BAD, "body"),
    ("cmpl", "null", 400, BAD, "body"),
    ("cmpl", "", 400, BAD, "body"),
    ("tokenize", "[]", 400, BAD, "body"),
    # model
    ("cmpl", cmpl(model="nope"), 404, "NotFoundError", "model"),
    ("chat", chat(model="nope"), 404, "NotFoundError", "model"),
    ("tokenize", {"model": "nope", "prompt": "x"}, 404, "NotFoundError", "model"),
    ("detokenize", {"model": "nope", "tokens": [1]}, 404, "NotFoundError", "model"),
    ("cmpl", cmpl(model=5), 400, BAD, "body.model"),
    ("cmpl", cmpl(model="nope", temperature=-1), 404, "NotFoundError", "model"),
    # completions prompt
    ("cmpl", {"model": "tiny"}, 400, BRE, "prompt"),
    ("cmpl", cmpl(prompt=""), 400, BRE, "prompt"),
    ("cmpl", cmpl(prompt=None), 400, BRE, "prompt"),
    ("cmpl", cmpl(prompt=[]), 400, BRE, None),
    ("cmpl", cmpl(prompt=5), 400, BAD, "body.prompt"),
    ("cmpl", cmpl(prompt=True), 400, BAD, "body.prompt"),
    ("cmpl", cmpl(prompt={"a": 1}), 400, BAD, "body.prompt"),
    ("cmpl", cmpl(prompt=[1, "a"]), 400, BAD, "body.prompt.1"),
    ("cmpl", cmpl(prompt=[-1]), 400, BAD, "body.prompt.0"),
    ("cmpl", cmpl(prompt=["hi", [3]]), 400, BAD, "body.prompt.0"),
    ("cmpl", cmpl(prompt=[[1], [-1]]), 400, BAD, "body.prompt.0"),
    ("cmpl", cmpl(prompt=[[1], "a"]), 400, BAD, "body.prompt.0"),
    ("cmpl", cmpl(prompt="", stream_options={"include_usage": True}), 400, BRE, "prompt"),
    ("cmpl", cmpl(prompt="", max_tokens="x"), 400, BRE, "prompt"),
    ("cmpl", cmpl(prompt_embeds="abc"), 400, BRE, "prompt_embeds"),
    ("cmpl", cmpl(prompt_embeds=5), 400, BAD, "body.prompt_embeds"),
    ("cmpl", cmpl(prompt=["a"] * 1025), 400, BRE, "prompt"),
    ("cmpl", cmpl(suffix="x"), 400, BRE, "suffix"),
    # types
    ("cmpl", cmpl(max_tokens=1.5), 400, BAD, "body.max_tokens"),
    ("cmpl", cmpl(max_tokens=1e20), 400, BAD, "body.max_tokens"),
    ("cmpl", cmpl(max_tokens="x", temperature="y"), 400, BAD, "body.max_tokens"),
    ("cmpl", cmpl(temperature="a"), 400, BAD, "body.temperature"),
    ("cmpl", cmpl(n=None), 400, BAD, "body.n"),
    ("cmpl", cmpl(ignore_eos=None), 400, BAD, "body.ignore_eos"),
    ("cmpl", cmpl(min_tokens=None), 400, BAD, "body.min_tokens"),
    ("cmpl", cmpl(stream=2), 400, BAD, "body.stream"),
    ("cmpl", cmpl(echo=0.5), 400, BAD, "body.echo"),
    ("cmpl", cmpl(stop=5), 400, BAD, "body.stop"),
    ("cmpl", cmpl(stop=["a", 5]), 400, BAD, "body.stop"),
    ("cmpl", cmpl(stop=["a", "b", "c", "d", "e"]), 400, BAD, "body.stop"),
    ("cmpl", cmpl(stop_token_ids=["a"]), 400, BAD, "body.stop_token_ids.0"),
    ("cmpl", cmpl(stop_token_ids=5), 400, BAD, "body.stop_token_ids"),
    ("cmpl", cmpl(seed="x"), 400, BAD, "body.seed"),
    ("cmpl", cmpl(seed=99999999999999999999999), 400, BAD, "body.seed"),
    ("cmpl", cmpl(user=5), 400, BAD, "body.user"),
    ("cmpl", cmpl(request_id=5), 400, BAD, "body.request_id"),
    ("cmpl", cmpl(priority="x"), 400, BAD, "body.priority"),
    ("cmpl", cmpl(logit_bias={"5": "x"}), 400, BAD, "body.logit_bias.5"),
    ("cmpl", cmpl(kv_transfer_params=5), 400, BAD, "body.kv_transfer_params"),
    ("cmpl", cmpl(truncation_side="mid"), 400, BAD, "body.truncation_side"),
    ("cmpl", cmpl(truncate_prompt_tokens=-2), 400, BAD, "body.truncate_prompt_tokens"),
    ("cmpl", cmpl(stream=True, stream_options=5), 400, BAD, "body.stream_options"),
    (
        "cmpl",
        cmpl(stream=True, stream_options={"include_usage": "x"}),
        400,
        BAD,
        "body.stream_options.include_usage",
    ),
    ("cmpl", cmpl(response_format=5), 400, BAD, "body.response_format"),
    ("cmpl", cmpl(response_format={}), 400, BAD, "body.response_format.type"),
    ("cmpl", cmpl(response_format={"type": "bogus"}), 400, BAD, "body.response_format.type"),
    # vLLM's pre-validators
    ("cmpl", cmpl(stream_options={"include_usage": True}), 400, BRE, "stream_options"),
    ("cmpl", cmpl(stream=False, stream_options={"include_usage": True}), 400, BRE, "stream_options"),
    ("cmpl", cmpl(logprobs="x"), 400, BRE, "logprobs"),
    ("cmpl", cmpl(logprobs=-2), 400, BRE, "logprobs"),
    ("cmpl", cmpl(prompt_logprobs=-2), 400, BRE, "prompt_logprobs"),
    ("cmpl", cmpl(prompt_logprobs=1, stream=True), 400, BRE, "prompt_logprobs"),
    ("cmpl", cmpl(cache_salt=""), 400, BRE, "cache_salt"),
    ("cmpl", cmpl(cache_salt=5), 400, BRE, "cache_salt"),
    ("cmpl", cmpl(cache_salt="a/b"), 400, BRE, "cache_salt"),
    ("cmpl", cmpl(response_format={"type": "json_schema"}), 400, BRE, "response_format"),
    ("cmpl", cmpl(structured_outputs={"regex": "a+", "choice": ["a"]}), 400, BRE, "structured_outputs"),
    ("cmpl", cmpl(structured_outputs={}), 400, BRE, None),
    ("cmpl", cmpl(use_beam_search=True, stream=True), 400, BRE, None),
    ("cmpl", cmpl(media_io_kwargs={"a": 1}), 400, BRE, "media_io_kwargs"),
    # sampling ranges
    ("cmpl", cmpl(max_tokens=-1), 400, BRE, "max_tokens"),
    ("cmpl", cmpl(max_tokens=0), 400, BRE, "max_tokens"),
    ("cmpl", cmpl(max_tokens=-1, temperature=-1), 400, BRE, "temperature"),
    ("cmpl", cmpl(temperature=-1), 400, BRE, "temperature"),
    ("cmpl", cmpl(temperature=3), 400, BRE, "temperature"),
    ("cmpl", cmpl(temperature="inf"), 400, BRE, "temperature"),
    ("cmpl", '{"model":"tiny","prompt":"hi","temperature":NaN}', 400, BRE, "temperature"),
    ("cmpl", '{"model":"tiny","prompt":"hi","temperature":1e400}', 400, BRE, "temperature"),
    ("cmpl", cmpl(top_p=0), 400, BRE, "top_p"),
    ("cmpl", cmpl(top_p=1.5), 400, BRE, "top_p"),
    ("cmpl", cmpl(top_k=-2), 400, BRE, None),
    ("cmpl", cmpl(min_p=2), 400, BRE, None),
    ("cmpl", cmpl(n=0), 400, BRE, None),
    ("cmpl", cmpl(n=-1), 400, BRE, None),
    ("cmpl", cmpl(n=20000), 400, BRE, None),
    ("cmpl", cmpl(n=2, temperature=0), 400, BRE, None),
    ("cmpl", cmpl(presence_penalty=3), 400, BRE, None),
    ("cmpl", cmpl(frequency_penalty=-3), 400, BRE, None),
    ("cmpl", cmpl(repetition_penalty=0), 400, BRE, None),
    ("cmpl", cmpl(min_tokens=-1), 400, BRE, None),
    ("cmpl", cmpl(min_tokens=20), 400, BRE, None),
    ("cmpl", cmpl(stop=[""]), 400, BRE, None),
    ("cmpl", cmpl(bad_words=[""]), 400, BRE, None),
    ("cmpl", cmpl(logit_bias={"x": 1}), 400, BRE, "logit_bias"),
    # limits known before tokenizing
    ("cmpl", cmpl(max_tokens=5000), 400, BRE, "max_tokens"),
    ("cmpl", cmpl(prompt=[], max_tokens=5000), 400, BRE, "max_tokens"),
    ("cmpl", cmpl(truncate_prompt_tokens=5000), 400, BRE, "truncate_prompt_tokens"),
    ("chat", chat(max_completion_tokens=5000), 400, BRE, "max_completion_tokens"),
    ("chat", chat(max_tokens=5000), 400, BRE, "max_tokens"),
    ("chat", chat(max_tokens=3, max_completion_tokens=5000), 400, BRE, "max_completion_tokens"),
    ("chat", chat(max_completion_tokens=-1), 400, BRE, "max_tokens"),
    ("chat", chat(max_completion_tokens=0), 400, BRE, "max_tokens"),
    # chat messages
    ("chat", {"model": "tiny"}, 400, BAD, "body.messages"),
    ("chat", chat(messages="hi"), 400, BAD, "body.messages"),
    ("chat", chat(messages={"role": "user", "content": "hi"}), 400, BAD, "body.messages"),
    ("chat", chat(messages=None), 400, BRE, None),
    ("chat", chat(messages=5), 400, BRE, None),
    ("chat", chat(messages=[]), 400, BRE, None),
    ("chat", chat(messages=[5]), 400, BAD, "body.messages.0.ChatCompletionDeveloperMessageParam"),
    ("chat", chat(messages=[{}]), 400, BAD, "body.messages.0.ChatCompletionDeveloperMessageParam.content"),
    (
        "chat",
        chat(messages=[{"content": "x"}]),
        400,
        BAD,
        "body.messages.0.ChatCompletionDeveloperMessageParam.role",
    ),
    (
        "chat",
        chat(messages=[{"role": 5, "content": "x"}]),
        400,
        BAD,
        "body.messages.0.ChatCompletionDeveloperMessageParam.role",
    ),
    (
        "chat",
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        BAD,
        "body.messages.0.ChatCompletionDeveloperMessageParam.content",
    ),
    (
        "chat",
        chat(messages=[{"role": "user", "content": None}]),
        400,
        BAD,
        "body.messages.0.ChatCompletionDeveloperMessageParam.content",
    ),
    (
        "chat",
        chat(messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": 5}]),
        400,
        BAD,
        "body.messages.1.ChatCompletionDeveloperMessageParam.content",
    ),
    (
        "chat",
        chat(messages=[{"role": "user", "content": "hi", "name": 5}]),
        400,
        BAD,
        "body.messages.0.ChatCompletionDeveloperMessageParam.role",
    ),
    (
        "chat",
        chat(messages=[{"role": "tool", "content": [5]}]),
        400,
        BAD,
        "body.messages.0.ChatCompletionDeveloperMessageParam.role",
    ),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "bogus"}]}]), 400, BRE, None),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, BRE, None),
    ("chat", chat(messages=[{"role": "user", "content": ["hi"]}]), 400, BRE, None),
    ("chat", chat(messages=[{"role": "user", "content": [5]}]), 400, BRE, None),
    ("chat", chat(messages=[{"role": "user", "content": {"a": 1}}]), 400, BRE, None),
    ("chat", chat(messages=[{"role": "bogus", "content": [{"type": "bogus"}]}]), 400, BRE, "type"),
    ("chat", chat(messages=[{"role": "bogus", "content": [{"text": "x"}]}]), 400, BRE, "type"),
    ("chat", chat(messages=[{"role": "user", "content": "hi", "tool_calls": 5}]), 400, BRE, None),
    # chat options
    ("chat", chat(stream_options={"include_usage": True}), 400, BRE, "stream_options"),
    ("chat", chat(top_logprobs=2), 400, BRE, "top_logprobs"),
    ("chat", chat(top_logprobs=-2), 400, BRE, "top_logprobs"),
    ("chat", chat(top_logprobs="x", logprobs=True), 400, BRE, "top_logprobs"),
    ("chat", chat(logprobs=5), 400, BAD, "body.logprobs"),
    ("chat", chat(continue_final_message=True), 400, BRE, None),
    ("chat", chat(continue_final_message=True, add_generation_prompt=True), 400, BRE, None),
    ("chat", chat(tools=[]), 400, BRE, "tools"),
    ("chat", chat(tools=[5]), 400, BAD, "body.tools.0"),
    ("chat", chat(tool_choice="auto"), 400, BRE, "tool_choice"),
    (
        "chat",
        chat(tool_choice="bogus", tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        BRE,
        "tool_choice",
    ),
    (
        "chat",
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        BRE,
        "tool_choice",
    ),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, BRE, None),
    (
        "chat",
        chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"),
        400,
        BRE,
        None,
    ),
    ("chat", chat(chat_template_kwargs=5), 400, BAD, "body.chat_template_kwargs"),
    ("chat", chat(chat_template=5), 400, BAD, "body.chat_template"),
    ("chat", chat(chat_template="{{ x }}"), 400, BRE, None),
    ("chat", chat(media_io_kwargs={"a": 1}), 400, BAD, "body.media_io_kwargs.a"),
    ("chat", chat(mm_processor_kwargs={"x": "y"}), 400, BRE, "mm_processor_kwargs"),
    ("chat", chat(temperature=-1), 400, BRE, "temperature"),
    ("chat", chat(n=0), 400, BRE, None),
    # tokenize / detokenize
    ("tokenize", {"model": "tiny"}, 400, BAD, "body.prompt"),
    ("tokenize", {"model": "tiny", "prompt": 5}, 400, BAD, "body.prompt"),
    ("tokenize", {"model": "tiny", "prompt": [1, 2]}, 400, BAD, "body.prompt"),
    ("tokenize", {"model": "tiny", "messages": 5}, 400, BAD, "body.prompt"),
    ("tokenize", {"model": "tiny", "messages": []}, 400, BRE, None),
    ("tokenize", {"model": "tiny", "messages": MSG, "continue_final_message": True}, 400, BRE, None),
    (
        "tokenize",
        {"model": "tiny", "messages": MSG, "continue_final_message": True, "add_generation_prompt": True},
        400,
        BRE,
        None,
    ),
    ("tokenize", {"model": "tiny", "prompt": "hi", "media_io_kwargs": {"a": 1}}, 400, BRE, "media_io_kwargs"),
    ("detokenize", {"model": "tiny"}, 400, BAD, "body.tokens"),
    ("detokenize", {"model": "tiny", "tokens": [-1]}, 400, BAD, "body.tokens.0"),
    ("detokenize", {"model": "tiny", "tokens": "abc"}, 400, BAD, "body.tokens"),
    ("detokenize", {"model": "tiny", "tokens": [1, "a"]}, 400, BAD, "body.tokens.1"),
    ("detokenize", {"model": "tiny", "tokens": [99999999999999999999]}, 400, BAD, "body.tokens.0"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "err_type", "param"), VLLM_CASES)
def test_rejected_as_vllm_does(
    endpoint: str, body: Any, status: int, err_type: str, param: str | None
) -> None:
    assert outcome(PARSERS[endpoint], body) == (status, err_type, param)


# Bodies vLLM 0.32 accepts, some thanks to pydantic's lax coercions.
ACCEPTED: list[tuple[str, Any]] = [
    ("cmpl", cmpl(max_tokens="5")),
    ("cmpl", cmpl(max_tokens="  5 ")),
    ("cmpl", cmpl(max_tokens="5.0")),
    ("cmpl", cmpl(max_tokens=2.0)),
    ("cmpl", cmpl(max_tokens=True)),
    ("cmpl", cmpl(max_tokens=None)),
    ("cmpl", cmpl(max_tokens=2048)),
    ("cmpl", cmpl(temperature=True)),
    ("cmpl", cmpl(temperature="0.5")),
    ("cmpl", cmpl(stream="yes")),
    ("cmpl", cmpl(stream="TRUE")),
    ("cmpl", cmpl(stream=1)),
    ("cmpl", cmpl(stream=1.0)),
    ("cmpl", cmpl(stream=True, stream_options={"bogus": True})),
    ("cmpl", cmpl(stream=True, stream_options=None)),
    ("cmpl", cmpl(stream_options=None)),
    ("cmpl", cmpl(n="2")),
    ("cmpl", cmpl(top_k=0)),
    ("cmpl", cmpl(top_k=-1)),
    ("cmpl", cmpl(logprobs=20)),
    ("cmpl", cmpl(logprobs=True)),
    ("cmpl", cmpl(seed=-1)),
    ("cmpl", cmpl(stop="x")),
    ("cmpl", cmpl(stop=None)),
    ("cmpl", cmpl(stop_token_ids=None)),
    ("cmpl", cmpl(model=None)),
    ("cmpl", cmpl(model="")),
    ("cmpl", {"prompt": "hi"}),
    ("cmpl", cmpl(bogus=1, best_of=2)),
    ("cmpl", cmpl(prompt=["hi", "there"])),
    ("cmpl", cmpl(prompt=[[1, 2], [3]])),
    ("cmpl", cmpl(prompt=[1.0, 2])),
    ("cmpl", cmpl(prompt=[True])),
    ("cmpl", cmpl(prompt=["1"])),
    ("cmpl", cmpl(prompt=[1, "2"])),
    ("cmpl", cmpl(prompt=[[]])),
    ("cmpl", cmpl(prompt=[99999])),
    ("cmpl", cmpl(echo=True, max_tokens=0)),
    ("cmpl", cmpl(response_format={"type": "text"})),
    ("cmpl", cmpl(structured_outputs={"regex": "a+"})),
    ("cmpl", cmpl(kv_transfer_params={"a": 1})),
    ("cmpl", cmpl(routed_experts_prompt_start=2)),
    ("cmpl", '\ufeff{"model":"tiny","prompt":"hi"}'.encode()),
    ("cmpl", b'{"model":"tiny","prompt":"hi","max_tokens":1,"max_tokens":2}'),
    ("chat", chat()),
    ("chat", chat(messages=[{"role": "user"}])),
    ("chat", chat(messages=[{"role": "bogus", "content": "x"}])),
    ("chat", chat(messages=[{"role": "user", "content": ""}])),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])),
    ("chat", chat(messages=[{"role": "user", "content": ["hi"], "reasoning": "r"}])),
    ("chat", chat(messages=[{"role": "assistant", "content": None}])),
    ("chat", chat(messages=[{"role": "assistant"}])),
    ("chat", chat(messages=[{"role": "assistant", "content": "hi", "tool_call_id": 5}])),
    ("chat", chat(messages=[{"role": "tool", "content": "x"}])),
    ("chat", chat(messages=[{"role": "tool", "content": ["x"]}])),
    ("chat", chat(messages=[{"role": "function", "content": None, "name": "f"}])),
    ("chat", chat(messages=[{"role": "bogus", "content": [{"type": "text"}]}])),
    ("chat", chat(messages=[{"role": "user", "content": []}])),
    ("chat", chat(n=None)),
    ("chat", chat(logprobs="yes")),
    ("chat", chat(max_tokens=5000, max_completion_tokens=3)),
    ("chat", chat(continue_final_message=True, add_generation_prompt=False)),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")),
    ("chat", chat(mm_processor_kwargs={})),
    ("tokenize", {"model": "tiny", "prompt": ""}),
    ("tokenize", {"prompt": "hello world", "return_token_strs": True}),
    ("tokenize", {"model": "tiny", "messages": MSG, "prompt": "x"}),
    ("detokenize", {"tokens": []}),
    ("detokenize", {"model": "tiny", "tokens": [99999]}),
]


@pytest.mark.parametrize(("endpoint", "body"), ACCEPTED)
def test_accepted_as_vllm_does(endpoint: str, body: Any) -> None:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    PARSERS[endpoint](raw, LIMITS)


# -- messages and wording --------------------------------------------------------------------------------


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


# -- what a parsed request holds ---------------------------------------------------------------------------


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


def test_serving_flags_lift_vllm_defaults() -> None:
    trusting = ServingLimits(
        served_models=("tiny", "alias"),
        max_model_len=2048,
        trust_request_chat_template=True,
        trust_request_mm_kwargs=True,
        enable_auto_tool_choice=True,
        tool_call_parser=True,
    )
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = chat(
        model="alias", tools=tools, tool_choice="required", chat_template="x", mm_processor_kwargs={"a": 1}
    )
    assert parse_chat_request(json.dumps(body), trusting).model == "alias"
    auto_only = ServingLimits(served_models=("tiny",), max_model_len=2048, enable_auto_tool_choice=True)
    parse_chat_request(json.dumps(chat(tools=tools)), auto_only)
    assert outcome(parse_chat_request, chat(tools=tools, tool_choice="required"), auto_only) == (
        400,
        BRE,
        None,
    )


def test_without_limits_parsing_skips_engine_facts() -> None:
    req = parse_completion_request(json.dumps(cmpl(model="other", max_tokens=5000)), None)
    assert req.model == "other"
    assert req.options.max_tokens == 5000


def test_resolve_model() -> None:
    assert resolve_model(None, ["a", "b"]) == "a"
    assert resolve_model("", ["a", "b"]) == "a"
    assert resolve_model("b", ["a", "b"]) == "b"
    with pytest.raises(OpenAIError) as info:
        resolve_model("c", ["a", "b"])
    assert info.value.message == "The model `c` does not exist. Valid aliases: a, b."


# -- lengths, sampling and engine checks -------------------------------------------------------------------


def test_check_lengths_clamps_to_the_room_left() -> None:
    assert check_lengths(2, 16, 2048) == 16
    assert check_lengths(2, None, 2048) == 16
    assert check_lengths(2, None, 2048, chat=True) == 2046
    assert check_lengths(2047, 2, 2048) == 1
    assert check_lengths(2000, 100, 2048) == 48
    assert check_lengths(2, 2048, 2048) == 2046


def test_check_lengths_prompt_too_long() -> None:
    with pytest.raises(OpenAIError) as info:
        check_lengths(2100, 16, 2048)
    err = info.value
    assert (err.status, err.err_type, err.param) == (400, "BadRequestError", "input_tokens")
    assert err.message == (
        "This model's maximum context length is 2048 tokens. However, your prompt contains 2100 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
        "input prompt. (parameter=input_tokens, value=2100)"
    )
    # vLLM stops tokenizing text one token past the limit, so the count it reports is a lower bound.
    with pytest.raises(OpenAIError, match="contains at least 2049 input tokens") as info:
        check_lengths(5000, 16, 2048, from_text=True)
    assert info.value.param == "input_tokens"
    with pytest.raises(OpenAIError, match="contains at least 2049 input tokens"):
        check_lengths(2049, 16, 2048)


def test_check_lengths_no_room_left() -> None:
    with pytest.raises(OpenAIError) as info:
        check_lengths(2048, 1, 2048)
    assert info.value.message == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    assert info.value.param == "max_tokens"


def test_check_lengths_bound_comes_first_and_names_the_field() -> None:
    with pytest.raises(OpenAIError) as info:
        check_lengths(5000, 5000, 2048, max_tokens_param="max_completion_tokens")
    assert info.value.param == "max_completion_tokens"


def test_check_lengths_min_tokens_against_the_effective_limit() -> None:
    with pytest.raises(OpenAIError) as info:
        check_lengths(19, None, 2048, chat=True, min_tokens=3000)
    assert info.value.message == "min_tokens must be less than or equal to max_tokens=2029, got 3000."
    assert info.value.param is None


def test_check_sampling_accepts_defaults() -> None:
    check_sampling(SamplingOptions(), None)
    check_sampling(SamplingOptions(temperature=0.0, n=1, top_k=-1), 1)


def test_check_sampling_nan_penalty() -> None:
    with pytest.raises(OpenAIError, match=r"presence_penalty must be in \[-2, 2\], got nan\."):
        check_sampling(SamplingOptions(presence_penalty=float("nan")), None)


@pytest.mark.parametrize(
    ("options", "message", "param"),
    [
        (
            SamplingOptions(logprobs=21),
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
            "logprobs",
        ),
        (
            SamplingOptions(logprobs=-1),
            "Requested sample logprobs of 4096, which is greater than max allowed: 20",
            "logprobs",
        ),
        (
            SamplingOptions(prompt_logprobs=-1),
            "Requested prompt logprobs of 4096, which is greater than max allowed: 20",
            "prompt_logprobs",
        ),
        (
            SamplingOptions(logit_bias={99999: 1.0}, stop_token_ids=[99999]),
            "token_id(s) [99999] in logit_bias contain out-of-vocab token ids. Vocabulary size: 4096",
            "logit_bias",
        ),
        (
            SamplingOptions(stop_token_ids=[-1]),
            "token_id(s) [-1] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 4096",
            "stop_token_ids",
        ),
        (
            SamplingOptions(allowed_token_ids=[]),
            "allowed_token_ids is not None and empty!",
            "allowed_token_ids",
        ),
        (
            SamplingOptions(allowed_token_ids=[99999]),
            "allowed_token_ids contains out-of-vocab token id!",
            "allowed_token_ids",
        ),
    ],
)
def test_check_engine_input_options(options: SamplingOptions, message: str, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        check_engine_input(options, [1, 2], VOCAB)
    assert info.value.message.startswith(message)
    assert (info.value.status, info.value.err_type, info.value.param) == (400, "BadRequestError", param)


def test_check_engine_input_prompt() -> None:
    check_engine_input(SamplingOptions(logprobs=20), [0, 4095], VOCAB)
    for ids, message in (
        ([], "The decoder prompt cannot be empty"),
        ([99999], "Token id 99999 is out of vocabulary"),
    ):
        with pytest.raises(OpenAIError) as info:
            check_engine_input(SamplingOptions(), ids, VOCAB)
        assert (info.value.message, info.value.param) == (message, None)
    with pytest.raises(OpenAIError, match="between 0 and the prompt length \\(2\\), inclusive") as info:
        check_engine_input(SamplingOptions(routed_experts_prompt_start=3), [1, 2], VOCAB)
    assert info.value.param == "routed_experts_prompt_start"


def test_check_engine_input_uses_the_configured_logprob_limit() -> None:
    check_engine_input(SamplingOptions(logprobs=-1), [1], VOCAB, max_logprobs=-1)
    check_engine_input(SamplingOptions(logprobs=50), [1], VOCAB, max_logprobs=50)


def test_check_token_ids() -> None:
    check_token_ids([], VOCAB)
    check_token_ids([0, 4095], VOCAB)
    for ids, bad in (([4096], 4096), ([5, 99999, 7], 99999), ([-3, 99999], -3)):
        with pytest.raises(OpenAIError) as info:
            check_token_ids(ids, VOCAB)
        assert info.value.message == f"Token id {bad} is out of vocabulary"
        assert info.value.param is None
    with pytest.raises(OpenAIError) as info:
        check_token_ids([4096], VOCAB, param="kv_transfer_params.prompt_token_ids")
    assert info.value.param == "kv_transfer_params.prompt_token_ids"


# -- error shapes ---------------------------------------------------------------------------------


def test_error_body_shape_and_key_order() -> None:
    err = errors.not_found_model("nope", ["tiny"])
    assert list(err.body()["error"]) == ["message", "type", "param", "code"]
    assert err.to_json() == (
        b'{"error":{"message":"The model `nope` does not exist. Valid aliases: tiny.",'
        b'"type":"NotFoundError","param":"model","code":404}}'
    )


@pytest.mark.parametrize(
    ("err", "status", "err_type"),
    [
        (errors.bad_request("x"), 400, "BadRequestError"),
        (errors.invalid_parameter("x", "p", 1), 400, "BadRequestError"),
        (errors.invalid_json(3, "Expecting value"), 400, "Bad Request"),
        (errors.unsupported_media_type(), 400, "Bad Request"),
        (errors.too_long_prompt(2100, 2048), 400, "BadRequestError"),
        (errors.engine_overloaded(), 503, "Service Unavailable"),
        (errors.rate_limited("slow down"), 429, "RateLimitError"),
        (errors.internal_error(), 500, "InternalServerError"),
        (errors.service_unavailable(), 503, "ServiceUnavailableError"),
        (errors.gateway_timeout("engine http://e:8000 did not answer in 30s"), 504, "GatewayTimeoutError"),
    ],
)
def test_error_constructors(err: OpenAIError, status: int, err_type: str) -> None:
    assert (err.status, err.err_type) == (status, err_type)
    assert err.body()["error"]["code"] == status
    msgspec.json.decode(err.to_json())


def test_invalid_parameter_wording() -> None:
    assert errors.invalid_parameter("m", "p", 0).message == "m (parameter=p, value=0)"
    assert errors.invalid_parameter("m", "p").message == "m (parameter=p)"
    assert errors.invalid_parameter("m").message == "m"


def test_http_detail_errors() -> None:
    assert errors.http_detail(404).body() == {"detail": "Not Found"}
    assert errors.http_detail(405).body() == {"detail": "Method Not Allowed"}


# -- nothing but OpenAIError, whatever the body ----------------------------------------------------

_ATOMS: list[Any] = [None, True, False, 0, 1, -1, 2, 21, 5000, 2**70, -(2**64), 1.5, -0.0, 1e20, float("inf")]
_ATOMS += ["", "x", "5", "1.0", "yes", "none", "auto", "text", "user", "\ud800", "a/b"]
_KEYS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "logit_bias",
    "tools",
    "tool_choice",
    "role",
    "content",
    "name",
    "type",
    "text",
    "function",
    "include_usage",
    "continuous_usage_stats",
    "cache_salt",
    "structured_outputs",
    "response_format",
    "continue_final_message",
    "add_generation_prompt",
    "tokens",
    "prompt_embeds",
    "bad_words",
    "min_tokens",
    "allowed_token_ids",
    "tool_calls",
    "image_url",
    "truncate_prompt_tokens",
    "chat_template_kwargs",
    "logprob_token_ids",
    "use_beam_search",
    "kv_transfer_params",
    "media_io_kwargs",
    "json",
    "regex",
    "choice",
]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.55:
        return rng.choice(_ATOMS)
    if roll < 0.75:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(_KEYS): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _random_body(rng: random.Random) -> Any:
    base: dict[str, Any] = rng.choice(
        [cmpl(), chat(), {"prompt": "hi"}, {"messages": MSG}, {"tokens": [1, 2]}, {}]
    )
    body = json.loads(json.dumps(base))
    for _ in range(rng.randint(0, 5)):
        body[rng.choice(_KEYS)] = _random_value(rng)
    if rng.random() < 0.05:
        return _random_value(rng)
    return body


def _encode(rng: random.Random, body: Any) -> bytes | str:
    text = json.dumps(body, allow_nan=True)
    if rng.random() < 0.1:  # corrupt it
        cut = rng.randint(0, len(text))
        text = text[:cut] + rng.choice(["", "}", "{", ",", '"', "\\", "NaN", "\x00"]) + text[cut + 1 :]
    if rng.random() < 0.3:
        return text
    return text.encode("utf-8", "surrogatepass")


def test_random_bodies_raise_nothing_but_openai_errors() -> None:
    rng = random.Random(2024)
    accepted = 0
    for _ in range(4000):
        body = _encode(rng, _random_body(rng))
        for parse in PARSERS.values():
            for limits in (LIMITS, None):
                try:
                    req = parse(body, limits)
                except OpenAIError as err:
                    msgspec.json.decode(err.to_json())  # always encodable
                    assert 400 <= err.status < 500
                    continue
                accepted += 1
                _run_engine_checks(req)
    assert accepted > 100  # the generator also produces valid bodies


def _run_engine_checks(req: Any) -> None:
    options = getattr(req, "options", None)
    if options is None:
        return
    try:
        limit = check_lengths(
            3, options.max_tokens, 2048, chat=isinstance(req, ChatRequest), min_tokens=options.min_tokens
        )
        assert limit >= 1
        check_engine_input(options, [1, 2, 3], VOCAB)
    except OpenAIError as err:
        assert err.status == 400


def test_random_bytes_raise_nothing_but_openai_errors() -> None:
    rng = random.Random(7)
    alphabet = b'{}[]":,0123456789.-+eE truefalsnul\\\xff\xef\xbb\xbf'
    for _ in range(3000):
        body = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        for parse in PARSERS.values():
            with contextlib.suppress(OpenAIError):
                parse(body, LIMITS)
