"""Per-endpoint field tables in vLLM's declaration order, and reading a body through them.

A table row is (name, kind, default, null accepted). pydantic reports errors in declaration order and
vLLM's ``param`` names the first, so a table lists its endpoint's fields exactly as vLLM declares them.
A kind is a `FieldReader` coercion name (``"int"`` reads with ``to_int``) or a tuple of literals.
`sampling_options` and `request_fields` turn the values read into request attributes; every body
field without an attribute is kept as sent in ``extra``.
"""

from __future__ import annotations

from typing import Any

from kvstack.openai import errors
from kvstack.sim.openai.requests import SamplingOptions, StreamOptions
from kvstack.sim.openai.validation import FieldReader

Spec = tuple[str, str | tuple[str, ...], Any, bool]

_SAMPLING_FIELDS: tuple[Spec, ...] = (
    ("use_beam_search", "bool", False, False),
    ("top_k", "int", None, True),
    ("min_p", "float", None, True),
    ("repetition_penalty", "float", None, True),
    ("watermarking", "bool", None, True),
    ("length_penalty", "float", 1.0, False),
    ("stop_token_ids", "int_list", None, True),
    ("include_stop_str_in_output", "bool", False, False),
    ("ignore_eos", "bool", False, False),
    ("min_tokens", "int", 0, False),
    ("skip_special_tokens", "bool", True, False),
    ("spaces_between_special_tokens", "bool", True, False),
    ("truncate_prompt_tokens", "truncation", None, True),
    ("truncation_side", ("left", "right"), None, True),
)
_REQUEST_FIELDS: tuple[Spec, ...] = (
    ("priority", "int64", 0, False),
    ("request_id", "str", None, False),
    ("session_id", "str", None, True),
    ("return_tokens_as_token_ids", "bool", None, True),
    ("return_token_ids", "bool", False, True),
    ("routed_experts_prompt_start", "token_id", 0, False),
    ("return_token_offsets", "bool", None, True),
)
_TRANSFER_FIELDS: tuple[Spec, ...] = (
    ("mm_payload", ("tensors", "none"), "tensors", False),
    ("return_mm_kwargs", "bool", None, True),
    ("cache_salt", "str", None, True),
    ("kv_transfer_params", "dict", None, True),
    ("ec_transfer_params", "dict", None, True),
    ("stream_interval", "positive", None, True),
)
# How chat messages are rendered: the template and the multimodal kwargs (chat and /tokenize).
_RENDER_FIELDS: tuple[Spec, ...] = (
    ("chat_template", "str", None, True),
    ("chat_template_kwargs", "dict", None, True),
    ("media_io_kwargs", "dict_of_dicts", None, True),
    ("mm_processor_kwargs", "dict", None, True),
)
COMPLETION_FIELDS: tuple[Spec, ...] = (
    ("model", "str", None, True),
    ("prompt", "prompt", None, True),
    ("echo", "bool", False, True),
    ("frequency_penalty", "float", None, True),
    ("logit_bias", "float_map", None, True),
    ("logprobs", "int", None, True),
    ("max_tokens", "int", None, True),
    ("n", "int", 1, False),
    ("presence_penalty", "float", None, True),
    ("seed", "int64", None, True),
    ("stop", "stop", None, True),
    ("stream", "bool", False, True),
    ("stream_options", "stream_options", None, True),
    ("suffix", "str", None, True),
    ("temperature", "float", None, True),
    ("top_p", "float", None, True),
    ("user", "str", None, True),
    *_SAMPLING_FIELDS,
    ("allowed_token_ids", "int_list", None, True),
    ("prompt_logprobs", "int", None, True),
    ("logprob_token_ids", "int_list", None, True),
    ("bad_words", "str_list", [], False),
    ("prompt_embeds", "embeds", None, True),
    ("add_special_tokens", "bool", True, False),
    ("response_format", "response_format", None, True),
    ("structured_outputs", "object", None, True),
    *_REQUEST_FIELDS,
    *_TRANSFER_FIELDS,
)
CHAT_FIELDS: tuple[Spec, ...] = (
    ("messages", "messages", None, False),
    ("model", "str", None, True),
    ("frequency_penalty", "float", None, True),
    ("logit_bias", "float_map", None, True),
    ("logprobs", "bool", False, True),
    ("top_logprobs", "int", 0, True),
    ("max_tokens", "int", None, True),
    ("max_completion_tokens", "int", None, True),
    ("n", "int", 1, True),
    ("presence_penalty", "float", None, True),
    ("response_format", "response_format", None, True),
    ("seed", "int64", None, True),
    ("stop", "stop", None, True),
    ("stream", "bool", False, True),
    ("stream_options", "stream_options", None, True),
    ("temperature", "float", None, True),
    ("top_p", "float", None, True),
    ("tools", "tools", None, True),
    ("tool_choice", "tool_choice", "none", True),
    ("reasoning_effort", ("none", "minimal", "low", "medium", "high", "xhigh", "max"), None, True),
    ("include_reasoning", "bool", True, False),
    ("parallel_tool_calls", "bool", True, True),
    ("user", "str", None, True),
    *_SAMPLING_FIELDS,
    ("prompt_logprobs", "int", None, True),
    ("logprob_token_ids", "int_list", None, True),
    ("allowed_token_ids", "int_list", None, True),
    ("bad_words", "str_list", [], False),
    ("echo", "bool", False, False),
    ("add_generation_prompt", "bool", True, False),
    ("continue_final_message", "bool", False, False),
    ("add_special_tokens", "bool", False, False),
    ("documents", "dict_list", None, True),
    *_RENDER_FIELDS,
    ("structured_outputs", "object", None, True),
    *_REQUEST_FIELDS,
    ("return_prompt_text", "bool", None, True),
    *_TRANSFER_FIELDS,
)
TOKENIZE_TEXT_FIELDS: tuple[Spec, ...] = (
    ("model", "str", None, True),
    ("prompt", "str", None, False),
    ("add_special_tokens", "bool", True, False),
    ("return_token_strs", "bool", False, True),
)
TOKENIZE_CHAT_FIELDS: tuple[Spec, ...] = (
    ("model", "str", None, True),
    ("messages", "messages", None, False),
    ("add_generation_prompt", "bool", True, False),
    ("return_token_strs", "bool", False, True),
    ("continue_final_message", "bool", False, False),
    ("add_special_tokens", "bool", False, False),
    *_RENDER_FIELDS,
    ("tools", "tools", None, True),
)
DETOKENIZE_FIELDS: tuple[Spec, ...] = (
    ("model", "str", None, True),
    ("tokens", "token_ids", None, False),
)
_REQUIRED = frozenset({"messages", "prompt", "tokens"})  # required wherever their table lists them

