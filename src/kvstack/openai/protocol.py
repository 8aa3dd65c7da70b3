"""Parsing and validation of OpenAI request bodies, refusing bad input as vLLM 0.32 does.

vLLM checks a request in stages and the first failing stage answers. kvstack keeps the stages, so
a request with one fault gets vLLM's status, ``type`` and ``param`` (and the gist of its message):

1. `check_content_type`; the body must decode as JSON (decoded like Python's json) into an object;
2. vLLM's pre-validators on the raw body: empty prompt, ``stream_options`` without ``stream``,
   logprobs signs, tool choice, cache salt ... (``BadRequestError``);
3. field types with pydantic's lax coercions (``"5"`` is an int, ``"yes"`` a bool, ``2.0`` an int):
   every error is listed and ``param`` is the first one's location, e.g. ``body.max_tokens``
   (``Bad Request``);
4. with `ServingLimits`: the model name (404), server flags (chat template, tool parser, mm kwargs),
   ``max_tokens`` against the context length;
5. rendering: empty prompt list, chat content parts, empty conversation, template flag conflicts;
6. sampling ranges: ``n``, penalties, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``min_tokens``;
7. after tokenizing, `check_lengths`: prompt longer than the context (``input_tokens``), then the
   output limit, which vLLM clamps to the room left and refuses only when no room is left;
8. `check_engine_input`: logprobs limit, ids against the vocabulary, empty prompt. vLLM raises these
   in the engine: with ``stream`` they arrive as an SSE error event after a 200
   (`kvstack.openai.sse.encode_error_event`, then ``[DONE]``), otherwise as a 400.

`parse_*` run stages 1-6. vLLM runs 6 after 7, so only a request with several faults can see another
error first. One deliberate difference: a non-object ``structured_outputs`` makes vLLM answer 500;
kvstack answers the 400 its type check implies.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS
MAX_N = 16384  # VLLM_MAX_N_SEQUENCES
MAX_COMPLETION_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs
COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default vLLM keeps
_SAMPLING_EPS = 1e-5  # below this temperature vLLM samples greedily
_MAX_CACHE_SALT = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
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


# -- parsed requests -------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    """What a streaming response carries besides tokens."""

    include_usage: bool = False
    # Only honoured together with include_usage, as in vLLM.
    continuous_usage_stats: bool = False


class SamplingOptions(msgspec.Struct, kw_only=True):
    """Generation parameters; ``None`` means the engine default (vLLM's defaults noted per field)."""

    # Completions: the request's value, 16 when absent. Chat: max_completion_tokens, else max_tokens,
    # else None = the rest of the context. The engine's limit is `check_lengths`' result.
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None  # 1.0
    top_p: float | None = None  # 1.0
    top_k: int | None = None  # 0 (-1 also disables)
    min_p: float | None = None  # 0.0
    n: int = 1
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    # Top log-probabilities per generated token: completions `logprobs`; chat `top_logprobs` when
    # `logprobs` is true. -1 means the whole vocabulary.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float | None = None  # 0.0
    frequency_penalty: float | None = None  # 0.0
    repetition_penalty: float | None = None  # 1.0
    logit_bias: dict[int, float] | None = None  # clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    echo: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    routed_experts_prompt_start: int = 0


class CompletionRequest(msgspec.Struct, kw_only=True):
    """A /v1/completions request; each prompt is text or token ids, one choice set per prompt."""

    model: str | None
    prompts: list[str | list[int]]
    options: SamplingOptions
    stream: bool = False
    stream_options: StreamOptions = msgspec.field(default_factory=StreamOptions)
    suffix: str | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    user: str | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    # Every body field without an attribute above, as sent (vLLM ignores unknown ones).
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    max_tokens_param: str = "max_tokens"

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: vLLM generates one token and answers with the prompt alone."""
        return self.options.echo and self.options.max_tokens == 0


class ChatRequest(msgspec.Struct, kw_only=True):
    """A /v1/chat/completions request (also the chat form of /tokenize)."""

    model: str | None
    messages: list[dict[str, Any]]
    options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    stream: bool = False
    stream_options: StreamOptions = msgspec.field(default_factory=StreamOptions)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    # Whether some message carries image/audio/video parts, which a text-only engine must refuse.
    has_media: bool = False
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    user: str | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    # Which field set the output limit, for error messages: "max_completion_tokens" or "max_tokens".
    max_tokens_param: str = "max_tokens"

    @classmethod
    def for_tokenize(cls, req: TokenizeRequest) -> ChatRequest:
        """The chat request a /tokenize body with messages stands for (for rendering)."""
        return cls(
            model=req.model,
            messages=req.messages or [],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=req.tools,
            has_media=req.has_media,
        )


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """A /tokenize request: either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    has_media: bool = False
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """A /detokenize request. vLLM does not check ids against the vocabulary here."""

    model: str | None
    tokens: list[int]
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """What the serving engine enforces before rendering; lets `parse_*` check in vLLM's order."""

    served_models: tuple[str, ...]  # the first is the default for requests without `model`
    max_model_len: int
    trust_request_chat_template: bool = False  # vLLM --trust-request-chat-template
    trust_request_mm_kwargs: bool = False  # vLLM --trust-request-mm-kwargs
    enable_auto_tool_choice: bool = False  # vLLM --enable-auto-tool-choice
    tool_call_parser: bool = False  # whether vLLM runs with a --tool-call-parser


# -- body decoding -----------------------------------------------------------------------------------

_decoder = msgspec.json.Decoder()
_INT_DIGITS_LIMIT = 4300  # sys.get_int_max_str_digits() default
_LONG_INT = re.compile(rb"\d{4301}")


def check_content_type(content_type: str | None) -> None:
    """Reject a body that is not declared as JSON (parameters such as charset are ignored)."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise errors.unsupported_media_type()


def decode_body(body: bytes | str | dict[str, Any] | None) -> Any:
    """The JSON value of `body`, decoded as vLLM's Python json module would."""
    if body is None or isinstance(body, dict):
        return body
    if not body:
        return None
    # Python's json refuses integers over 4300 digits where msgspec accepts them; defer to it then.
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    if len(raw) <= _INT_DIGITS_LIMIT or not _LONG_INT.search(raw):
        try:
            return _decoder.decode(body)
        except (msgspec.DecodeError, ValueError, RecursionError):
            pass
    # msgspec is strict where Python's json is lenient (NaN, Infinity, 1e400, a BOM, lone
    # surrogates, UTF-16): decode again the way vLLM does, and take its error position if it fails.
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise errors.invalid_json(exc.pos, exc.msg) from None
    except Exception:  # invalid UTF-8, nesting too deep: FastAPI answers these alike
        raise errors.unparsable_body() from None


# -- pydantic-style lax field validation ----------------------------------------------------------


class _Invalid:
    """Marks a value that failed validation; its issue is already recorded."""


_INVALID: Any = _Invalid()
_MISSING: Any = object()
_INT_TEXT = re.compile(r"[+-]?\d+(?:_\d+)*(?:\.0*)?", re.ASCII)
_BOOL_TEXT = {
    "0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
    "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True,
}  # fmt: skip
_MESSAGES = {
    "missing": "Field required",
    "int_type": "Input should be a valid integer",
    "int_parsing": "Input should be a valid integer, unable to parse string as an integer",
    "int_from_float": "Input should be a valid integer, got a number with a fractional part",
    "int_parsing_size": "Unable to parse input string as an integer, exceeded maximum size",
    "finite_number": "Input should be a finite number",
    "float_type": "Input should be a valid number",
    "float_parsing": "Input should be a valid number, unable to parse string as a number",
    "bool_type": "Input should be a valid boolean",
    "bool_parsing": "Input should be a valid boolean, unable to interpret input",
    "string_type": "Input should be a valid string",
    "list_type": "Input should be a valid list",
    "dict_type": "Input should be a valid dictionary",
    "model_attributes_type": "Input should be a valid dictionary or object to extract fields from",
}
Loc = tuple[str | int, ...]
Coerce = Callable[[Any, Loc], Any]
_Issue = tuple[str, Loc, str, Any, "dict[str, Any] | None"]  # kind, location, message, input, context


def _summarize(value: Any) -> str:
    # As vLLM's error dump: containers by size, scalars as text, long text cut.
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = value if isinstance(value, str) else str(value)
    except ValueError:  # an int too long to print
        return f"<{type(value).__name__}>"
    return text[:200] + "...[truncated]" if len(text) > 200 else text


class _Fields:
    """Reads typed fields from a raw body, recording issues as pydantic would report them.

    Each ``to_<kind>`` coercion takes (value, loc) and returns the value or `_INVALID`.
    """

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.issues: list[_Issue] = []

    def fail(
        self, kind: str, loc: Loc, value: Any, msg: str | None = None, ctx: dict[str, Any] | None = None
    ) -> Any:
        self.issues.append((kind, loc, msg or _MESSAGES[kind], value, ctx))
        return _INVALID

    def get(self, name: str, coerce: Coerce, default: Any = None, *, nullable: bool = True) -> Any:
        """The field's value, `default` when absent; null is a type error unless `nullable`."""
        value = self.data.get(name, _MISSING)
        if value is _MISSING:
            return default
        if value is None and nullable:
            return None
        return coerce(value, ("body", name))

    def required(self, name: str, coerce: Coerce) -> Any:
        if name not in self.data:
            return self.fail("missing", ("body", name), self.data)
        return coerce(self.data[name], ("body", name))

    def raise_if_invalid(self) -> None:
        if self.issues:
            raise _validation_error(self.issues)

    def to_int(self, value: Any, loc: Loc, ge: int | None = None, le: int | None = None) -> Any:
        result: int
        if isinstance(value, bool):
            result = int(value)
        elif isinstance(value, int):
            result = value
        elif isinstance(value, float):
            if not math.isfinite(value):
                return self.fail("finite_number", loc, value)
            if not value.is_integer():
                return self.fail("int_from_float", loc, value)
            if not INT64_MIN <= value < 2**63:
                return self.fail("int_parsing_size", loc, value)
            result = int(value)
        elif isinstance(value, str):
            text = value.strip()
            if not _INT_TEXT.fullmatch(text):
                return self.fail("int_parsing", loc, value)
            result = int(text.split(".", 1)[0])
        else:
            return self.fail("int_type", loc, value)
        if ge is not None and result < ge:
            msg = f"Input should be greater than or equal to {ge}"
            return self.fail("greater_than_equal", loc, value, msg, {"ge": ge})
        if le is not None and result > le:
            msg = f"Input should be less than or equal to {le}"
            return self.fail("less_than_equal", loc, value, msg, {"le": le})
        return result

    def to_int64(self, value: Any, loc: Loc) -> Any:
        return self.to_int(value, loc, INT64_MIN, INT64_MAX)

    def to_token_id(self, value: Any, loc: Loc) -> Any:
        return self.to_int(value, loc, 0)

    def to_positive(self, value: Any, loc: Loc) -> Any:
        return self.to_int(value, loc, 1)

    def to_truncation(self, value: Any, loc: Loc) -> Any:
        return self.to_int(value, loc, -1, INT64_MAX)

    def to_float(self, value: Any, loc: Loc) -> Any:
        if isinstance(value, (bool, int, float)):
            try:
                return float(value)
            except OverflowError:
                return self.fail("float_parsing", loc, value)
        # Python's float() also reads non-ASCII digits, which pydantic refuses.
        if isinstance(value, str) and value.isascii():
            try:
                return float(value)
            except ValueError:
                pass
        return self.fail("float_parsing" if isinstance(value, str) else "float_type", loc, value)

    def to_bool(self, value: Any, loc: Loc) -> Any:
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            return bool(value) if value in (0, 1) else self.fail("bool_parsing", loc, value)
        if isinstance(value, float):
            return bool(value) if value in (0.0, 1.0) else self.fail("bool_type", loc, value)
        if isinstance(value, str):
            parsed = _BOOL_TEXT.get(value.lower())
            return self.fail("bool_parsing", loc, value) if parsed is None else parsed
        return self.fail("bool_type", loc, value)

    def to_str(self, value: Any, loc: Loc) -> Any:
        return value if isinstance(value, str) else self.fail("string_type", loc, value)

    def to_dict(self, value: Any, loc: Loc) -> Any:
        return value if isinstance(value, dict) else self.fail("dict_type", loc, value)

    def to_object(self, value: Any, loc: Loc) -> Any:
        """A nested model, kept as its raw dict."""
        return value if isinstance(value, dict) else self.fail("model_attributes_type", loc, value)

    def list_of(self, item: Coerce) -> Coerce:
        def coerce(value: Any, loc: Loc) -> Any:
            if not isinstance(value, list):
                return self.fail("list_type", loc, value)
            out = [item(v, (*loc, i)) for i, v in enumerate(value)]
            return _INVALID if any(v is _INVALID for v in out) else out

        return coerce

    def to_dict_of_dicts(self, value: Any, loc: Loc) -> Any:
        if not isinstance(value, dict):
            return self.fail("dict_type", loc, value)
        mark = len(self.issues)
        for key, item in value.items():
            self.to_dict(item, (*loc, key))
        return _INVALID if len(self.issues) > mark else value

    def to_embeds(self, value: Any, loc: Loc) -> Any:
        """bytes | list[bytes]; JSON can only carry them as strings."""
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return value
        return self.fail("bytes_type", loc, value, "Input should be a valid bytes")

    def to_response_format(self, value: Any, loc: Loc) -> Any:
        if not isinstance(value, dict):
            return self.fail("model_attributes_type", loc, value)
        kind = value.get("type", _MISSING)
        if kind is _MISSING:
            return self.fail("missing", (*loc, "type"), value)
        if kind not in ("text", "json_object", "json_schema", "structural_tag"):
            return self.literal("text", "json_object", "json_schema")(kind, (*loc, "type"))
        return value

    def to_int_list(self, value: Any, loc: Loc) -> Any:
        return self.list_of(self.to_int)(value, loc)

    def to_token_ids(self, value: Any, loc: Loc) -> Any:
        return self.list_of(lambda v, at: self.to_int(v, at, 0, INT64_MAX))(value, loc)

    def to_str_list(self, value: Any, loc: Loc) -> Any:
        return self.list_of(self.to_str)(value, loc)

    def to_dict_list(self, value: Any, loc: Loc) -> Any:
        return self.list_of(self.to_dict)(value, loc)

    def literal(self, *choices: str) -> Coerce:
        quoted = [f"'{c}'" for c in choices]
        expected = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]

        def coerce(value: Any, loc: Loc) -> Any:
            if isinstance(value, str) and value in choices:
                return value
            msg = f"Input should be {expected}"
            return self.fail("literal_error", loc, value, msg, {"expected": expected})

        return coerce

    def to_float_map(self, value: Any, loc: Loc) -> Any:
        if not isinstance(value, dict):
            return self.fail("dict_type", loc, value)
        out = {k: self.to_float(v, (*loc, k)) for k, v in value.items()}
        return _INVALID if any(v is _INVALID for v in out.values()) else out

    def to_stop(self, value: Any, loc: Loc) -> Any:
        """str | list[str] of at most MAX_STOP_STRINGS; the str member's error is listed first."""
        if isinstance(value, str):
            return [value]
        if (
            isinstance(value, list)
            and len(value) <= MAX_STOP_STRINGS
            and all(isinstance(v, str) for v in value)
        ):
            return list(value)
        self.fail("string_type", loc, value)
        if not isinstance(value, list):
            return self.fail("list_type", loc, value)
        for i, v in enumerate(value):
            if not isinstance(v, str):
                self.fail("string_type", (*loc, i), v)
        if len(value) > MAX_STOP_STRINGS:
            msg = f"List should have at most {MAX_STOP_STRINGS} items after validation, not {len(value)}"
            ctx = {"field_type": "List", "max_length": MAX_STOP_STRINGS, "actual_length": len(value)}
            self.fail("too_long", loc, value, msg, ctx)
        return _INVALID

    def to_stream_options(self, value: Any, loc: Loc) -> Any:
        if not isinstance(value, dict):
            return self.fail("model_attributes_type", loc, value)
        include = value.get("include_usage")
        continuous = value.get("continuous_usage_stats")
        include = False if include is None else self.to_bool(include, (*loc, "include_usage"))
        continuous = (
            False if continuous is None else self.to_bool(continuous, (*loc, "continuous_usage_stats"))
        )
        if include is _INVALID or continuous is _INVALID:
            return _INVALID
        return StreamOptions(include_usage=include, continuous_usage_stats=include and continuous)

    def to_prompt(self, value: Any, loc: Loc) -> Any:
        """list[int] | list[list[int]] | str | list[str]: exact matches first, then lax ones.

        Returns the list of prompts: one for text or a token list, several for a batch.
        """
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list):
            for kind in ("list_type", "list_type", "string_type", "list_type"):
                self.fail(kind, loc, value)
            return _INVALID
        if not value:
            return []  # no prompt at all; refused when rendering
        if all(type(v) is int and v >= 0 for v in value):
            return [list(value)]
        if all(isinstance(v, list) and all(type(t) is int and t >= 0 for t in v) for v in value):
            return [list(v) for v in value]
        if all(isinstance(v, str) for v in value):
            return list(value)
        tokens = self._quiet(self.list_of(self.to_token_id), value, loc)
        if tokens is not _INVALID:
            return [tokens]
        nested = self._quiet(self.list_of(self.list_of(self.to_token_id)), value, loc)
        if nested is not _INVALID:
            return nested
        self.list_of(self.to_token_id)(value, loc)  # the first union member's errors lead, as in pydantic
        return self.fail("string_type", loc, value)

    def _quiet(self, coerce: Coerce, value: Any, loc: Loc) -> Any:
        # Try one union member without keeping its issues.
        mark = len(self.issues)
        result = coerce(value, loc)
        del self.issues[mark:]
        return result

    def to_messages(self, value: Any, loc: Loc) -> Any:
        if not isinstance(value, list):
            return self.fail("list_type", loc, value)
        mark = len(self.issues)
        for i, message in enumerate(value):
            if not (isinstance(message, dict) and _message_matches(message)):
                self._message_issue(message, (*loc, i, "ChatCompletionDeveloperMessageParam"))
        return _INVALID if len(self.issues) > mark else [dict(m) for m in value]

    def _message_issue(self, message: Any, loc: Loc) -> None:
        # pydantic lists every union member's errors; the developer-message member comes first
        # and its fields are checked as content, role, name.
        if not isinstance(message, dict):
            self.fail("dict_type", loc, message)
        elif "content" not in message:
            self.fail("missing", (*loc, "content"), message)
        elif not isinstance(message["content"], (str, list, dict)):
            self.fail("string_type", (*loc, "content"), message["content"])
        elif "role" not in message:
            self.fail("missing", (*loc, "role"), message)
        elif message["role"] != "developer":
            msg, ctx = "Input should be 'developer'", {"expected": "'developer'"}
            self.fail("literal_error", (*loc, "role"), message["role"], msg, ctx)
        else:
            self.fail("string_type", (*loc, "name"), message.get("name"))

    def to_tools(self, value: Any, loc: Loc) -> Any:
        if not isinstance(value, list):
            return self.fail("list_type", loc, value)
        mark = len(self.issues)
        for i, tool in enumerate(value):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict):
                self.fail("model_attributes_type", (*loc, i), tool)
            elif "function" not in tool:
                self.fail("missing", (*loc, i, "function"), tool)
            elif not isinstance(function, dict):
                self.fail("model_attributes_type", (*loc, i, "function"), function)
            elif "name" not in function:
                self.fail("missing", (*loc, i, "function", "name"), function)
            elif not isinstance(function["name"], str):
                self.fail("string_type", (*loc, i, "function", "name"), function["name"])
        return _INVALID if len(self.issues) > mark else [dict(t) for t in value]

    def to_tool_choice(self, value: Any, loc: Loc) -> Any:
        if isinstance(value, dict):
            return value  # a named choice; the pre-validator checked its shape
        return self.literal("none", "auto", "required")(value, loc)


