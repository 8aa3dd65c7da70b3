"""Stage 2 of request parsing: vLLM's pre-validators, which see the raw body before field types are checked.

They run in vLLM's order and answer ``BadRequestError`` (400) with the offending ``param``: an empty
prompt, ``stream_options`` without ``stream``, logprobs signs, tool choice, cache salt, structured
output constraints. Some also normalize the body in place as vLLM does (the completions
``max_tokens`` default, ``tool_choice`` "auto" when tools are given, chat messages' ``tool_calls``
and ``reasoning_content``), so callers pass a copy.
"""

from __future__ import annotations

from typing import Any

from kvstack.openai import errors
from kvstack.sim.openai.requests import COMPLETION_DEFAULT_MAX_TOKENS

MAX_COMPLETION_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
_MAX_CACHE_SALT = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
_TOOL_CHOICES = ("none", "auto", "required")


def prevalidate_completion(data: dict[str, Any]) -> None:
    """The /v1/completions pre-validators, in vLLM's order."""
    prompt = data.get("prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and not isinstance(prompt[0], int)
        and len(prompt) > MAX_COMPLETION_PROMPTS
    ):
        message = (
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
            f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS "
            "environment variable."
        )
        raise errors.invalid_parameter(message, "prompt")
    embeds = data.get("prompt_embeds")
    if (prompt is None or prompt == "") and (embeds is None or embeds == []):
        message = "Either prompt or prompt_embeds must be provided and non-empty."
        raise errors.invalid_parameter(message, "prompt")
    _check_stream_options(data)
    _check_logprob_token_ids(data, data.get("logprobs") is not None, "set")
    _check_logprob_numbers(data, "logprobs")
    _check_structured_outputs(data, "structured_outputs")
    _check_response_format(data)
    if data.get("max_tokens") is None:
        data["max_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS
    _check_cache_salt(data)
    _check_constraint_given(data)


def prevalidate_chat(data: dict[str, Any]) -> None:
    """The /v1/chat/completions pre-validators, in vLLM's order."""
    messages = data.get("messages", [])
    if messages is None or isinstance(messages, (bool, int, float)):
        # vLLM iterates the raw value before checking its type; Python's TypeError becomes the 400.
        raise errors.bad_request(f"'{type(messages).__name__}' object is not iterable")
    check_generation_prompt(data)
    _check_tool_usage(data)
    if _check_structured_outputs(data, None) and data.get("tool_choice", "none") not in _TOOL_CHOICES:
        raise errors.bad_request(
            "You can only either use constraints for structured outputs or tools, not both."
        )
    _check_logprob_token_ids(data, bool(data.get("logprobs")), "set to true")
    _check_logprob_numbers(data, "top_logprobs")
    top = data.get("top_logprobs")
    if top is not None and (top == -1 or top > 0) and not data.get("logprobs"):
        message = "when using `top_logprobs`, `logprobs` must be set to true."
        raise errors.invalid_parameter(message, "top_logprobs")
    _check_stream_options(data)
    _check_response_format(data)
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            calls = message.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                if isinstance(calls, (bool, int, float)):
                    raise errors.bad_request(f"'{type(calls).__name__}' object is not iterable")
                message["tool_calls"] = list(calls)
            reasoning = message.pop("reasoning_content", None)
            if reasoning is not None and message.get("reasoning") is None:
                message["reasoning"] = reasoning
    _check_cache_salt(data)
    _check_constraint_given(data)


def check_generation_prompt(data: dict[str, Any]) -> None:
    """Refuse ``continue_final_message`` together with ``add_generation_prompt`` (chat and /tokenize)."""
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise errors.bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )


def _check_logprob_token_ids(data: dict[str, Any], logprobs_set: bool, requirement: str) -> None:
    # Completions need a `logprobs` count, chat needs its flag true: `requirement` words which.
    if not data.get("logprob_token_ids"):
        return
    if data.get("use_beam_search"):
        raise errors.invalid_parameter(
            "`logprob_token_ids` is not supported with beam search.", "logprob_token_ids"
        )
    if not logprobs_set:
        message = f"when using `logprob_token_ids`, `logprobs` must be {requirement}."
        raise errors.invalid_parameter(message, "logprob_token_ids")