# Body fields with a typed attribute; every other field is kept as sent in `extra`.
_SAMPLING_TYPED = frozenset(
    {
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "seed",
        "stop",
        "stop_token_ids",
    }
    | {"ignore_eos", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty"}
    | {"repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "echo", "skip_special_tokens"}
    | {"spaces_between_special_tokens", "include_stop_str_in_output", "use_beam_search", "model", "stream"}
    | {"stream_options", "add_special_tokens", "truncate_prompt_tokens", "truncation_side"}
    | {"return_token_ids", "kv_transfer_params", "user", "priority", "request_id", "cache_salt"}
)
COMPLETION_TYPED = _SAMPLING_TYPED | {"prompt", "suffix"}
CHAT_TYPED = _SAMPLING_TYPED | {"messages", "top_logprobs", "max_completion_tokens", "add_generation_prompt"}
CHAT_TYPED |= {"continue_final_message", "chat_template", "chat_template_kwargs", "tools", "tool_choice"}
TOKENIZE_TYPED = frozenset({f[0] for f in TOKENIZE_TEXT_FIELDS + TOKENIZE_CHAT_FIELDS})
TOKENIZE_TYPED -= {"media_io_kwargs", "mm_processor_kwargs"}


def read_fields(data: dict[str, Any], specs: tuple[Spec, ...]) -> tuple[FieldReader, dict[str, Any]]:
    """Every field of `specs` from `data`, with the issues found on the way."""
    f = FieldReader(data)
    values = {}
    for name, kind, default, nullable in specs:
        coerce = f.literal(*kind) if isinstance(kind, tuple) else getattr(f, f"to_{kind}")
        if name in _REQUIRED and not nullable:
            values[name] = f.required(name, coerce)
        else:
            values[name] = f.get(name, coerce, default, nullable=nullable)
    return f, values


def extra_fields(data: dict[str, Any], typed: frozenset[str]) -> dict[str, Any]:
    """The body fields not in `typed`, as sent."""
    return {k: v for k, v in data.items() if k not in typed}


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    out: dict[int, float] = {}
    invalid = []
    for key, bias in raw.items():
        try:
            out[int(key)] = min(100.0, max(-100.0, bias))
        except ValueError:
            invalid.append(key)
    if invalid:
        message = f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}"
        raise errors.invalid_parameter(message, "logit_bias", invalid)
    return out


def sampling_options(v: dict[str, Any], *, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
    """The options from read field values; logit_bias keys are converted here, as SamplingParams does."""
    prompt_logprobs = v["prompt_logprobs"]
    return SamplingOptions(
        max_tokens=max_tokens,
        min_tokens=v["min_tokens"],
        temperature=v["temperature"],
        top_p=v["top_p"],
        top_k=v["top_k"],
        min_p=v["min_p"],
        n=1 if v["n"] is None else v["n"],
        seed=None if v["seed"] == -1 else v["seed"],
        stop=list(v["stop"] or ()),
        stop_token_ids=list(dict.fromkeys(v["stop_token_ids"] or ())),
        ignore_eos=v["ignore_eos"],
        logprobs=logprobs,
        # echo returns the prompt's logprobs too, as many per token as asked for the output.
        prompt_logprobs=logprobs if prompt_logprobs is None and v["echo"] else prompt_logprobs,
        presence_penalty=v["presence_penalty"],
        frequency_penalty=v["frequency_penalty"],
        repetition_penalty=v["repetition_penalty"],
        logit_bias=_logit_bias(v["logit_bias"]),
        allowed_token_ids=v["allowed_token_ids"],
        bad_words=list(v["bad_words"]),
        echo=bool(v["echo"]),
        skip_special_tokens=v["skip_special_tokens"],
        spaces_between_special_tokens=v["spaces_between_special_tokens"],
        include_stop_str_in_output=v["include_stop_str_in_output"],
        use_beam_search=v["use_beam_search"],
        routed_experts_prompt_start=v["routed_experts_prompt_start"],
    )


def request_fields(v: dict[str, Any]) -> dict[str, Any]:
    """The attributes completion and chat requests share, from read field values."""
    return {
        "model": v["model"],
        "stream": bool(v["stream"]),
        "stream_options": v["stream_options"] or StreamOptions(),
        "truncate_prompt_tokens": v["truncate_prompt_tokens"],
        "truncation_side": v["truncation_side"],
        "return_token_ids": bool(v["return_token_ids"]),
        "kv_transfer_params": v["kv_transfer_params"],
        "user": v["user"],
        "priority": v["priority"],
        "request_id": v["request_id"],
        "cache_salt": v["cache_salt"],
        "add_special_tokens": v["add_special_tokens"],
    }