# Keys only vLLM's custom-role message type declares, per OpenAI role: a message carrying one is read
# as the custom type when that type accepts it.
_CUSTOM_KEYS = {
    "developer": frozenset({"tool_call_id", "tool_calls", "reasoning", "tools", "task"}),
    "system": frozenset({"tool_call_id", "tool_calls", "reasoning", "tools", "task"}),
    "user": frozenset({"tool_call_id", "tool_calls", "reasoning", "tools", "task"}),
    "assistant": frozenset({"tool_call_id", "reasoning", "tools", "task"}),
    "tool": frozenset({"name", "tool_calls", "reasoning", "tools", "task"}),
    "function": frozenset({"tool_call_id", "tool_calls", "reasoning", "tools", "task"}),
}


def _openai_valid(m: dict[str, Any]) -> bool:
    """Whether one of OpenAI's message types accepts `m`; their content parts are checked lazily."""
    role, content = m.get("role"), m.get("content", _MISSING)
    if "name" in m and not isinstance(m["name"], str):
        return False
    iterable = isinstance(content, (str, list, dict))
    if role in ("developer", "system", "user"):
        return iterable
    if role == "assistant":
        return content is _MISSING or content is None or iterable
    if role == "tool":
        return iterable and isinstance(m.get("tool_call_id"), str)
    if role == "function":
        return "content" in m and (content is None or isinstance(content, str)) and "name" in m
    return False


