"""Parsing and validation of OpenAI request bodies, refusing bad input as vLLM 0.32 does.

vLLM checks a request in stages and the first failing stage answers; kvstack keeps the stages, so a request
with one fault gets vLLM's status, ``type`` and ``param`` (and the gist of its message):

1. content type, and a body that decodes as a JSON object (`validation`);
2. vLLM's pre-validators on the raw body, ``BadRequestError`` (`prevalidators`);
3. field types with pydantic's lax coercions over the endpoint's table (`fields`): ``param`` is the first
   error's location, e.g. ``body.max_tokens`` (``Bad Request``);
4. with `ServingLimits`: the model name (404), server flags, ``max_tokens`` against the context (`limits`);
5. rendering: prompt lists, chat content parts, template flag conflicts (this module);
6. sampling ranges (`check_sampling`);
7. after tokenizing, `check_lengths`: prompt against the context, then output (clamped; refused with no room);
8. `check_engine_input` (logprobs limit, ids against the vocabulary): raised in vLLM's engine, so with
   ``stream`` an SSE error event after a 200 (`kvstack.openai.sse.encode_error_event`), otherwise a 400.

`parse_*` run stages 1-6 (vLLM runs 6 after 7: only a request with several faults can tell). A non-object
``structured_outputs`` gets the 400 its type check implies, where vLLM answers 500. Request Structs are in
`requests`; every public name callers use is importable from here. Design notes: docs/design/simulator.md.
"""

from __future__ import annotations

from typing import Any

from kvstack.openai import errors
from kvstack.sim.openai.fields import (
    CHAT_FIELDS,
    CHAT_TYPED,
    COMPLETION_FIELDS,
    COMPLETION_TYPED,
    DETOKENIZE_FIELDS,
    TOKENIZE_CHAT_FIELDS,
    TOKENIZE_TEXT_FIELDS,
    TOKENIZE_TYPED,
    extra_fields,
    read_fields,
    request_fields,
    sampling_options,
)
from kvstack.sim.openai.limits import (
    DEFAULT_MAX_LOGPROBS,
    MAX_N,
    ServingLimits,
    check_engine_input,
    check_lengths,
    check_mm_kwargs,
    check_output_bound,
    check_sampling,
    check_template_trust,
    check_token_ids,
    check_tool_parser,
    check_truncation_bound,
    resolve_model,
)
from kvstack.sim.openai.prevalidators import (
    MAX_COMPLETION_PROMPTS,
    check_generation_prompt,
    prevalidate_chat,
    prevalidate_completion,
)
from kvstack.sim.openai.requests import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    SamplingOptions,
    StreamOptions,
    TokenizeRequest,
)
from kvstack.sim.openai.validation import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_STRINGS,
    Coerce,
    Loc,
    body_object,
    check_content_type,
    decode_body,
    openai_form,
    summarize,
    validation_error,
)

__all__ = [
    "COMPLETION_DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_LOGPROBS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_COMPLETION_PROMPTS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MEDIA_PART_TYPES",
    "ChatRequest",
    "Coerce",
    "CompletionRequest",
    "DetokenizeRequest",
    "GenerationRequest",
    "Loc",
    "SamplingOptions",
    "ServingLimits",
    "StreamOptions",
    "TokenizeRequest",
    "check_content_type",
    "check_engine_input",
    "check_lengths",
    "check_sampling",
    "check_token_ids",
    "decode_body",
    "parse_chat_request",
    "parse_completion_request",
    "parse_detokenize_request",
    "parse_tokenize_request",
    "resolve_model",
]

# Content parts carrying media: vLLM accepts them only for multimodal models, and a text-only engine
# answers 400 "<model> is not a multimodal model" (see ChatRequest.has_media).
MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "image_pil", "image_embeds", "input_audio", "audio_url", "audio_embeds"}
    | {"video_url", "video_embeds", "prompt_embeds"}
)
_PART_TYPES = MEDIA_PART_TYPES | {
    "text",
    "input_text",
    "output_text",
    "refusal",
    "thinking",
    "tool_reference",
}


