"""The ZMQ DEALER socket both cache clients speak through: ``ZMQ_IMMEDIATE`` (nothing is queued for a server
that is not connected, so a send fails within the caller's timeout instead of waiting for one), no linger,
and reconnects every 50 ms, backing off to 1 s.
"""

from __future__ import annotations

from typing import Any, TypeVar

import zmq

__all__ = ["dealer"]

_S = TypeVar("_S", bound=zmq.Socket[Any])


def dealer(ctx: zmq.Context[_S], endpoint: str) -> _S:
    """A DEALER socket of ``ctx`` connecting to ``endpoint``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(endpoint)
    return sock
