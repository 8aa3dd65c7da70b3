"""The client of vLLM's KV-event replay service: a DEALER asking a publisher's ROUTER for what it buffers.

`replay` collects the batches buffered from a seq on, within one timeout and a size bound (each vLLM
version's reply shape: its docstring); `contiguous_run` and `last_run_start` pick the run of consecutive seqs
a caller can apply out of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvstack.kvevents.codec import (
    REPLAY_END_SEQ,
    EventBatch,
    KVEventDecodeError,
    decode_batch,
    decode_seq,
    encode_seq,
)

__all__ = ["ReplayResult", "contiguous_run", "last_run_start", "replay"]


@dataclass(slots=True)
class ReplayResult:
    batches: list[tuple[int, EventBatch]]  # (seq, batch) in order
    decode_errors: int = 0


async def replay(
    context: zmq.asyncio.Context,
    replay_endpoint: str,
    start_seq: int,
    *,
    end_seq: int | None = None,
    timeout: float = 5.0,  # noqa: ASYNC109 - one budget for the whole exchange, applied inside
    max_batches: int = 20_000,
    max_message_bytes: int = -1,
    on_unknown: Callable[[str], None] | None = None,
) -> ReplayResult:
    """Ask a publisher's replay service for every buffered batch with seq >= ``start_seq`` (and below
    ``end_seq``, when given: the exchange ends at the first batch at or past it). Replies longer than
    ``max_message_bytes`` (-1: no limit) make ZMQ drop the connection, so the exchange times out.

    Replies are ``[b"", topic, seq, payload]`` (vLLM 0.32) or ``[b"", seq, payload]`` (other vLLM
    versions); the end marker is seq -1 with an empty payload. Raises TimeoutError when the service does
    not finish within ``timeout`` seconds (for instance when nothing listens there: ZMQ queues the request
    and waits for a peer).
    """
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    out = ReplayResult([])
    try:
        sock.connect(replay_endpoint)
        async with asyncio.timeout(timeout):
            await sock.send_multipart([b"", encode_seq(start_seq)])
            while True:
                frames = await sock.recv_multipart()
                if len(frames) not in (3, 4) or frames[0]:
                    out.decode_errors += 1
                    continue
                try:
                    seq = decode_seq(frames[-2])
                except KVEventDecodeError:
                    out.decode_errors += 1
                    continue
                if seq == REPLAY_END_SEQ or (end_seq is not None and seq >= end_seq):
                    return out
                try:
                    out.batches.append((seq, decode_batch(frames[-1], on_unknown=on_unknown)))
                except KVEventDecodeError:
                    out.decode_errors += 1
                if len(out.batches) > max_batches:
                    raise TimeoutError(f"replay from {replay_endpoint} sent more than {max_batches} batches")
    finally:
        sock.close(linger=0)


def contiguous_run(batches: list[tuple[int, EventBatch]], end: int) -> list[tuple[int, EventBatch]]:
    """The batches from the first one on while their seqs follow each other, all below ``end``."""
    run: list[tuple[int, EventBatch]] = []
    for item in batches:
        if item[0] >= end or (run and item[0] != run[-1][0] + 1):
            break
        run.append(item)
    return run


def last_run_start(batches: list[tuple[int, EventBatch]]) -> int:
    """How many batches, counted from the end, follow each other without a gap."""
    count = 1 if batches else 0
    for i in range(len(batches) - 1, 0, -1):
        if batches[i][0] != batches[i - 1][0] + 1:
            break
        count += 1
    return count