def _custom_valid(m: dict[str, Any]) -> bool:
    """Whether vLLM's custom-role message type accepts `m` (it checks content parts up front)."""
    content = m.get("content", _MISSING)
    if not isinstance(m.get("role"), str) or ("name" in m and not isinstance(m["name"], str)):
        return False
    if content is not _MISSING and not isinstance(content, (str, list)):
        return False
    if isinstance(content, list) and not all(isinstance(p, (str, dict)) for p in content):
        return False
    if any(m.get(k) is not None and not isinstance(m[k], str) for k in ("tool_call_id", "reasoning", "task")):
        return False
    for key in ("tool_calls", "tools"):
        value = m.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            return False
    return True


def _openai_form(m: dict[str, Any]) -> bool:
    """Whether `m` is read as an OpenAI message type rather than vLLM's custom-role type."""
    if not _openai_valid(m):
        return False
    return not (m.keys() & _CUSTOM_KEYS.get(m["role"], frozenset()) and _custom_valid(m))


def _message_matches(m: dict[str, Any]) -> bool:
    """Whether some member of vLLM's message union accepts `m` (an approximation of pydantic's)."""
    return _openai_valid(m) or _custom_valid(m)


def _validation_error(issues: list[_Issue]) -> OpenAIError:
    lines = []
    for kind, loc, msg, value, ctx in issues:
        entry: dict[str, Any] = {
            "type": kind,
            "loc": ".".join(map(str, loc)),
            "msg": msg,
            "input": _summarize(value),
        }
        if ctx is not None:
            entry["ctx"] = ctx
        lines.append(str(entry))
    return errors.request_validation(lines, ".".join(map(str, issues[0][1])))


