"""A child process for the lost-connection tests: a subscriber still reading a backlog of KV events when
its publisher's connection has been down past the grace period (a slow event loop after an engine died).

``python -m support.kv_event_backlog MESSAGES APPLY_S GRACE_S`` prints ``{"resets": [...], "applied": N}``
and exits 0. A libzmq assertion (``!_more (src/fq.cpp:80)``) aborts it instead, with SIGABRT: run it in a
subprocess, never in the test's own process.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import zmq.asyncio

from kvstack.kvevents.codec import EventBatch
from kvstack.kvevents.subscriber import KVEventSubscriber
from support.kv_events import TIMEOUT, RecordingSink, ScriptedPublisher
from support.waiting import eventually


class SlowSink(RecordingSink):
    """Applying a batch blocks the event loop for ``apply_s`` seconds once the backlog is there."""

    def __init__(self, apply_s: float) -> None:
        super().__init__()
        self.apply_s = apply_s

    def apply(self, engine: str, batch: EventBatch) -> None:
        super().apply(engine, batch)
        if len(self.applied) > 1:
            time.sleep(self.apply_s)


def die_unread(pub: ScriptedPublisher) -> None:
    """The publisher dies while the event loop stands still (blocked here): the subscriber has read none of
    what it sent, and its monitor has heard of the drop, when it next runs."""
    time.sleep(0.3)  # ZMQ's I/O threads move the backlog into the SUB socket
    pub.pub.close(linger=0)
    time.sleep(0.3)


async def drain(messages: int, apply_s: float, grace_s: float) -> SlowSink:
    """The publisher sends ``messages`` batches and dies before the subscriber reads any of them."""
    ctx = zmq.asyncio.Context()
    pub = ScriptedPublisher(ctx, replay=False)
    sink = SlowSink(apply_s)
    sub = KVEventSubscriber(
        "http://engine", sink, context=ctx, sources=[pub.source], disconnect_grace=grace_s
    )
    sub.start()
    try:
        await pub.subscribed()
        await pub.send(0)
        await eventually(lambda: sink.applied == [0], timeout_s=TIMEOUT)
        for seq in range(1, messages + 1):
            await pub.send(seq)  # a PUB send completes at once: the subscriber's task does not run
        die_unread(pub)
        await eventually(lambda: sink.resets, timeout_s=TIMEOUT + messages * apply_s)
    finally:
        await sub.stop()
        await pub.close()
        ctx.destroy(linger=0)
    return sink


def main() -> None:
    messages, apply_s, grace_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    sink = asyncio.run(drain(messages, apply_s, grace_s))
    print(json.dumps({"resets": sink.resets, "applied": len(sink.applied)}), flush=True)


if __name__ == "__main__":
    main()