def _check_logprob_numbers(data: dict[str, Any], output_name: str) -> None:
    """``prompt_logprobs`` and the output logprobs count `output_name`: numbers, positive or -1."""
    names = ("prompt_logprobs", output_name)
    for name in names:
        value = data.get(name)
        if value is not None and not isinstance(value, (int, float)):
            raise errors.invalid_parameter(f"`{name}` must be an integer.", name, value)
    prompt_logprobs = data.get("prompt_logprobs")
    if prompt_logprobs is not None and data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise errors.invalid_parameter(
            "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )
    for name in names:
        value = data.get(name)
        if value is not None and value < 0 and value != -1:
            raise errors.invalid_parameter(f"`{name}` must be a positive value or -1.", name, value)


def _check_cache_salt(data: dict[str, Any]) -> None:
    salt = data.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise errors.invalid_parameter(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > _MAX_CACHE_SALT or any(c in _CACHE_SALT_FORBIDDEN for c in salt):
        message = (
            f"Parameter 'cache_salt' must be at most {_MAX_CACHE_SALT} characters and must "
            "not contain '@', '/', '\\\\', or NUL."
        )
        raise errors.invalid_parameter(message, "cache_salt")


def _check_stream_options(data: dict[str, Any]) -> None:
    # Raw truthiness, as vLLM: "stream": "false" counts as set here.
    if data.get("stream_options") and not data.get("stream"):
        raise errors.invalid_parameter(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )


def _check_response_format(data: dict[str, Any]) -> None:
    rf = data.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and rf.get("json_schema") is None:
        message = "When response_format type is 'json_schema', the 'json_schema' field must be provided."
        raise errors.invalid_parameter(message, "response_format")


def _check_structured_outputs(data: dict[str, Any], param: str | None) -> int:
    """How many constraints `structured_outputs` sets; more than one is refused."""
    so = data.get("structured_outputs")
    if not isinstance(so, dict):
        return 0  # vLLM answers 500 for a non-object here; kvstack lets the type check say 400
    count = sum(so.get(k) is not None for k in ("json", "regex", "choice"))
    if count > 1:
        message = (
            "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice')."
        )
        raise errors.invalid_parameter(message, param)
    return count


def _check_constraint_given(data: dict[str, Any]) -> None:
    # Raised while the field is validated, it preempts every field type error.
    so = data.get("structured_outputs")
    kinds = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
    if isinstance(so, dict) and all(so.get(k) is None for k in kinds):
        message = f"You must use one kind of structured outputs constraint but none are specified: {so}"
        raise errors.bad_request(message)


def _check_tool_usage(data: dict[str, Any]) -> None:
    if data.get("tools") == []:
        message = (
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely."
        )
        raise errors.invalid_parameter(message, "tools")
    if "tool_choice" not in data and data.get("tools"):
        data["tool_choice"] = "auto"
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return
    if data.get("tools") is None:
        raise errors.invalid_parameter("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        message = (
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
            "are supported."
        )
        raise errors.invalid_parameter(message, "tool_choice")
    if not isinstance(choice, dict):
        return
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        message = f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}"
        raise errors.invalid_parameter(message, "tool_choice.function")
    if "name" not in function:
        message = f"Expected field `name` in `function` in `tool_choice`! {usage}"
        raise errors.invalid_parameter(message, "tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        message = f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}"
        raise errors.invalid_parameter(message, "tool_choice.function.name")
    tools = data["tools"] if isinstance(data["tools"], list) else []
    names = [
        t["function"].get("name")
        for t in tools
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]
    if name not in names:
        message = "The tool specified in `tool_choice` does not match any of the specified `tools`"
        raise errors.invalid_parameter(message, "tool_choice")


# -- field tables -----------------------------------------------------------------------------------
# (name, kind, default, null accepted), in vLLM's declaration order: pydantic reports errors in this
# order and `param` names the first. A kind is a `_Fields` coercion name or a tuple of literals.
