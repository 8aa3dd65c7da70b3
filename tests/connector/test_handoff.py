"""P/D through the cache tier without vLLM: the prefill side's params, what the decode side reads from them,
how long it waits, and the planner's answers both sides ask for (a dict stands in for the store)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvstack.cache.keys import ChunkKey, chunk_keys
from kvstack.connector import (
    PAGED_LAYOUT,
    AttentionShape,
    ChunkPlanner,
    block_layout_name,
    keys_by_rank,
    kv_layout,
)
from kvstack.connector.handoff import Handoff, HandoffWaits, handoff_of, prefill_answer

KEY = ChunkKey(bytes(range(32)))
BLOCK, CHUNK = 128, 256
SHAPE = AttentionShape(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16", block_size=BLOCK)
CPU = block_layout_name(PAGED_LAYOUT, platform="cpu", backend="CPU_ATTN", block_size=BLOCK)
LAYOUT = kv_layout("tiny", SHAPE, block_layout=CPU, tp_rank=0, tp_size=1)


def tokens(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 + 3 for i in range(n)]


class Store:
    """The cache server's lookup over a set of keys."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def locate(self, keys: Sequence[ChunkKey]) -> list[str]:
        found: list[str] = []
        for key in keys:
            if key not in self.keys:
                break
            found.append("memory")
        return found

    def hold(self, prompt: list[int], chunks: int) -> None:
        self.keys.update(chunk_keys(prompt, LAYOUT, CHUNK)[:chunks])


def planner(store: Store, *, load: bool = True) -> ChunkPlanner:
    return ChunkPlanner(CHUNK, BLOCK, keys_by_rank([LAYOUT], CHUNK), store.locate, load=load)


def test_a_remote_decode_request_is_answered_with_the_tokens_and_last_key_it_left() -> None:
    params = prefill_answer({"do_remote_decode": True}, 512, KEY)
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvstack_tokens": 512,
        "kvstack_key": str(KEY),
    }
    assert handoff_of(params) == Handoff(512, KEY)  # what the decode side reads back
    # Nothing in the tier (a prompt shorter than a chunk, a salted one): still a remote prefill, nothing to
    # wait for.
    nothing = prefill_answer({"do_remote_decode": True}, 0, None)
    assert nothing is not None and nothing["do_remote_prefill"] is True and handoff_of(nothing) is None


@pytest.mark.parametrize("requested", [None, {}, {"do_remote_decode": False}, {"do_remote_prefill": True}])
def test_other_requests_get_no_params(requested: dict[str, object] | None) -> None:
    assert prefill_answer(requested, 512, KEY) is None


@pytest.mark.parametrize(
    "params",
    [
        None,
        {"do_remote_decode": True},
        # NIXL's params: a remote prefill, but not through kvstack's tier
        {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"},
        {"do_remote_prefill": False, "kvstack_tokens": 512, "kvstack_key": str(KEY)},
        {"do_remote_prefill": True, "kvstack_tokens": "512", "kvstack_key": str(KEY)},
        {"do_remote_prefill": True, "kvstack_tokens": True, "kvstack_key": str(KEY)},
        {"do_remote_prefill": True, "kvstack_tokens": -256, "kvstack_key": str(KEY)},
        {"do_remote_prefill": True, "kvstack_tokens": 512, "kvstack_key": "not hex"},
        {"do_remote_prefill": True, "kvstack_tokens": 512, "kvstack_key": "abcd"},
        {"do_remote_prefill": True, "kvstack_tokens": 512},
    ],
)
def test_params_without_a_usable_handoff_mean_no_wait(params: dict[str, object] | None) -> None:
    assert handoff_of(params) is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_decode_request_waits_until_the_tier_holds_the_handed_off_tokens() -> None:
    clock = Clock()
    waits, handoff = HandoffWaits(2.0, poll_s=0.01, clock=clock), Handoff(512, KEY)
    assert waits.due("r")
    assert waits.keep_waiting("r", handoff, 256)  # one chunk of two so far
    assert not waits.due("r")  # no look-up before the poll interval
    clock.now += 0.01
    assert waits.due("r")
    assert not waits.keep_waiting("r", handoff, 512)  # all there: load them
    # Resolved: a request resumed after a preemption does not wait again, whatever it finds.
    assert waits.due("r") and not waits.keep_waiting("r", handoff, 0)
    waits.end("r")
    assert len(waits) == 0


def test_the_wait_is_bounded() -> None:
    clock = Clock()
    waits, handoff = HandoffWaits(2.0, poll_s=0.01, clock=clock), Handoff(512, KEY)
    assert waits.keep_waiting("r", handoff, 0)
    clock.now += 1.99
    assert waits.keep_waiting("r", handoff, 256)
    clock.now += 0.01
    assert not waits.keep_waiting("r", handoff, 256)  # out of time: compute the rest
    assert not HandoffWaits(0.0, clock=clock).keep_waiting("s", handoff, 0)  # prefill_wait_s 0: never waits
    waits.end("never-seen")


def test_the_planner_reports_what_a_prefill_leaves_in_the_tier() -> None:
    store, prompt = Store(), tokens(600)
    keys = chunk_keys(prompt, LAYOUT, CHUNK)
    p = planner(store)
    p.match("r", prompt, 0)
    p.allocated("r", 0)
    p.schedule_new("r", prompt, list(range(5)), 0, 600)
    assert p.handed_off("r") == (512, keys[1])  # two chunks being saved; the last 88 tokens are not keyed
    # A prompt partly stored already: the stored chunk and the saved one.
    store.hold(prompt, 1)
    p.match("s", prompt, 0)
    p.allocated("s", 256)
    p.schedule_new("s", prompt, list(range(5)), 256, 344)
    assert p.handed_off("s") == (512, keys[1])
    # Shorter than a chunk, or never scheduled: nothing.
    p.match("short", tokens(200), 0)
    p.schedule_new("short", tokens(200), [1, 2], 0, 200)
    assert p.handed_off("short") == (0, None) and p.handed_off("never-seen") == (0, None)
    p.finished("r")
    assert p.handed_off("r") == (0, None)


def test_the_planner_reports_what_a_decode_lookup_found() -> None:
    store, prompt = Store(), tokens(600)
    keys = chunk_keys(prompt, LAYOUT, CHUNK)
    p = planner(store)
    assert p.stored_end("r") is None  # not looked up
    p.match("r", prompt, 0)
    assert p.stored_end("r") == 0
    store.hold(prompt, 1)
    p.match("r", prompt, 0)
    assert p.stored_end("r") == 256
    p.match("r", prompt, 256)  # a local hit of chunk 0, chunk 1 not stored
    assert p.stored_end("r") == 256
    assert (p.chunk_key("r", 1), p.chunk_key("r", 2), p.chunk_key("r", -1)) == (keys[1], None, None)
    not_loading = planner(store, load=False)
    not_loading.match("r", prompt, 0)
    assert not_loading.stored_end("r") is None  # it never looks chunks up: nothing to wait for
