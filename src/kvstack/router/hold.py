"""Holding a stream's start back until its first content, so that an engine failing before then is retried.

An engine's SSE stream begins with events that carry no answer yet (vLLM's 200 and headers while it
prefills, then the role chunk ``delta: {"role": "assistant", "content": ""}``). The proxy holds those, and
the status and headers, until `scan` finds content; an engine that breaks, resets, times out or sends a
server error event before then is retried elsewhere and the client never sees it.

Content: a chunk with a non-empty ``text`` (completions), delta ``content``, ``reasoning_content``,
``reasoning`` or ``tool_calls``, or a ``finish_reason``; a usage-only chunk (no choices); ``[DONE]``; and
anything that is not a chat/completions chunk (Responses API events, non-JSON, events over
``SCAN_MAX`` bytes): when in doubt, release. Held: role chunks, empty deltas, comments and keepalives.

`HoldPolicy`: ``enabled`` (True), ``max_bytes`` (64 KiB read before the hold gives up and releases) and
``seconds`` (None: the request's first-byte timeout; counted from sending the request). A hold that
reaches either bound releases what it holds and the stream goes on as it would have, without retries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

# Events longer than this are not parsed: they are released as content.
SCAN_MAX = 16 * 1024

Verdict = Literal["hold", "content", "error"]


@dataclass(frozen=True, slots=True)
class HoldPolicy:
    enabled: bool = True
    max_bytes: int = 64 * 1024
    seconds: float | None = None  # None: the request's first-byte timeout


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[Any] | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: Any = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def scan(data: bytes) -> Verdict:
    """The verdict on ``data``, complete SSE events: "content" as soon as one event is content (see the
    module docstring), "error" for an error event with a server error code (5xx or none), else "hold"."""
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    for event in data.split(b"\n\n"):
        verdict = _event_verdict(event) if event else "hold"
        if verdict != "hold":
            return verdict
    return "hold"


# A key of compact JSON followed by the opening quote of its string value: outside strings only (a quote
# inside one is escaped), so a byte after it other than a quote means a non-empty value.
_CONTENT_KEYS = (b'"content":"', b'"text":"', b'"finish_reason":"', b'"reasoning_content":"')


def _event_verdict(event: bytes) -> Verdict:
    if event.startswith(b"data: ") and b"\n" not in event:  # the usual: one data line
        payload = event[6:]
    else:
        lines = event.split(b"\n")
        payload = b"\n".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
    if not payload:
        return "hold"  # a comment, a keepalive, or no event at all
    if len(payload) > SCAN_MAX:
        return "content"
    for key in _CONTENT_KEYS:  # the cheap way to the usual verdict on a content chunk
        at = payload.find(key)
        if at >= 0 and payload[at + len(key) : at + len(key) + 1] != b'"':
            return "content"
    try:
        chunk = _decode_chunk(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "content"  # [DONE], or not a chunk this module knows
    if chunk.error is not None:
        return "error" if _server_error(chunk.error) else "content"
    if chunk.choices is None:
        return "content"
    if not chunk.choices:
        return "hold" if chunk.usage is None else "content"
    for choice in chunk.choices:
        delta = choice.delta
        if choice.finish_reason is not None or choice.text:
            return "content"
        if delta is not None and (
            delta.content or delta.reasoning_content or delta.reasoning or delta.tool_calls
        ):
            return "content"
    return "hold"


def _server_error(error: Any) -> bool:
    """An error event worth a retry elsewhere: a server error (5xx or no code), not the client's (4xx)."""
    code = error.get("code") if isinstance(error, dict) else None
    return not (isinstance(code, int) and 400 <= code < 500)
