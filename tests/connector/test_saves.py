"""The connector worker's background save queue, with fake gather and send phases (bytes standing in for KV
blocks): order, acknowledgements, a full queue, held requests, failures, preemption and closing."""

from __future__ import annotations

import threading
import time

import pytest

from kvstack.cache.keys import ChunkKey
from kvstack.connector import SaveQueue
from kvstack.connector.plan import ChunkSave, RequestSave
from support.waiting import wait_until


def job(req_id: str, n: int = 1) -> RequestSave:
    chunk = ChunkSave((ChunkKey(b"k" * 32),), (1, 2, 3), (4, 5))
    return RequestSave(req_id, None, (chunk,) * n)


class FakeKV:
    """Gather/send phases over fake KV: gathers can be held at a gate, sends fail on request."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.gathering = threading.Event()
        self.send_gate = threading.Event()
        self.send_gate.set()
        self.sent: list[str] = []
        self.gathered: list[str] = []
        self.fail: dict[str, str] = {}
        self.exits = 0

    def gather(self, save: RequestSave) -> bytes:
        self.gathering.set()
        assert self.gate.wait(10)
        if self.fail.get(save.req_id) == "gather":
            raise RuntimeError("gather broke")
        self.gathered.append(save.req_id)
        return b"kv" * len(save.chunks)

    def send(self, save: RequestSave, payload: bytes) -> bool:
        assert self.send_gate.wait(10)
        if self.fail.get(save.req_id) == "send":
            raise ConnectionError("send broke")
        self.sent.append(save.req_id)
        return self.fail.get(save.req_id) != "refused"

    def on_exit(self) -> None:
        self.exits += 1

    def queue(self, capacity: int = 8) -> SaveQueue[bytes]:
        return SaveQueue(self.gather, self.send, capacity=capacity, on_exit=self.on_exit)

    def hold_gathers(self) -> None:
        self.gate.clear()
        self.gathering.clear()


def test_saves_run_in_order_in_the_background_and_are_acknowledged() -> None:
    kv = FakeKV()
    q = kv.queue()
    for r in ("a", "b", "a"):
        assert q.submit(job(r)) is True
    wait_until(lambda: q.stats.saved == 3)
    assert kv.sent == ["a", "b", "a"]
    assert q.take_acks() == {"a": 2, "b": 1}
    assert q.take_acks() == {}
    assert q.close(5) is True and kv.exits == 1


def test_a_full_queue_drops_the_save_instead_of_blocking() -> None:
    kv = FakeKV()
    q = kv.queue(capacity=2)
    kv.hold_gathers()
    q.submit(job("a"))
    assert kv.gathering.wait(5)  # "a" is being gathered; two more fill the queue
    assert q.submit(job("b")) and q.submit(job("c"))
    started = time.monotonic()
    assert q.submit(job("d")) is False
    assert time.monotonic() - started < 0.5
    assert q.stats.dropped_full == 1 and q.take_acks() == {"d": 1}  # never reads its blocks
    kv.gate.set()
    wait_until(lambda: q.stats.saved == 3)
    assert kv.sent == ["a", "b", "c"]
    q.close(5)


def test_a_held_request_is_released_once_when_its_saves_have_read_its_blocks() -> None:
    kv = FakeKV()
    q = kv.queue()
    kv.hold_gathers()
    kv.send_gate.clear()
    q.submit(job("r"))
    assert kv.gathering.wait(5)
    q.hold("r")
    assert q.take_released() == set()
    released: set[str] = set()
    kv.gate.set()  # the gather is done; its send still waits, but the blocks are not needed any more

    def some_released() -> set[str]:
        released.update(q.take_released())
        return released

    wait_until(some_released)
    assert released == {"r"} and kv.sent == []
    kv.send_gate.set()
    wait_until(lambda: q.stats.saved == 1)
    assert q.take_released() == set() and q.num_tracked == 0  # reported once
    q.close(5)


def test_a_held_request_without_saves_in_flight_is_released_at_once() -> None:
    q = FakeKV().queue()
    q.hold("done-already")
    assert q.take_released() == {"done-already"}
    q.close(1)


def test_save_failures_are_counted_never_raised() -> None:
    kv = FakeKV()
    kv.fail = {"g": "gather", "s": "send", "x": "refused"}
    q = kv.queue()
    for r in ("g", "s", "x", "ok"):
        q.submit(job(r))
    wait_until(lambda: q.stats.saved + q.stats.failed == 4)
    assert (q.stats.saved, q.stats.failed) == (1, 3)
    assert q.take_acks() == {"g": 1, "s": 1, "x": 1, "ok": 1}  # a failed gather no longer reads either
    q.hold("g")
    assert q.take_released() == {"g"}
    q.close(5)


def test_a_save_thread_calls_ready_before_it_gathers() -> None:
    """A device KV cache: ``ready`` waits on the save thread (never the caller's) until the forward pass
    has written the blocks; a ``ready`` that fails is a failed save that no longer reads the blocks."""
    kv = FakeKV()
    q = kv.queue()
    readied: list[tuple[str, list[str]]] = []

    def ready() -> None:
        readied.append((threading.current_thread().name, list(kv.gathered)))

    def broken() -> None:
        raise RuntimeError("device lost")

    assert q.submit(job("a"), ready) and q.submit(job("b"), broken) and q.submit(job("c"))
    wait_until(lambda: q.stats.saved + q.stats.failed == 3)
    assert readied == [("kvstack-saves", [])]  # on the save thread, before a's gather
    assert kv.gathered == ["a", "c"]
    assert (q.stats.saved, q.stats.failed, kv.sent) == (2, 1, ["a", "c"])
    assert q.take_acks() == {"a": 1, "b": 1, "c": 1}
    q.close(5)


def test_skipped_saves_are_acknowledged() -> None:
    q = FakeKV().queue()
    q.skip(job("r"))
    assert q.take_acks() == {"r": 1} and q.stats.skipped == 1
    q.close(1)


def test_preemption_drops_queued_saves_and_waits_for_a_gather_in_progress() -> None:
    kv = FakeKV()
    q = kv.queue()
    kv.hold_gathers()
    q.submit(job("p"))
    assert kv.gathering.wait(5)
    q.submit(job("p"))
    q.submit(job("other"))
    done: list[int] = []
    canceller = threading.Thread(target=lambda: done.append(q.cancel({"p"})))
    canceller.start()
    canceller.join(0.2)
    assert canceller.is_alive()  # the gather still reads p's blocks
    kv.gate.set()
    canceller.join(5)
    assert done == [1] and q.stats.cancelled == 1
    wait_until(lambda: q.stats.saved == 2)
    assert kv.sent == ["p", "other"]  # the gather in progress completes its save
    assert q.take_acks() == {"p": 2, "other": 1}
    assert q.cancel(set()) == 0
    q.close(5)


def test_close_drains_the_queue() -> None:
    kv = FakeKV()
    q = kv.queue()
    for r in "abc":
        q.submit(job(r))
    assert q.close(5) is True
    assert q.stats.saved == 3 and kv.exits == 1
    assert q.submit(job("late")) is False and q.stats.abandoned == 1
    assert q.take_acks()["late"] == 1


def test_close_is_bounded_and_abandons_what_it_could_not_send() -> None:
    kv = FakeKV()
    q = kv.queue()
    kv.hold_gathers()
    for r in "abc":
        q.submit(job(r))
    assert kv.gathering.wait(5)
    started = time.monotonic()
    assert q.close(0.2) is False  # "a" is stuck: the caller goes on
    assert time.monotonic() - started < 2
    kv.gate.set()  # past the drain bound: "a" ends, "b" and "c" are dropped
    wait_until(lambda: kv.exits == 1)
    assert q.stats.abandoned == 2 and q.stats.saved == 1
    assert q.take_acks() == {"a": 1, "b": 1, "c": 1}


def test_a_queue_never_started_closes_at_once() -> None:
    kv = FakeKV()
    assert kv.queue().close(1) is True and kv.exits == 1
    with pytest.raises(ValueError, match="capacity"):
        SaveQueue(kv.gather, kv.send, capacity=0)
