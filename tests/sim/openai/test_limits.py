"""What the serving engine allows: server flags, served model names, prompt and output lengths against
the context, sampling ranges, and engine input (logprobs limit, ids against the vocabulary)."""

from __future__ import annotations

import json

import pytest

from kvstack.openai.errors import OpenAIError
from kvstack.sim.openai.protocol import (
    SamplingOptions,
    ServingLimits,
    check_engine_input,
    check_lengths,
    check_sampling,
    check_token_ids,
    parse_chat_request,
    parse_completion_request,
    resolve_model,
)
from support.openai_bodies import BRE, VOCAB, chat, cmpl, outcome


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