def parse_completion_request(
    body: bytes | str | dict[str, Any] | None, limits: ServingLimits | None = None
) -> CompletionRequest:
    """A validated /v1/completions request; raises `OpenAIError` as vLLM would answer."""
    data = dict(body_object(body))
    prevalidate_completion(data)
    f, v = read_fields(data, COMPLETION_FIELDS)
    f.raise_if_invalid()
    if v["stream"] and v["use_beam_search"]:
        raise errors.bad_request("Streaming is not currently supported with beam search")
    if limits is not None:
        v["model"] = resolve_model(v["model"], limits.served_models)
        check_output_bound(v["max_tokens"], limits.max_model_len, "max_tokens")
        check_truncation_bound(v["truncate_prompt_tokens"], limits.max_model_len)
        check_mm_kwargs(data, limits)
    if data.get("prompt_embeds") is not None:
        message = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
        raise errors.invalid_parameter(message, "prompt_embeds")
    if not v["prompt"]:
        raise errors.bad_request("You must pass at least one prompt")
    if v["suffix"] is not None:
        raise errors.bad_request(
            "suffix is only supported for models with FIM completion rendering", "suffix"
        )
    options = sampling_options(v, max_tokens=v["max_tokens"], logprobs=v["logprobs"])
    # vLLM lets echo with max_tokens 0 through: it generates one token and shows only the prompt.
    check_sampling(options, None if options.echo and options.max_tokens == 0 else options.max_tokens)
    return CompletionRequest(
        prompts=v["prompt"],
        options=options,
        suffix=v["suffix"],
        extra=extra_fields(data, COMPLETION_TYPED),
        **request_fields(v),
    )


def parse_chat_request(
    body: bytes | str | dict[str, Any] | None, limits: ServingLimits | None = None
) -> ChatRequest:
    """A validated /v1/chat/completions request; raises `OpenAIError` as vLLM would answer."""
    data = dict(body_object(body))
    if isinstance(data.get("messages"), list):
        # The pre-validators rewrite messages in place; keep the caller's body untouched.
        data["messages"] = [dict(m) if isinstance(m, dict) else m for m in data["messages"]]
    prevalidate_chat(data)
    f, v = read_fields(data, CHAT_FIELDS)
    f.raise_if_invalid()
    if v["max_completion_tokens"] is not None:
        max_tokens, max_tokens_param = v["max_completion_tokens"], "max_completion_tokens"
    else:
        max_tokens, max_tokens_param = v["max_tokens"], "max_tokens"
    if limits is not None:
        v["model"] = resolve_model(v["model"], limits.served_models)
        check_tool_parser(v["tool_choice"], limits)
        check_template_trust(v["chat_template"], v["chat_template_kwargs"], limits)
        check_mm_kwargs(data, limits)
        check_output_bound(max_tokens, limits.max_model_len, max_tokens_param)
        check_truncation_bound(v["truncate_prompt_tokens"], limits.max_model_len)
    conversation = _conversation(v)
    logprobs = v["top_logprobs"] if v["logprobs"] else None
    options = sampling_options(v, max_tokens=max_tokens, logprobs=logprobs)
    check_sampling(options, max_tokens)
    return ChatRequest(
        options=options,
        tool_choice=v["tool_choice"],
        extra=extra_fields(data, CHAT_TYPED),
        max_tokens_param=max_tokens_param,
        **conversation,
        **request_fields(v),
    )


