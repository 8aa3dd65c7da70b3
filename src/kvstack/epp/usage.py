"""Token usage read from the tail of an OpenAI response body (JSON, or the last SSE events of a stream).

Only the last ``TAIL_BYTES`` of a body are kept, so reading usage costs bounded memory per request: vLLM puts
``usage`` at the end of a JSON answer, and in the final ``data:`` event of a stream when the client asked for
it (``stream_options.include_usage``).
"""

from __future__ import annotations

import re

import msgspec

TAIL_BYTES = 8192
_USAGE = re.compile(rb'"usage"\s*:\s*(\{(?:[^{}]|\{[^{}]*\})*\})')


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


_decoder = msgspec.json.Decoder(Usage)


class UsageTail:
    """The last bytes of a response body, and the usage they report."""

    __slots__ = ("tail",)

    def __init__(self) -> None:
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        data = self.tail + chunk
        self.tail = data[-TAIL_BYTES:]

    def usage(self) -> Usage | None:
        """The last usage object in the tail, or None (no usage, cut off, or not valid)."""
        matches = list(_USAGE.finditer(self.tail))
        if not matches:
            return None
        found = matches[-1]
        try:
            return _decoder.decode(found.group(1))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
