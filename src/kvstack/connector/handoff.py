"""Prefill/decode disaggregation through the cache tier: what the prefill engine answers, how long the decode
engine waits for its chunks. No I/O, no vLLM.

The prefill request carries ``kv_transfer_params: {"do_remote_decode": true}``; the prefill engine computes
the prompt and saves its full chunks as for any request. `prefill_answer` is what its ``request_finished``
returns, and vLLM puts in the response: ``{"do_remote_prefill": true, "do_remote_decode": false,
"kvstack_tokens": N, "kvstack_key": "<hex>"}``: the tier holds (or is being sent) the KV of the prompt's first
N tokens, its last chunk under that key (chained keys: it names the whole prefix and the key namespace).

The decode request carries these params. The decode engine finds the chunks by the prompt, as for any
request; the params say what to wait for, since saves are asynchronous and the decode request may arrive
before them. `HandoffWaits`: while the tier holds fewer than N tokens, vLLM is told to ask again later (it
skips the request for a step), looking the chunks up every ``poll_s``, for at most ``wait_s``; then the engine
loads what is there and computes the rest. A decode engine whose own key differs (another ``model_id`` or
KV layout, or the prompt tokenized differently) would never find them: no wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstack.cache.keys import ChunkKey

__all__ = ["Handoff", "HandoffWaits", "handoff_of", "prefill_answer"]


@dataclass(frozen=True, slots=True)
class Handoff:
    """What a prefill engine left in the tier: the KV of the prompt's first ``tokens`` tokens, the last of
    its chunks under ``key``."""

    tokens: int
    key: ChunkKey | None


def prefill_answer(
    requested: Mapping[str, Any] | None, tokens: int, key: ChunkKey | None
) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a finished request that asked for a remote decode (else None)."""
    if not requested or not requested.get("do_remote_decode"):
        return None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvstack_tokens": tokens,
        "kvstack_key": None if key is None else str(key),
    }


def handoff_of(params: Mapping[str, Any] | None) -> Handoff | None:
    """The `Handoff` a decode request's ``kv_transfer_params`` announce, or None (not a remote prefill, or
    not one through kvstack's tier, or malformed)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    tokens, key = params.get("kvstack_tokens"), params.get("kvstack_key")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0 or not isinstance(key, str):
        return None
    try:
        return Handoff(tokens, ChunkKey.from_hex(key))
    except ValueError:
        return None


@dataclass(slots=True)
class _Wait:
    started: float
    next_look: float
    over: bool = False


class HandoffWaits:
    """The decode side's waits for handed-off chunks, per request: `due` says whether to look the chunks up
    this step; `keep_waiting`, after a look-up, whether vLLM should ask again later (once it says no, it
    says no until `end`: a request resumed after a preemption does not wait again)."""

    def __init__(
        self, wait_s: float, poll_s: float = 0.01, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.wait_s = wait_s
        self.poll_s = poll_s
        self._clock = clock
        self._waits: dict[str, _Wait] = {}

    def due(self, req_id: str) -> bool:
        wait = self._waits.get(req_id)
        return wait is None or wait.over or self._clock() >= wait.next_look

    def keep_waiting(self, req_id: str, handoff: Handoff, stored_tokens: int) -> bool:
        """After a look-up found ``stored_tokens`` of the prompt (a local hit included): True while fewer
        than the handoff's are there and the wait has not run out."""
        now = self._clock()
        wait = self._waits.setdefault(req_id, _Wait(now, now))
        if wait.over:
            return False
        if stored_tokens >= handoff.tokens or now - wait.started >= self.wait_s:
            wait.over = True
            return False
        wait.next_look = now + self.poll_s
        return True

    def end(self, req_id: str) -> None:
        """Forget the request (it finished)."""
        self._waits.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._waits)
