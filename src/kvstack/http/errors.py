"""Why a call to an engine failed: ``UpstreamError`` and its kinds, each with ``reason`` (a metric label).

- ``ConnectFailed``: nothing was sent (``ConnectTimedOut``; ``CannotSend`` for an unusable engine URL).
- ``UpstreamBroken``: the connection broke or the answer was malformed after the request was sent.
- ``UpstreamTimeout``: headers or body did not come in time (``reason`` says which).
- ``BodyTooLarge``: a side call's answer exceeded its ``max_bytes``.
"""

from __future__ import annotations

__all__ = [
    "BodyTooLarge",
    "CannotSend",
    "ConnectFailed",
    "ConnectTimedOut",
    "UpstreamBroken",
    "UpstreamError",
    "UpstreamTimeout",
]


class UpstreamError(Exception):
    """A forwarded request failed at the transport or HTTP level; ``reason`` is a short metric label."""

    reason = "upstream_error"


class ConnectFailed(UpstreamError):
    reason = "connect_error"


class ConnectTimedOut(ConnectFailed):
    """Connecting (or waiting for a free connection slot) took ``connect_timeout``."""


class CannotSend(ConnectFailed):
    """The request could not be built for this engine (an unusable base URL); nothing was sent."""

    reason = "cannot_send"


class UpstreamBroken(UpstreamError):
    reason = "upstream_broke"


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The answer's headers (``first_byte_timeout``) or its body (``body_timeout``) did not come in time."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class BodyTooLarge(UpstreamError):
    """A side call's answer (of ``status``) announced or sent more than its ``max_bytes``."""

    reason = "too_large"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
