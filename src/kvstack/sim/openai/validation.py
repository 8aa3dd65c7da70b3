"""Stage 1 and 3 of request parsing: body decoding, and pydantic-style lax field validation.

`decode_body` decodes JSON as vLLM's Python json module would. `FieldReader` reads one field at a time
with pydantic's lax coercions (``"5"`` is an int, ``"yes"`` a bool, ``2.0`` an int), records every
issue in pydantic's order, and `validation_error` turns them into vLLM's 400 ``Bad Request`` whose
``param`` is the first issue's location. Which fields an endpoint reads is `kvstack.sim.openai.fields`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import msgspec

from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError
from kvstack.sim.openai.requests import StreamOptions

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS

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
Issue = tuple[str, Loc, str, Any, "dict[str, Any] | None"]  # kind, location, message, input, context


def summarize(value: Any) -> str:
    """`value` as vLLM's error dump shows it: containers by size, scalars as text, long text cut."""
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = value if isinstance(value, str) else str(value)
    except ValueError:  # an int too long to print
        return f"<{type(value).__name__}>"
    return text[:200] + "...[truncated]" if len(text) > 200 else text


class FieldReader:
    """Reads typed fields from a raw body, recording issues as pydantic would report them.

    Each ``to_<kind>`` coercion takes (value, loc) and returns the value or `_INVALID`.
    """

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.issues: list[Issue] = []

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
            raise validation_error(self.issues)

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


# -- vLLM's chat message union ---------------------------------------------------------------------

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


def openai_form(m: dict[str, Any]) -> bool:
    """Whether `m` is read as an OpenAI message type rather than vLLM's custom-role type."""
    if not _openai_valid(m):
        return False
    return not (m.keys() & _CUSTOM_KEYS.get(m["role"], frozenset()) and _custom_valid(m))


def _message_matches(m: dict[str, Any]) -> bool:
    """Whether some member of vLLM's message union accepts `m` (an approximation of pydantic's)."""
    return _openai_valid(m) or _custom_valid(m)


# -- issues to errors ------------------------------------------------------------------------------


def validation_error(issues: list[Issue]) -> OpenAIError:
    """vLLM's 400 for failed field validation: every issue listed, ``param`` the first one's location."""
    lines = []
    for kind, loc, msg, value, ctx in issues:
        entry: dict[str, Any] = {
            "type": kind,
            "loc": ".".join(map(str, loc)),
            "msg": msg,
            "input": summarize(value),
        }
        if ctx is not None:
            entry["ctx"] = ctx
        lines.append(str(entry))
    return errors.request_validation(lines, ".".join(map(str, issues[0][1])))


def body_object(body: bytes | str | dict[str, Any] | None, members: int = 1) -> dict[str, Any]:
    """The decoded body, which must be an object; `members`: how many union members report a non-object."""
    data = decode_body(body)
    if data is None:
        raise validation_error([("missing", ("body",), "Field required", None, None)])
    if not isinstance(data, dict):
        raise validation_error(
            [("model_attributes_type", ("body",), _MESSAGES["model_attributes_type"], data, None)] * members
        )
    return data
