"""Stages 4 and 6-8 of request parsing: what the serving engine allows.

`ServingLimits` holds what the server was started with: served models, context length and the flags
that gate chat templates, multimodal kwargs and tool choice. The checks here compare a request
against them (``max_tokens`` and ``truncate_prompt_tokens`` against the context), against vLLM's
sampling ranges (`check_sampling`), against the tokenized prompt (`check_lengths`) and against the
engine's vocabulary and logprobs limit (`check_engine_input`), each with vLLM's status and message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstack.openai import errors
from kvstack.sim.openai.requests import COMPLETION_DEFAULT_MAX_TOKENS, SamplingOptions

MAX_N = 16384  # VLLM_MAX_N_SEQUENCES
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs
_SAMPLING_EPS = 1e-5  # below this temperature vLLM samples greedily


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """What the serving engine enforces before rendering; lets `parse_*` check in vLLM's order."""

    served_models: tuple[str, ...]  # the first is the default for requests without `model`
    max_model_len: int
    trust_request_chat_template: bool = False  # vLLM --trust-request-chat-template
    trust_request_mm_kwargs: bool = False  # vLLM --trust-request-mm-kwargs
    enable_auto_tool_choice: bool = False  # vLLM --enable-auto-tool-choice
    tool_call_parser: bool = False  # whether vLLM runs with a --tool-call-parser


def resolve_model(name: str | None, served: Sequence[str]) -> str:
    """The served model a request names; no name (or "") means the first served one."""
    if not name:
        return served[0]
    if name not in served:
        raise errors.not_found_model(name, list(served))
    return name


def check_mm_kwargs(data: dict[str, Any], limits: ServingLimits) -> None:
    """Refuse per-request multimodal kwargs unless the server trusts them.

    vLLM reads these from any request, even where they are not declared fields.
    """
    if limits.trust_request_mm_kwargs:
        return
    for name, effect in (("mm_processor_kwargs", "preprocessing"), ("media_io_kwargs", "media loading")):
        if data.get(name):
            message = (
                f"Per-request {name} are disabled by default because they can change multimodal "
                f"{effect} resource usage. Start the server with --trust-request-mm-kwargs only when "
                "clients are trusted."
            )
            raise errors.invalid_parameter(message, name)


def check_tool_parser(tool_choice: Any, limits: ServingLimits) -> None:
    """Refuse a tool choice the server has no tool-call parser (or auto tool choice) for."""
    if limits.tool_call_parser or tool_choice in (None, "none"):
        return
    if tool_choice == "auto":
        if not limits.enable_auto_tool_choice:
            raise errors.bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        return
    if isinstance(tool_choice, dict):
        described = f'function "{tool_choice["function"]["name"]}"'
    else:
        described = f'"{tool_choice}"'
    raise errors.bad_request(f"tool_choice={described} requires --tool-call-parser to be set")


def check_template_trust(template: str | None, kwargs: dict[str, Any] | None, limits: ServingLimits) -> None:
    """Refuse a request's own chat template unless the server trusts it."""
    if limits.trust_request_chat_template:
        return
    if template is not None or (kwargs and kwargs.get("chat_template") is not None):
        raise errors.bad_request(
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template."
        )


def check_output_bound(max_tokens: int | None, max_model_len: int, param: str) -> None:
    """Refuse an output limit above the context length, naming the field that set it."""
    if max_tokens is not None and max_tokens > max_model_len:
        message = (
            f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens."
        )
        raise errors.invalid_parameter(message, param, max_tokens)


def check_truncation_bound(truncate: int | None, max_model_len: int) -> None:
    """Refuse a ``truncate_prompt_tokens`` above the context length."""
    if truncate is not None and truncate > max_model_len:
        message = (
            f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = {max_model_len}. "
            "Please request a smaller truncation size."
        )
        raise errors.invalid_parameter(message, "truncate_prompt_tokens", truncate)