def parse_tokenize_request(
    body: bytes | str | dict[str, Any] | None, limits: ServingLimits | None = None
) -> TokenizeRequest:
    """A validated /tokenize request (vLLM's union of the prompt form and the messages form)."""
    data = dict(body_object(body, members=2))
    if "messages" in data:
        check_generation_prompt(data)
    text, t = read_fields(data, TOKENIZE_TEXT_FIELDS)
    chat, c = read_fields(data, TOKENIZE_CHAT_FIELDS)
    # When both forms fit, vLLM renders the messages.
    use_chat = not chat.issues and ("messages" in data or text.issues)
    if not use_chat and text.issues:
        raise validation_error(text.issues + chat.issues)
    v = c if use_chat else t
    if limits is not None:
        v["model"] = resolve_model(v["model"], limits.served_models)
        if use_chat:
            check_template_trust(v["chat_template"], v["chat_template_kwargs"], limits)
        check_mm_kwargs(data, limits)
    return TokenizeRequest(
        model=v["model"],
        add_special_tokens=v["add_special_tokens"],
        return_token_strs=bool(v["return_token_strs"]),
        extra=extra_fields(data, TOKENIZE_TYPED),
        **(_conversation(v) if use_chat else {"prompt": v["prompt"]}),
    )


def parse_detokenize_request(
    body: bytes | str | dict[str, Any] | None, limits: ServingLimits | None = None
) -> DetokenizeRequest:
    """A validated /detokenize request."""
    data = body_object(body)
    f, v = read_fields(data, DETOKENIZE_FIELDS)
    f.raise_if_invalid()
    if limits is not None:
        v["model"] = resolve_model(v["model"], limits.served_models)
    return DetokenizeRequest(model=v["model"], tokens=v["tokens"], extra=extra_fields(data, frozenset(v)))


# -- stage 5: what vLLM's renderer refuses --------------------------------------------------------


def _conversation(v: dict[str, Any]) -> dict[str, Any]:
    """The rendering attributes chat and /tokenize with messages share, once the renderer's checks pass."""
    has_media = _check_content_parts(v["messages"])
    _check_template_inputs(v["messages"], v["add_generation_prompt"], v["continue_final_message"])
    return {
        "messages": v["messages"],
        "add_generation_prompt": v["add_generation_prompt"],
        "continue_final_message": v["continue_final_message"],
        "chat_template": v["chat_template"],
        "chat_template_kwargs": v["chat_template_kwargs"],
        "tools": v["tools"],
        "has_media": has_media,
    }


def _check_content_parts(messages: list[dict[str, Any]]) -> bool:
    """Refuse content parts vLLM's renderer refuses; report whether any part is image/audio/video."""
    has_media = False
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        lazy = openai_form(message)
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(part, dict) and (
                kind in MEDIA_PART_TYPES or (kind is None and part.keys() & MEDIA_PART_TYPES)
            ):
                has_media = True
            elif lazy and not _openai_part_ok(part, kind):
                # vLLM's text is pydantic's dump of every part type it tried; the gist is kept.
                raise errors.bad_request(
                    f"1 validation error for ValidatorIterator\n{i}\n  Input should be a content part "
                    f"such as {{'type': 'text', 'text': '...'}} [input_value={summarize(part)}]"
                )
            elif not lazy and isinstance(part, dict) and "text" in part and not isinstance(part["text"], str):
                raise errors.bad_request(f"Content part {i} has a non-string 'text': {summarize(part)}")
            elif not lazy and isinstance(part, dict) and kind is None:
                raise errors.invalid_parameter("Missing 'type' field in multimodal part.", "type")
            elif not lazy and kind is not None and kind not in _PART_TYPES:
                supported = ", ".join(sorted(_PART_TYPES))
                message_ = f"Unsupported chat content part type: {kind!r}. Supported types: {supported}."
                raise errors.invalid_parameter(message_, "type", kind)
    return has_media


def _openai_part_ok(part: Any, kind: Any) -> bool:
    if kind == "text":
        return isinstance(part.get("text"), str)
    return kind in ("refusal", "file")


def _check_template_inputs(
    messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final: bool
) -> None:
    # Raised by the HF tokenizer's apply_chat_template, which vLLM's renderer calls.
    if not messages:
        raise errors.bad_request(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    if continue_final and add_generation_prompt:
        raise errors.bad_request(
            "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
            "when you want the model to continue the final message, and add_generation_prompt when you want "
            "to add a header that will prompt it to start a new assistant message instead."
        )
