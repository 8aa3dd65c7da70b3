"""The router's prefix locator (kvstack.frontend.prefix): LoRA adapters and cache salts, cache-server chunks
credited only to their model, one block size per engine that odd events cannot switch, a bounded keyer
cache. Events are built as vLLM 0.32 sends them and go through the wire codec before the locator sees
them."""

from __future__ import annotations

import asyncio
import time
from array import array
from typing import Any

from kvstack.cache.events import ChunkEvents, block_hash, pack_note, unpack_note
from kvstack.cache.keys import KVLayout, chunk_keys
from kvstack.cache.tiers import DiskTier
from kvstack.engines.prompt_tokens import PromptTokenizer
from kvstack.engines.state import Endpoint, EngineState
from kvstack.frontend.prefix import PrefixLocator
from kvstack.frontend.routing import RouteRequest, SchedulerPicker
from kvstack.kvevents.codec import (
    MODEL_EXTRA_KEY,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from kvstack.scheduling import build_scheduler, load_routing

TOKENS = list(range(1000, 1064))  # 4 blocks of 16
CHUNK = 4
LAYOUT = KVLayout("llama-8b", num_layers=2, num_kv_heads=2, head_size=8, dtype="float16")
A, B = "http://a", "http://b"


def engine(url: str, models: tuple[str, ...] = ("base", "sql")) -> EngineState:
    state = EngineState(Endpoint(url, models=frozenset(models)))
    state.knowledge = "kv-events"
    return state


def stored(
    hashes: list[int | bytes], parent: int | None, tokens: list[int], size: int, **fields: Any
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size, **fields
    )


def feed(locator: PrefixLocator, location: str, *events: BlockStored | BlockRemoved) -> None:
    """As the subscriber does: the batch crosses the wire codec first."""
    locator.apply(location, decode_batch(encode_batch(EventBatch(ts=time.time(), events=list(events)))))


def base_and_lora() -> PrefixLocator:
    """A holds the prompt's blocks for the base model; B holds them for adapter ``sql`` (vLLM 0.32 shape:
    ``lora_name`` set and each block's ``extra_keys`` the adapter's bare name)."""
    locator = PrefixLocator()
    feed(locator, A, stored([1, 2, 3, 4], None, TOKENS, 16, group_idx=0))
    lora = stored([11, 12, 13, 14], None, TOKENS, 16, lora_id=1, lora_name="sql", extra_keys=[("sql",)] * 4)
    feed(locator, B, lora)
    return locator


# -- LoRA adapters and cache salts ---------------------------------------------------------------------------


def test_lora_request_is_credited_only_with_its_adapters_blocks() -> None:
    locator = base_and_lora()
    states = [engine(A), engine(B)]
    assert locator.stats.skipped_extra_keys == 0
    assert locator.lookup(TOKENS, states, model="sql").view.precise == {B: (64, 64, 64, 64)}
    assert locator.lookup(TOKENS, states, model="base").view.precise == {A: (64, 64, 64, 64)}
    # A removal through the engine-hash map reaches the adapter's blocks too.
    feed(locator, B, BlockRemoved(block_hashes=[13, 14], group_idx=0))
    assert locator.lookup(TOKENS, states, model="sql").view.precise == {B: (32, 32, 32, 32)}


def test_blocks_with_more_than_their_adapter_in_extra_keys_are_skipped() -> None:
    locator = PrefixLocator()
    salted_lora = stored(
        [1, 2], None, TOKENS[:32], 16, lora_name="sql", extra_keys=[("sql", "salt"), ("sql",)]
    )
    image = stored([3], None, TOKENS[:16], 16, extra_keys=[("img-1", 0)])
    other_adapter = stored([4], None, TOKENS[:16], 16, lora_name="sql", extra_keys=[("chat",)])
    feed(locator, A, salted_lora, image, other_adapter)
    assert locator.stats.skipped_extra_keys == 4
    assert len(locator.index) == 0


def test_salted_request_gets_no_exact_credit_and_salted_history() -> None:
    locator = base_and_lora()
    states = [engine(A), engine(B)]
    salted = locator.lookup(TOKENS, states, model="base", cache_salt="user-1")
    assert salted.view.precise == {}
    locator.record(A, salted)
    # Only the same salt finds the history the salted request left.
    assert locator.lookup(TOKENS, states, model="base", cache_salt="user-1").view.approximate == {A: 64}
    assert locator.lookup(TOKENS, states, model="base", cache_salt="user-2").view.approximate == {}
    assert locator.lookup(TOKENS, states, model="base").view.approximate == {}


async def test_router_looks_up_the_requests_adapter_and_salt() -> None:
    locator = base_and_lora()
    picker = SchedulerPicker(
        build_scheduler(load_routing("kv-aware")), prompts=PromptTokenizer(), locator=locator
    )
    states = [engine(A), engine(B)]

    async def route(model: str, **fields: object) -> str:
        body = {"model": model, "prompt": TOKENS, **fields}
        request = RouteRequest("/v1/completions", model, False, None, "r", body)
        return (await picker.pick(request, states)).target

    assert await route("sql") == B
    assert await route("base") == A
    # With a salt nobody holds the prefix; the choice is the scheduler's cold pick, not the prefix.
    assert locator.lookup(TOKENS, states, model="base", cache_salt="s").view.precise == {}
    await route("base", cache_salt="s")  # accepted, not an error


# -- one block size per engine -------------------------------------------------------------------------------


def test_partial_block_event_does_not_switch_the_engines_block_size() -> None:
    locator = PrefixLocator()
    full = dict(group_idx=0, kv_cache_spec_kind="full_attention")
    feed(locator, A, stored([1, 2, 3, 4], None, TOKENS, 16, **full))
    # vLLM's cache_partial_block: the prompt tail inside block 4, block_size = the tokens it holds.
    tail = list(range(2000, 2008))
    feed(locator, A, stored([5], 4, tail, 8, **full))
    assert locator.block_size(A) == 16
    assert locator.lookup([*TOKENS, *tail], [engine(A)]).view.precise == {A: (64, 64, 64, 64)}
    # Events of an older vLLM carry no group: a stray one-token block does not switch either.
    feed(locator, B, stored([1, 2, 3, 4], None, TOKENS, 16), stored([77], None, [5], 1))
    assert locator.block_size(B) == 16
    assert locator.lookup(TOKENS, [engine(B)]).view.precise == {B: (64, 64, 64, 64)}
    assert locator.stats.skipped_layout == 2


def test_sliding_window_group_is_not_indexed_and_its_removals_keep_full_attention_blocks() -> None:
    locator = PrefixLocator()
    # A hybrid model: group 0 full attention, group 1 sliding window with the same block hashes, and a
    # group 2 of another block size.
    feed(locator, A, stored([1, 2, 3, 4], None, TOKENS, 16, group_idx=0, kv_cache_spec_kind="full_attention"))
    sliding = dict(kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32)
    feed(locator, A, stored([1, 2, 3, 4], None, TOKENS, 16, group_idx=1, **sliding))
    feed(locator, A, stored([91, 92], None, TOKENS, 32, group_idx=2, **sliding))
    # The window slid past blocks 0-1 in group 1: they are still held in group 0.
    feed(locator, A, BlockRemoved(block_hashes=[1, 2], group_idx=1))
    assert locator.block_size(A) == 16
    assert locator.lookup(TOKENS, [engine(A)]).view.precise == {A: (64, 64, 64, 64)}
    feed(locator, A, BlockRemoved(block_hashes=[3, 4], group_idx=0))
    assert locator.lookup(TOKENS, [engine(A)]).view.precise == {A: (32, 32, 32, 32)}


def test_restarted_engine_with_another_block_size_takes_over_after_a_block() -> None:
    locator = PrefixLocator()
    feed(locator, A, stored([1, 2, 3, 4], None, TOKENS, 16, group_idx=0))
    locator.reset(A, "restart")
    feed(locator, A, stored([7, 8], None, TOKENS, 32, group_idx=0))
    assert locator.block_size(A) == 32
    assert locator.lookup(TOKENS, [engine(A)]).view.precise == {A: (64, 64, 64, 64)}


# -- the keyer cache is bounded ------------------------------------------------------------------------------


def test_keyer_cache_is_bounded_and_a_forgotten_engine_leaves_no_layout() -> None:
    locator = PrefixLocator()
    for i in range(300):
        feed(locator, A, stored([i], None, [1, 2], 2, lora_name=f"adapter-{i}"))
        feed(locator, A, stored([10_000 + i], None, [1] * (i + 3), i + 3))
    assert locator._keyers.cache_info().currsize <= 64
    locator.forget(A)
    assert locator.block_size(A) is None and A not in locator._layouts


# -- cache-server chunks are credited only to their model ----------------------------------------------------


def test_cache_chunks_are_credited_only_to_their_models_requests_and_engines() -> None:
    cache = "cache+tcp://c1"
    locator = PrefixLocator()
    locator.add_cache(cache, "node1")
    named = [(MODEL_EXTRA_KEY, "llama-8b")] * 4
    feed(locator, cache, stored([501, 502, 503, 504], None, TOKENS, 16, medium="CPU", extra_keys=named))
    e8b = EngineState(Endpoint("http://e8b", node="node1", models=frozenset({"llama-8b"})))
    e70b = EngineState(Endpoint("http://e70b", node="node1", models=frozenset({"llama-70b"})))
    cpu = (0, 64, 64, 64)
    assert locator.lookup(TOKENS, [e8b, e70b], model="llama-8b").view.precise == {e8b.url: cpu}
    assert locator.lookup(TOKENS, [e8b, e70b], model="llama-70b").view.precise == {}
    # Removing the chunks goes through the engine-hash map as before.
    feed(locator, cache, BlockRemoved(block_hashes=[503, 504], medium="CPU"))
    assert locator.lookup(TOKENS, [e8b], model="llama-8b").view.precise == {e8b.url: (0, 32, 32, 32)}
    # A server that names no model (an older one) is credited to the node's engines as before.
    old = "cache+tcp://c0"
    locator.add_cache(old, "node1")
    feed(locator, old, stored([601, 602, 603, 604], None, TOKENS, 16, medium="CPU"))
    assert locator.lookup(TOKENS, [e70b], model="llama-70b").view.precise == {e70b.url: cpu}


def test_cache_server_events_and_disk_notes_carry_the_puts_model() -> None:
    published: list[Any] = []
    events = ChunkEvents(published.extend, chunk_size=CHUNK)
    tokens = list(range(50, 50 + 3 * CHUNK))
    keys = chunk_keys(tokens, LAYOUT, CHUNK)
    lists = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
    disk = DiskTier("/nonexistent", 1)

    async def run() -> None:
        events.remember(keys[:2], None, lists[:2], "llama-8b")
        events.remember(keys[2:], keys[1], lists[2:])  # an older client: no model
        events.stored(disk, keys)
        await asyncio.sleep(0)

    asyncio.run(run())
    first, second = published
    assert first.extra_keys == [(MODEL_EXTRA_KEY, "llama-8b")] * 2 and first.token_ids == tokens[: 2 * CHUNK]
    assert second.extra_keys is None and second.parent_block_hash == block_hash(keys[1])
    note = events.annotation(keys[1])
    assert note is not None and unpack_note(note, CHUNK) == (keys[0], array("I", lists[1]), "llama-8b")
    assert unpack_note(pack_note(None, array("I", lists[0])), CHUNK) == (None, array("I", lists[0]), None)
    # What the router makes of them: the model's chunks keyed under it, the others under the base namespace.
    locator = PrefixLocator()
    locator.add_cache("cache+tcp://c", None)
    for event in published:
        feed(locator, "cache+tcp://c", event)
    assert locator.stats.stored_blocks == 3 and locator.stats.skipped_extra_keys == 0