def check_sampling(o: SamplingOptions, max_tokens: int | None) -> None:
    """vLLM's SamplingParams checks, in its order; `max_tokens` None skips the checks that need it."""
    n = o.n
    if n < 1:
        raise errors.bad_request(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise errors.bad_request(
            f"n must be at most {MAX_N}, got {n}. "
            "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."
        )
    presence = 0.0 if o.presence_penalty is None else o.presence_penalty
    if not -2.0 <= presence <= 2.0:
        raise errors.bad_request(f"presence_penalty must be in [-2, 2], got {presence}.")
    frequency = 0.0 if o.frequency_penalty is None else o.frequency_penalty
    if not -2.0 <= frequency <= 2.0:
        raise errors.bad_request(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    repetition = 1.0 if o.repetition_penalty is None else o.repetition_penalty
    if not math.isfinite(repetition):
        raise errors.bad_request(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise errors.bad_request(f"repetition_penalty must be greater than zero, got {repetition}.")
    t = 1.0 if o.temperature is None else o.temperature
    if not math.isfinite(t):
        raise errors.invalid_parameter(f"temperature must be a finite number, got {t}.", "temperature", t)
    if t < 0.0:
        raise errors.invalid_parameter(f"temperature must be non-negative, got {t}.", "temperature", t)
    if t > 2.0:
        raise errors.invalid_parameter(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    top_p = 1.0 if o.top_p is None else o.top_p
    if not 0.0 < top_p <= 1.0:
        raise errors.invalid_parameter(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = 0 if o.top_k is None else o.top_k
    if top_k < -1:
        raise errors.bad_request(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = 0.0 if o.min_p is None else o.min_p
    if not 0.0 <= min_p <= 1.0:
        raise errors.bad_request(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens is not None and max_tokens < 1:
        raise errors.invalid_parameter(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
        )
    if o.min_tokens < 0:
        raise errors.bad_request(f"min_tokens must be greater than or equal to 0, got {o.min_tokens}.")
    if max_tokens is not None and o.min_tokens > max_tokens:
        raise errors.bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {o.min_tokens}."
        )
    if any(not s for s in o.stop):
        raise errors.bad_request("stop cannot contain an empty string.")
    if any(not w for w in o.bad_words):
        words = list(dict.fromkeys(o.bad_words))
        raise errors.bad_request(f"bad_words cannot contain an empty string. Got bad_words={words!r}")
    if t < _SAMPLING_EPS and n > 1:
        raise errors.bad_request(f"n must be 1 when using greedy sampling, got {n}.")


def check_lengths(
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    *,
    chat: bool = False,
    min_tokens: int = 0,
    max_tokens_param: str = "max_tokens",
    from_text: bool = False,
    echo_only: bool = False,
) -> int:
    """The number of tokens the engine may generate for a prompt of `prompt_len` tokens.

    Applies vLLM's rules in its order: `max_tokens` above the context (400, param `max_tokens_param`),
    a prompt longer than the context (400, param ``input_tokens``), then clamps `max_tokens` to the room
    left, 400 if none is left. `max_tokens` None means 16 for completions and the whole room for chat.
    `from_text`: vLLM tokenizes text only up to max_model_len + 1 tokens, so the count is capped there
    and worded "at least". `echo_only`: completions echo with max_tokens 0, which generates one token.
    """
    check_output_bound(max_tokens, max_model_len, max_tokens_param)
    count = min(prompt_len, max_model_len + 1) if from_text else prompt_len
    if count > max_model_len:
        raise errors.too_long_prompt(count, max_model_len, at_least=count == max_model_len + 1)
    if echo_only:
        return 1
    room = max_model_len - prompt_len
    requested = max_tokens if max_tokens is not None else (None if chat else COMPLETION_DEFAULT_MAX_TOKENS)
    effective = room if requested is None else min(room, requested)
    if effective < 1:
        raise errors.invalid_parameter(
            f"max_tokens must be at least 1, got {effective}.", "max_tokens", effective
        )
    if min_tokens > effective:
        raise errors.bad_request(
            f"min_tokens must be less than or equal to max_tokens={effective}, got {min_tokens}."
        )
    return effective


def check_token_ids(ids: Sequence[int], vocab_size: int, *, param: str | None = None) -> None:
    """Refuse token ids outside [0, vocab_size), naming the smallest negative or the largest id."""
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0:
        raise errors.invalid_parameter(f"Token id {low} is out of vocabulary", param)
    if high >= vocab_size:
        raise errors.invalid_parameter(f"Token id {high} is out of vocabulary", param)


def check_engine_input(
    options: SamplingOptions,
    prompt_ids: Sequence[int],
    vocab_size: int,
    *,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> None:
    """The checks vLLM's engine makes when a request arrives, in its order.

    With ``stream`` these errors reach the client as an SSE error event after a 200, not as a 400.
    `max_logprobs` -1 means the whole vocabulary, as vLLM's --max-logprobs.
    """
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name, label, value in (
        ("logprobs", "sample", options.logprobs),
        ("prompt_logprobs", "prompt", options.prompt_logprobs),
    ):
        if value:
            count = vocab_size if value == -1 else value
            if count > limit:
                message = f"Requested {label} logprobs of {count}, which is greater than max allowed: {limit}"
                raise errors.invalid_parameter(message, name, count)
    for name, ids in (
        ("logit_bias", list(options.logit_bias or ())),
        ("stop_token_ids", options.stop_token_ids),
    ):
        invalid = _out_of_vocab(ids, vocab_size)
        if invalid:
            message = (
                f"token_id(s) {invalid} in {name} contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab_size}"
            )
            raise errors.invalid_parameter(message, name, invalid)
    allowed = options.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise errors.invalid_parameter(
                "allowed_token_ids is not None and empty!", "allowed_token_ids", []
            )
        invalid = _out_of_vocab(allowed, vocab_size)
        if invalid:
            raise errors.invalid_parameter(
                "allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids", invalid
            )
    if not prompt_ids:
        raise errors.bad_request("The decoder prompt cannot be empty")
    check_token_ids(prompt_ids, vocab_size)
    start = options.routed_experts_prompt_start
    if not 0 <= start <= len(prompt_ids):
        message = (
            "routed_experts_prompt_start must be between 0 and the prompt length "
            f"({len(prompt_ids)}), inclusive."
        )
        raise errors.invalid_parameter(message, "routed_experts_prompt_start", start)


def _out_of_vocab(ids: Sequence[int], vocab_size: int) -> list[int]:
    return [t for t in ids if t < 0 or t >= vocab_size]