def _body_object(body: bytes | str | dict[str, Any] | None, members: int = 1) -> dict[str, Any]:
    data = decode_body(body)
    if data is None:
        raise _validation_error([("missing", ("body",), "Field required", None, None)])
    if not isinstance(data, dict):
        raise _validation_error(
            [("model_attributes_type", ("body",), _MESSAGES["model_attributes_type"], data, None)] * members
        )
    return data


# -- vLLM's pre-validators (they see the raw body, before field types are checked) ------------------


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


def _check_logprob_numbers(data: dict[str, Any], names: tuple[str, str]) -> None:
    for name in names:
        value = data.get(name)
        if value is not None and not isinstance(value, (int, float)):
            raise errors.invalid_parameter(f"`{name}` must be an integer.", name, value)
    prompt_logprobs = data.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise errors.invalid_parameter(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            message = "`prompt_logprobs` must be a positive value or -1."
            raise errors.invalid_parameter(message, "prompt_logprobs", prompt_logprobs)


def _completion_prevalidate(data: dict[str, Any]) -> None:
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
    if data.get("logprob_token_ids"):
        if data.get("use_beam_search"):
            raise errors.invalid_parameter(
                "`logprob_token_ids` is not supported with beam search.", "logprob_token_ids"
            )
        if data.get("logprobs") is None:
            message = "when using `logprob_token_ids`, `logprobs` must be set."
            raise errors.invalid_parameter(message, "logprob_token_ids")
    _check_logprob_numbers(data, ("prompt_logprobs", "logprobs"))
    logprobs = data.get("logprobs")
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        raise errors.invalid_parameter("`logprobs` must be a positive value or -1.", "logprobs", logprobs)
    _check_structured_outputs(data, "structured_outputs")
    _check_response_format(data)
    if data.get("max_tokens") is None:
        data["max_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS
    _check_cache_salt(data)
    _check_constraint_given(data)


def _chat_prevalidate(data: dict[str, Any]) -> None:
    messages = data.get("messages", [])
    if messages is None or isinstance(messages, (bool, int, float)):
        # vLLM iterates the raw value before checking its type; Python's TypeError becomes the 400.
        raise errors.bad_request(f"'{type(messages).__name__}' object is not iterable")
    _check_generation_prompt(data)
    _check_tool_usage(data)
    if _check_structured_outputs(data, None) and data.get("tool_choice", "none") not in _TOOL_CHOICES:
        raise errors.bad_request(
            "You can only either use constraints for structured outputs or tools, not both."
        )
    if data.get("logprob_token_ids"):
        if data.get("use_beam_search"):
            raise errors.invalid_parameter(
                "`logprob_token_ids` is not supported with beam search.", "logprob_token_ids"
            )
        if not data.get("logprobs"):
            message = "when using `logprob_token_ids`, `logprobs` must be set to true."
            raise errors.invalid_parameter(message, "logprob_token_ids")
    _check_logprob_numbers(data, ("prompt_logprobs", "top_logprobs"))
    top = data.get("top_logprobs")
    if top is not None:
        if top < 0 and top != -1:
            raise errors.invalid_parameter(
                "`top_logprobs` must be a positive value or -1.", "top_logprobs", top
            )
        if (top == -1 or top > 0) and not data.get("logprobs"):
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


_TOOL_CHOICES = ("none", "auto", "required")


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


def _check_mm_kwargs(data: dict[str, Any], limits: ServingLimits) -> None:
    # vLLM reads these from any request, even where they are not declared fields.
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


def _check_generation_prompt(data: dict[str, Any]) -> None:
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise errors.bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )


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

_Spec = tuple[str, str | tuple[str, ...], Any, bool]

_SAMPLING_FIELDS: tuple[_Spec, ...] = (
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
_REQUEST_FIELDS: tuple[_Spec, ...] = (
    ("priority", "int64", 0, False),
    ("request_id", "str", None, False),
    ("session_id", "str", None, True),
    ("return_tokens_as_token_ids", "bool", None, True),
    ("return_token_ids", "bool", False, True),
    ("routed_experts_prompt_start", "token_id", 0, False),
    ("return_token_offsets", "bool", None, True),
)
_TRANSFER_FIELDS: tuple[_Spec, ...] = (
    ("mm_payload", ("tensors", "none"), "tensors", False),
    ("return_mm_kwargs", "bool", None, True),
    ("cache_salt", "str", None, True),
    ("kv_transfer_params", "dict", None, True),
    ("ec_transfer_params", "dict", None, True),
    ("stream_interval", "positive", None, True),
)
_COMPLETION_FIELDS: tuple[_Spec, ...] = (
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
_CHAT_FIELDS: tuple[_Spec, ...] = (
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
    ("chat_template", "str", None, True),
    ("chat_template_kwargs", "dict", None, True),
    ("media_io_kwargs", "dict_of_dicts", None, True),
    ("mm_processor_kwargs", "dict", None, True),
    ("structured_outputs", "object", None, True),
    *_REQUEST_FIELDS,
    ("return_prompt_text", "bool", None, True),
    *_TRANSFER_FIELDS,
)
_TOKENIZE_TEXT_FIELDS: tuple[_Spec, ...] = (
    ("model", "str", None, True),
    ("prompt", "str", None, False),
    ("add_special_tokens", "bool", True, False),
    ("return_token_strs", "bool", False, True),
)
_TOKENIZE_CHAT_FIELDS: tuple[_Spec, ...] = (
    ("model", "str", None, True),
    ("messages", "messages", None, False),
    ("add_generation_prompt", "bool", True, False),
    ("return_token_strs", "bool", False, True),
    ("continue_final_message", "bool", False, False),
    ("add_special_tokens", "bool", False, False),
    ("chat_template", "str", None, True),
    ("chat_template_kwargs", "dict", None, True),
    ("media_io_kwargs", "dict_of_dicts", None, True),
    ("mm_processor_kwargs", "dict", None, True),
    ("tools", "tools", None, True),
)
_DETOKENIZE_FIELDS: tuple[_Spec, ...] = (
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
_COMPLETION_TYPED = _SAMPLING_TYPED | {"prompt", "suffix"}
_CHAT_TYPED = _SAMPLING_TYPED | {"messages", "top_logprobs", "max_completion_tokens", "add_generation_prompt"}
_CHAT_TYPED |= {"continue_final_message", "chat_template", "chat_template_kwargs", "tools", "tool_choice"}
_TOKENIZE_TYPED = frozenset({f[0] for f in _TOKENIZE_TEXT_FIELDS + _TOKENIZE_CHAT_FIELDS})
_TOKENIZE_TYPED -= {"media_io_kwargs", "mm_processor_kwargs"}


def _read(data: dict[str, Any], specs: tuple[_Spec, ...]) -> tuple[_Fields, dict[str, Any]]:
    """Every field of `specs` from `data`, with the issues found on the way."""
    f = _Fields(data)
    values = {}
    for name, kind, default, nullable in specs:
        coerce = f.literal(*kind) if isinstance(kind, tuple) else getattr(f, f"to_{kind}")
        if name in _REQUIRED and not nullable:
            values[name] = f.required(name, coerce)
        else:
            values[name] = f.get(name, coerce, default, nullable=nullable)
    return f, values


def _extra(data: dict[str, Any], typed: frozenset[str]) -> dict[str, Any]:
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


def _sampling_options(v: dict[str, Any], *, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
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


def _request_fields(v: dict[str, Any]) -> dict[str, Any]:
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


# -- /v1/completions --------------------------------------------------------------------------------


def parse_completion_request(
    body: bytes | str | dict[str, Any] | None, limits: ServingLimits | None = None
) -> CompletionRequest:
    """A validated /v1/completions request; raises `OpenAIError` as vLLM would answer."""
    data = dict(_body_object(body))
    _completion_prevalidate(data)
    f, v = _read(data, _COMPLETION_FIELDS)
    f.raise_if_invalid()
    if v["stream"] and v["use_beam_search"]:
        raise errors.bad_request("Streaming is not currently supported with beam search")
    if limits is not None:
        v["model"] = resolve_model(v["model"], limits.served_models)
        _check_output_bound(v["max_tokens"], limits.max_model_len, "max_tokens")
        _check_truncation_bound(v["truncate_prompt_tokens"], limits.max_model_len)
        _check_mm_kwargs(data, limits)
    if data.get("prompt_embeds") is not None:
        message = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
        raise errors.invalid_parameter(message, "prompt_embeds")
    if not v["prompt"]:
        raise errors.bad_request("You must pass at least one prompt")
    if v["suffix"] is not None:
        raise errors.bad_request(
            "suffix is only supported for models with FIM completion rendering", "suffix"
        )
    options = _sampling_options(v, max_tokens=v["max_tokens"], logprobs=v["logprobs"])
    # vLLM lets echo with max_tokens 0 through: it generates one token and shows only the prompt.
    check_sampling(options, None if options.echo and options.max_tokens == 0 else options.max_tokens)
    return CompletionRequest(
        prompts=v["prompt"],
        options=options,
        suffix=v["suffix"],
        extra=_extra(data, _COMPLETION_TYPED),
        **_request_fields(v),
    )


# -- /v1/chat/completions ---------------------------------------------------------------------------


def parse_chat_request(
    body: bytes | str | dict[str, Any] | None, limits: ServingLimits | None = None
) -> ChatRequest:
    """A validated /v1/chat/completions request; raises `OpenAIError` as vLLM would answer."""
    data = dict(_body_object(body))
    if isinstance(data.get("messages"), list):
        # The pre-validators rewrite messages in place; keep the caller's body untouched.
        data["messages"] = [dict(m) if isinstance(m, dict) else m for m in data["messages"]]
    _chat_prevalidate(data)
    f, v = _read(data, _CHAT_FIELDS)
    f.raise_if_invalid()
    if v["max_completion_tokens"] is not None:
        max_tokens, max_tokens_param = v["max_completion_tokens"], "max_completion_tokens"
    else:
        max_tokens, max_tokens_param = v["max_tokens"], "max_tokens"
    if limits is not None:
        v["model"] = resolve_model(v["model"], limits.served_models)
        _check_tool_parser(v["tool_choice"], limits)
        _check_template_trust(v["chat_template"], v["chat_template_kwargs"], limits)
        _check_mm_kwargs(data, limits)
        _check_output_bound(max_tokens, limits.max_model_len, max_tokens_param)
        _check_truncation_bound(v["truncate_prompt_tokens"], limits.max_model_len)
    has_media = _check_content_parts(v["messages"])
    _check_template_inputs(v["messages"], v["add_generation_prompt"], v["continue_final_message"])
    logprobs = v["top_logprobs"] if v["logprobs"] else None
    options = _sampling_options(v, max_tokens=max_tokens, logprobs=logprobs)
    check_sampling(options, max_tokens)
    return ChatRequest(
        messages=v["messages"],
        options=options,
        add_generation_prompt=v["add_generation_prompt"],
        continue_final_message=v["continue_final_message"],
        chat_template=v["chat_template"],
        chat_template_kwargs=v["chat_template_kwargs"],
        tools=v["tools"],
        tool_choice=v["tool_choice"],
        has_media=has_media,
        extra=_extra(data, _CHAT_TYPED),
        max_tokens_param=max_tokens_param,
        **_request_fields(v),
    )


def _check_tool_parser(tool_choice: Any, limits: ServingLimits) -> None:
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


def _check_template_trust(template: str | None, kwargs: dict[str, Any] | None, limits: ServingLimits) -> None:
    if limits.trust_request_chat_template:
        return
    if template is not None or (kwargs and kwargs.get("chat_template") is not None):
        raise errors.bad_request(
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template."
        )


def _check_content_parts(messages: list[dict[str, Any]]) -> bool:
    """Refuse content parts vLLM's renderer refuses; report whether any part is image/audio/video."""
    has_media = False
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        lazy = _openai_form(message)
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
                    f"such as {{'type': 'text', 'text': '...'}} [input_value={_summarize(part)}]"
                )
            elif not lazy and isinstance(part, dict) and "text" in part and not isinstance(part["text"], str):
                raise errors.bad_request(f"Content part {i} has a non-string 'text': {_summarize(part)}")
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


# -- /tokenize and /detokenize -------------------------------------------------------------------------------


def parse_tokenize_request(
    body: bytes | str | dict[str, Any] | None, limits: ServingLimits | None = None
) -> TokenizeRequest:
    """A validated /tokenize request (vLLM's union of the prompt form and the messages form)."""
    data = dict(_body_object(body, members=2))
    if "messages" in data:
        _check_generation_prompt(data)
    text, t = _read(data, _TOKENIZE_TEXT_FIELDS)
    chat, c = _read(data, _TOKENIZE_CHAT_FIELDS)
    # When both forms fit, vLLM renders the messages.
    use_chat = not chat.issues and ("messages" in data or text.issues)
    if not use_chat and text.issues:
        raise _validation_error(text.issues + chat.issues)
    v = c if use_chat else t
    if limits is not None:
        v["model"] = resolve_model(v["model"], limits.served_models)
        if use_chat:
            _check_template_trust(v["chat_template"], v["chat_template_kwargs"], limits)
        _check_mm_kwargs(data, limits)
    if not use_chat:
        return TokenizeRequest(
            model=v["model"],
            prompt=v["prompt"],
            add_special_tokens=v["add_special_tokens"],
            return_token_strs=bool(v["return_token_strs"]),
            extra=_extra(data, _TOKENIZE_TYPED),
        )
    has_media = _check_content_parts(v["messages"])
    _check_template_inputs(v["messages"], v["add_generation_prompt"], v["continue_final_message"])
    return TokenizeRequest(
        model=v["model"],
        messages=v["messages"],
        add_special_tokens=v["add_special_tokens"],
        return_token_strs=bool(v["return_token_strs"]),
        add_generation_prompt=v["add_generation_prompt"],
        continue_final_message=v["continue_final_message"],
        chat_template=v["chat_template"],
        chat_template_kwargs=v["chat_template_kwargs"],
        tools=v["tools"],
        has_media=has_media,
        extra=_extra(data, _TOKENIZE_TYPED),
    )


def parse_detokenize_request(
    body: bytes | str | dict[str, Any] | None, limits: ServingLimits | None = None
) -> DetokenizeRequest:
    """A validated /detokenize request."""
    data = _body_object(body)
    f, v = _read(data, _DETOKENIZE_FIELDS)
    f.raise_if_invalid()
    if limits is not None:
        v["model"] = resolve_model(v["model"], limits.served_models)
    return DetokenizeRequest(model=v["model"], tokens=v["tokens"], extra=_extra(data, frozenset(v)))


# -- checks that need the engine -------------------------------------------------------------------


def resolve_model(name: str | None, served: Sequence[str]) -> str:
    """The served model a request names; no name (or "") means the first served one."""
    if not name:
        return served[0]
    if name not in served:
        raise errors.not_found_model(name, list(served))
    return name


def _check_output_bound(max_tokens: int | None, max_model_len: int, param: str) -> None:
    if max_tokens is not None and max_tokens > max_model_len:
        message = (
            f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens."
        )
        raise errors.invalid_parameter(message, param, max_tokens)


def _check_truncation_bound(truncate: int | None, max_model_len: int) -> None:
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
    _check_output_bound(max_tokens, max_model_len, max_tokens_param)
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
        invalid = [t for t in ids if t < 0 or t >= vocab_size]
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
        invalid = [t for t in allowed if t < 0 or t >= vocab_size]
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
