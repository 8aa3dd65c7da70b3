"""The connector's scheduler half without vLLM or torch: block arithmetic, the plans it makes against a dict
standing in for the store (loads past the local hit, saves of full chunks, preemption, resumption), and
the blocks it holds while asynchronous saves read them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvstack.cache.keys import ChunkKey, KVLayout, chunk_keys
from kvstack.cache.protocol import StoredTail
from kvstack.connector import (
    PAGED_LAYOUT,
    AttentionShape,
    ChunkPlanner,
    block_layout_name,
    keys_by_rank,
    kv_layout,
    loadable_end,
    plan_load,
    plan_save,
)
from kvstack.connector.plan import ChunkLoad, RequestSave
from kvstack.connector.planner import tail_keys_by_rank

BLOCK = 128
CHUNK = 256
TINY = AttentionShape(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16", block_size=BLOCK)
CPU = block_layout_name(PAGED_LAYOUT, platform="cpu", backend="CPU_ATTN", block_size=BLOCK)
LAYOUT = kv_layout("tiny", TINY, block_layout=CPU, tp_rank=0, tp_size=1)


def tokens(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 + 3 for i in range(n)]


# -- block arithmetic


@pytest.mark.parametrize(
    ("prompt", "stored_end", "end"),
    [
        (600, 512, 512),  # two stored chunks, the rest computed
        (512, 512, 511),  # the whole prompt stored: everything but the last token, inside the last block
        (513, 512, 512),
        (257, 256, 256),
        (256, 256, 255),
        (100, 0, 0),  # shorter than a chunk: nothing stored
        (600, 0, 0),
        (0, 0, 0),
    ],
)
def test_loadable_end_leaves_the_last_token_to_vllm(prompt: int, stored_end: int, end: int) -> None:
    assert loadable_end(prompt, stored_end, BLOCK) == end


def test_a_stored_end_off_the_block_grid_is_a_bug_not_a_load() -> None:
    with pytest.raises(ValueError, match="multiple of the block size"):
        loadable_end(600, 300, BLOCK)


def rank_keys(n: int) -> list[tuple[ChunkKey, ...]]:
    return [(k,) for k in chunk_keys(tokens(n * CHUNK), LAYOUT, CHUNK)]


def test_plan_load_copies_only_the_blocks_past_the_local_hit() -> None:
    keys = rank_keys(2)
    blocks = [10, 11, 12, 13, 14]
    # local hit of one block: chunk 0 is fetched, only its second block copied
    assert plan_load(keys, 128, 512, chunk_size=CHUNK, block_size=BLOCK, block_ids=blocks) == (
        ChunkLoad(keys[0], 1, (11,)),
        ChunkLoad(keys[1], 0, (12, 13)),
    )
    # the end inside a chunk (capped for the last token): the chunk's first block only
    assert plan_load(keys, 0, 384, chunk_size=CHUNK, block_size=BLOCK, block_ids=blocks) == (
        ChunkLoad(keys[0], 0, (10, 11)),
        ChunkLoad(keys[1], 0, (12,)),
    )
    assert plan_load(keys, 256, 512, chunk_size=CHUNK, block_size=BLOCK, block_ids=blocks) == (
        ChunkLoad(keys[1], 0, (12, 13)),
    )
    # a 512-token chunk of four blocks
    big = [(k,) for k in chunk_keys(tokens(1024), LAYOUT, 512)]
    assert plan_load(big, 128, 640, chunk_size=512, block_size=BLOCK, block_ids=list(range(8))) == (
        ChunkLoad(big[0], 1, (1, 2, 3)),
        ChunkLoad(big[1], 0, (4,)),
    )


@pytest.mark.parametrize(
    ("start", "end", "says"),
    [
        (100, 512, "does not start on a block"),
        (256, 256, "empty"),
        (0, 768, "needs chunk 2"),
    ],
)
def test_plan_load_refuses_ranges_it_cannot_fill(start: int, end: int, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        plan_load(rank_keys(2), start, end, chunk_size=CHUNK, block_size=BLOCK, block_ids=list(range(8)))
    with pytest.raises(ValueError, match="blocks"):
        plan_load(rank_keys(2), 0, 512, chunk_size=CHUNK, block_size=BLOCK, block_ids=[1, 2, 3])


def test_plan_save_takes_each_chunks_tokens_and_blocks() -> None:
    prompt = tokens(600)
    keys = [(k,) for k in chunk_keys(prompt, LAYOUT, CHUNK)]
    saves = plan_save(keys, prompt, 1, 2, chunk_size=CHUNK, block_size=BLOCK, block_ids=[5, 6, 7, 8, 9])
    assert len(saves) == 1
    assert saves[0].keys == keys[1] and saves[0].block_ids == (7, 8)
    assert saves[0].token_ids == tuple(prompt[256:512])
    with pytest.raises(ValueError, match="needs 3 keys"):
        plan_save(keys, prompt, 0, 3, chunk_size=CHUNK, block_size=BLOCK, block_ids=list(range(6)))


def test_a_stored_tail_extends_the_loadable_end_off_the_block_grid() -> None:
    assert loadable_end(700, 512, BLOCK, tail=88) == 600
    assert loadable_end(600, 512, BLOCK, tail=88) == 599  # capped before the last token
    assert loadable_end(100, 0, BLOCK, tail=60) == 60


def test_plan_load_and_plan_save_carry_the_tail_in_its_own_blocks() -> None:
    prompt = tokens(600)
    *full, tail = chunk_keys(prompt, LAYOUT, CHUNK, include_partial=True)
    keys = [(k,) for k in full]
    blocks = [10, 11, 12, 13, 14, 15]
    loads = plan_load(keys, 128, 600, chunk_size=CHUNK, block_size=BLOCK, block_ids=blocks, tail=(tail,))
    assert loads == (
        ChunkLoad(keys[0], 1, (11,)),
        ChunkLoad(keys[1], 0, (12, 13)),
        ChunkLoad((tail,), 0, (14,), 1),
    )
    # a tail right at the prompt's start: the whole load is the tail
    (short,) = chunk_keys(prompt[:200], LAYOUT, CHUNK, include_partial=True)
    assert plan_load([], 0, 200, chunk_size=CHUNK, block_size=BLOCK, block_ids=blocks, tail=(short,)) == (
        ChunkLoad((short,), 0, (10, 11), 2),
    )
    saves = plan_save(keys, prompt, 2, 2, chunk_size=CHUNK, block_size=BLOCK, block_ids=blocks, tail=(tail,))
    assert [(s.keys, s.token_ids, s.block_ids) for s in saves] == [((tail,), tuple(prompt[512:]), (14,))]
    with pytest.raises(ValueError, match="tail"):
        plan_save(keys, prompt, 0, 1, chunk_size=CHUNK, block_size=BLOCK, block_ids=blocks, tail=(tail,))
    with pytest.raises(ValueError, match="blocks"):
        plan_save(keys, prompt, 0, 2, chunk_size=CHUNK, block_size=BLOCK, block_ids=blocks[:4], tail=(tail,))


# -- the scheduler half


class FakeStore:
    """The cache server's lookup over a dict: key -> tier."""

    def __init__(self) -> None:
        self.tiers: dict[bytes, str] = {}
        self.lookups: list[list[bytes]] = []

    def locate(self, keys: Sequence[ChunkKey]) -> list[str]:
        self.lookups.append(list(keys))
        found = []
        for key in keys:
            if key not in self.tiers:
                break
            found.append(self.tiers[key])
        return found

    def hold(self, prompt: list[int], chunks: int, tier: str = "memory") -> None:
        for key in chunk_keys(prompt, LAYOUT, CHUNK)[:chunks]:
            self.tiers[key] = tier


def planner(store: FakeStore, *, load: bool = True, save: bool = True, workers: int = 1) -> ChunkPlanner:
    keys_for = keys_by_rank([LAYOUT], CHUNK)
    return ChunkPlanner(CHUNK, BLOCK, keys_for, store.locate, load=load, save=save, workers=workers)


def test_cold_prompt_saves_its_full_chunks_with_tokens_and_parents() -> None:
    store, prompt = FakeStore(), tokens(600)
    p = planner(store)
    assert p.match("r", prompt, 0) == 0
    p.allocated("r", 0)
    p.schedule_new("r", prompt, [4, 5, 6, 7, 8], 0, 600)
    plan = p.take_plan()
    keys = chunk_keys(prompt, LAYOUT, CHUNK)
    assert plan.loads == [] and len(plan.saves) == 1
    save = plan.saves[0]
    assert save.parent is None and [c.keys for c in save.chunks] == [(keys[0],), (keys[1],)]
    assert [c.block_ids for c in save.chunks] == [(4, 5), (6, 7)]
    assert not p.take_plan()  # the next step starts empty
    p.schedule_cached("r", [9], False, 600, 1)  # decoding: nothing more to save
    assert not p.take_plan()


def test_chunked_prefill_saves_each_chunk_when_it_is_complete() -> None:
    store, prompt = FakeStore(), tokens(600)
    p = planner(store)
    p.match("r", prompt, 0)
    p.allocated("r", 0)
    p.schedule_new("r", prompt, [1, 2], 0, 200)
    assert not p.take_plan()
    p.schedule_cached("r", [3], False, 200, 200)
    (save,) = p.take_plan().saves
    assert save.parent is None and [c.block_ids for c in save.chunks] == [(1, 2)]
    p.schedule_cached("r", [4, 5], False, 400, 200)
    (save,) = p.take_plan().saves
    keys = chunk_keys(prompt, LAYOUT, CHUNK)
    assert save.parent == (keys[0],) and [c.keys for c in save.chunks] == [(keys[1],)]
    assert [c.block_ids for c in save.chunks] == [(3, 4)]


def test_stored_chunks_are_loaded_not_saved() -> None:
    store, prompt = FakeStore(), tokens(600)
    store.hold(prompt, 2, "disk")
    p = planner(store)
    assert p.match("r", prompt, 0) == 512
    p.allocated("r", 512)
    assert p.sources("r", 512) == {"disk": 512}
    p.schedule_new("r", prompt, [1, 2, 3, 4, 5], 512, 88)
    plan = p.take_plan()
    assert plan.saves == []
    (load,) = plan.loads
    assert load.req_id == "r" and load.block_ids() == [1, 2, 3, 4]
    assert [c.first_block for c in load.chunks] == [0, 0]


def test_a_partly_stored_prompt_loads_the_stored_prefix_and_saves_the_rest() -> None:
    store, prompt = FakeStore(), tokens(800)
    store.hold(prompt, 1)
    p = planner(store)
    assert p.match("r", prompt, 0) == 256
    p.allocated("r", 256)
    p.schedule_new("r", prompt, list(range(10, 17)), 256, 544)
    plan = p.take_plan()
    assert plan.loads[0].block_ids() == [10, 11]
    (save,) = plan.saves
    keys = chunk_keys(prompt, LAYOUT, CHUNK)
    assert save.parent == (keys[0],) and [c.keys[0] for c in save.chunks] == keys[1:3]


def test_a_local_hit_inside_a_chunk_loads_the_rest_of_it() -> None:
    store, prompt = FakeStore(), tokens(600)
    store.hold(prompt, 2, "memory")
    p = planner(store)
    assert p.match("r", prompt, 128) == 384
    assert store.lookups[-1] == chunk_keys(prompt, LAYOUT, CHUNK)  # from chunk 0, which holds token 128
    p.allocated("r", 384)
    assert p.sources("r", 384) == {"memory": 384}
    p.schedule_new("r", prompt, [1, 2, 3, 4, 5], 512, 88)
    (load,) = p.take_plan().loads
    assert [(c.first_block, c.block_ids) for c in load.chunks] == [(1, (2,)), (0, (3, 4))]


def test_a_local_hit_of_whole_chunks_looks_up_only_the_chunks_after_it() -> None:
    store, prompt = FakeStore(), tokens(800)
    keys = chunk_keys(prompt, LAYOUT, CHUNK)
    store.tiers[keys[1]] = "memory"  # chunk 0 evicted from the store, still in the engine
    p = planner(store)
    assert p.match("r", prompt, 256) == 256
    assert store.lookups[-1] == keys[1:]
    p.allocated("r", 256)
    p.schedule_new("r", prompt, list(range(7)), 512, 288)
    plan = p.take_plan()
    assert plan.loads[0].block_ids() == [2, 3]
    assert [c.keys[0] for c in plan.saves[0].chunks] == [keys[2]]  # chunk 0 (a local hit) is not saved


def test_tiers_split_the_hit_by_tokens() -> None:
    store, prompt = FakeStore(), tokens(900)
    store.hold(prompt, 1, "memory")
    store.tiers[chunk_keys(prompt, LAYOUT, CHUNK)[1]] = "disk"
    store.tiers[chunk_keys(prompt, LAYOUT, CHUNK)[2]] = "redis"
    p = planner(store)
    assert p.match("r", prompt, 128) == 640
    assert p.sources("r", 640) == {"memory": 128, "disk": 256, "redis": 256}
    assert p.sources("r", 0) == {} and p.sources("other", 10) == {}


def test_short_prompts_and_ineligible_requests_touch_nothing() -> None:
    store = FakeStore()
    p = planner(store)
    assert p.match("short", tokens(200), 0) == 0
    assert store.lookups == []
    p.allocated("short", 0)
    p.schedule_new("short", tokens(200), [1, 2], 0, 200)
    assert not p.take_plan()
    assert p.match("lora", None, 0) == 0  # multimodal, LoRA or a cache salt
    p.schedule_new("lora", tokens(600), list(range(5)), 0, 600)
    assert not p.take_plan()
    for r in ("short", "lora"):
        p.finished(r)
    assert p.num_tracked == 0


def test_load_and_save_switches() -> None:
    store, prompt = FakeStore(), tokens(600)
    store.hold(prompt, 1)
    no_load = planner(store, load=False)
    assert no_load.match("r", prompt, 0) == 0 and store.lookups == []
    no_load.allocated("r", 0)
    no_load.schedule_new("r", prompt, list(range(5)), 0, 600)
    assert len(no_load.take_plan().saves[0].chunks) == 2  # it does not know chunk 0 is stored
    no_save = planner(store, save=False)
    assert no_save.match("r", prompt, 0) == 256
    no_save.allocated("r", 256)
    no_save.schedule_new("r", prompt, list(range(5)), 256, 344)
    plan = no_save.take_plan()
    assert plan.saves == [] and len(plan.loads) == 1


def test_a_disabled_planner_looks_nothing_up_and_plans_nothing() -> None:
    store, prompt = FakeStore(), tokens(600)
    store.hold(prompt, 2)
    p = planner(store)
    p.disable("layout refused")
    assert p.match("r", prompt, 0) == 0 and store.lookups == []
    p.schedule_new("r", prompt, list(range(5)), 0, 600)
    assert not p.take_plan() and p.num_tracked == 0


def test_repeated_matches_while_waiting_reuse_the_keys() -> None:
    store, prompt = FakeStore(), tokens(600)
    calls = []

    def keys_for(token_ids: Sequence[int]) -> list[tuple[ChunkKey, ...]]:
        calls.append(len(token_ids))
        return keys_by_rank([LAYOUT], CHUNK)(token_ids)

    p = ChunkPlanner(chunk_size=CHUNK, block_size=BLOCK, keys_for=keys_for, locate=store.locate)
    for _ in range(3):
        assert p.match("r", prompt, 0) == 0
    assert calls == [600] and len(store.lookups) == 3  # the lookup is asked again: the store may change


def test_a_resumed_request_loads_into_its_new_blocks() -> None:
    store, prompt = FakeStore(), tokens(600)
    p = planner(store)
    p.match("r", prompt, 0)
    p.allocated("r", 0)
    p.schedule_new("r", prompt, list(range(5)), 0, 600)
    assert len(p.take_plan().saves) == 1
    store.hold(prompt, 2)
    # preempted, its blocks freed; asked again from scratch
    assert p.match("r", prompt, 0) == 512
    p.allocated("r", 512)
    p.schedule_cached("r", [20, 21, 22, 23, 24], True, 512, 89)
    plan = p.take_plan()
    assert plan.loads[0].block_ids() == [20, 21, 22, 23] and plan.saves == []


def test_a_resumed_request_saves_again_what_the_preemption_cancelled() -> None:
    store, prompt = FakeStore(), tokens(600)
    p = planner(store)
    p.match("r", prompt, 0)
    p.allocated("r", 0)
    p.schedule_new("r", prompt, list(range(5)), 0, 600)
    assert len(p.take_plan().saves[0].chunks) == 2
    p.preempted(["r"])  # its save was still queued: the workers drop it
    assert p.take_plan().preempted == ["r"]
    assert p.match("r", prompt, 0) == 0  # nothing reached the store
    p.allocated("r", 0)
    p.schedule_cached("r", [20, 21, 22, 23, 24], True, 0, 600)
    (save,) = p.take_plan().saves
    assert [c.block_ids for c in save.chunks] == [(20, 21), (22, 23)]


def test_a_load_ending_inside_a_block_copies_that_block_whole() -> None:
    store, prompt = FakeStore(), tokens(512)
    store.hold(prompt, 2)
    p = planner(store)
    assert p.match("r", prompt, 0) == 511  # the whole prompt stored: vLLM computes only the last token
    p.allocated("r", 511)
    p.schedule_new("r", prompt, list(range(4)), 511, 1)
    plan = p.take_plan()
    assert plan.failed_block_ids == []
    ((first, second),) = [load.chunks for load in plan.loads]
    assert (first.block_ids, second.block_ids) == ((0, 1), (2, 3))  # block 3 whole; vLLM rewrites slot 511


def test_a_load_vllm_cannot_place_is_reported_as_failed_blocks() -> None:
    store, prompt = FakeStore(), tokens(600)
    store.hold(prompt, 2)
    p = planner(store)
    assert p.match("r", prompt, 0) == 512
    p.allocated("r", 512)
    p.schedule_new("r", prompt, [0, 1, 2], 512, 88)  # fewer blocks than the load needs
    plan = p.take_plan()
    assert plan.loads == [] and plan.failed_block_ids == [0, 1, 2]


def test_chunk_size_must_be_whole_blocks_for_the_planner() -> None:
    with pytest.raises(ValueError, match="not a multiple of block size"):
        ChunkPlanner(chunk_size=200, block_size=BLOCK, keys_for=lambda t: [], locate=lambda k: [])


# -- blocks that asynchronous saves read (the scheduler half's side)


def saved_once(p: ChunkPlanner, req_id: str, seed: int) -> list[int]:
    prompt = tokens(600, seed)
    p.match(req_id, prompt, 0)
    p.allocated(req_id, 0)
    p.schedule_new(req_id, prompt, list(range(5)), 0, 600)
    return prompt


def test_finished_keeps_the_blocks_until_every_worker_acknowledged_the_saves() -> None:
    p = planner(FakeStore(), workers=2)
    saved_once(p, "r", 1)
    saved_once(p, "s", 2)
    assert len(p.take_plan().saves) == 2
    p.acknowledged({"s": 1})  # one of two workers
    assert p.finished("s") is True  # vLLM keeps the blocks ...
    assert p.take_plan().held == ["s"]  # ... and the workers learn it with the next plan
    p.acknowledged({"r": 2, "s": 1})  # late for s: the workers report it themselves
    assert p.finished("r") is False  # both workers done: freed at once
    assert not p.take_plan()
    assert p.num_tracked == 0
    assert (p.num_held, p.num_finished) == (1, 2)


def test_a_request_with_nothing_to_save_is_freed_at_once() -> None:
    store = FakeStore()
    stored = tokens(600, 3)
    store.hold(stored, 2)
    p = planner(store)
    p.match("short", tokens(200), 0)
    p.schedule_new("short", tokens(200), [1, 2], 0, 200)
    assert p.match("stored", stored, 0) == 512
    p.allocated("stored", 512)
    p.schedule_new("stored", stored, list(range(5)), 512, 88)
    assert p.take_plan().saves == []
    assert p.finished("short") is False and p.finished("stored") is False
    assert p.finished("never-seen") is False
    assert not p.take_plan()


def test_preempted_requests_are_listed_only_with_saves_in_flight() -> None:
    p = planner(FakeStore())
    saved_once(p, "r", 1)
    saved_once(p, "s", 2)
    p.take_plan()
    p.acknowledged({"s": 1})
    p.preempted({"r", "s", "other"})
    assert p.take_plan().preempted == ["r"]


def test_a_disabled_planner_still_tracks_the_saves_it_planned() -> None:
    p = planner(FakeStore())
    saved_once(p, "r", 1)
    p.take_plan()
    p.disable("a worker refused the layout")
    assert p.finished("r") is True and p.take_plan().held == ["r"]


def test_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1"):
        ChunkPlanner(
            chunk_size=CHUNK, block_size=BLOCK, keys_for=lambda t: [], locate=lambda k: [], workers=0
        )


# -- partial tails


class TailStore(FakeStore):
    """`FakeStore` that also keeps the partial tails the planner saves, offered after their parent."""

    def __init__(self) -> None:
        super().__init__()
        self.tails: dict[bytes | None, dict[int, bytes]] = {}
        self.parents: list[bytes | None] = []

    def locate_tails(
        self, keys: Sequence[ChunkKey], parent: ChunkKey | None
    ) -> tuple[list[str], list[StoredTail]]:
        found = self.locate(keys)
        self.parents.append(parent)
        after = keys[len(found) - 1] if found else parent
        offers = self.tails.get(after, {})
        return found, [StoredTail(n, key, self.tiers.get(key, "memory")) for n, key in offers.items()]

    def keep(self, save: RequestSave) -> None:
        """Store what a save job sends, as the cache server does (rank 0's keys)."""
        parent = None if save.parent is None else save.parent[0]
        for chunk in save.chunks:
            self.tiers[chunk.keys[0]] = "memory"
            if len(chunk.token_ids) < CHUNK:
                self.tails.setdefault(parent, {})[len(chunk.token_ids)] = chunk.keys[0]
            parent = chunk.keys[0]


def tail_planner(store: TailStore, layouts: Sequence[KVLayout] = (LAYOUT,)) -> ChunkPlanner:
    return ChunkPlanner(
        CHUNK,
        BLOCK,
        keys_by_rank(layouts, CHUNK),
        store.locate,
        tail_keys_for=tail_keys_by_rank(layouts, CHUNK),
        locate_tails=store.locate_tails,
        workers=len(layouts),
    )


def run_prompt(p: ChunkPlanner, store: TailStore, req: str, prompt: list[int], blocks: list[int]) -> int:
    """One request computed in one step (its lookup, load and saves); the tokens it matched."""
    matched = p.match(req, prompt, 0)
    p.allocated(req, matched)
    p.schedule_new(req, prompt, blocks, matched, len(prompt) - matched)
    for save in p.take_plan().saves:
        store.keep(save)
    return matched


def test_tail_keys_by_rank_are_each_ranks_partial_tail_key() -> None:
    layouts = [kv_layout("tiny", TINY, block_layout=CPU, tp_rank=r, tp_size=2) for r in range(2)]
    prompt = tokens(600)
    full = keys_by_rank(layouts, CHUNK)(prompt)
    tail = tail_keys_by_rank(layouts, CHUNK)(prompt[512:], full[-1])
    for rank in range(2):
        assert tail[rank] == chunk_keys(prompt, layouts[rank], CHUNK, include_partial=True)[-1]
    assert tail[0] != tail[1]
    assert (
        tail_keys_by_rank(layouts, CHUNK)(prompt[:88], None)[0]
        == chunk_keys(prompt[:88], layouts[0], CHUNK, include_partial=True)[0]
    )
    for bad in ([], prompt[:CHUNK]):
        with pytest.raises(ValueError, match="partial tail"):
            tail_keys_by_rank(layouts, CHUNK)(bad, None)


def test_a_computed_prompt_saves_its_tail_after_its_last_full_chunk() -> None:
    store, prompt = TailStore(), tokens(600)
    p = tail_planner(store)
    assert p.match("r", prompt, 0) == 0
    p.allocated("r", 0)
    p.schedule_new("r", prompt, [4, 5, 6, 7, 8], 0, 600)
    (save,) = p.take_plan().saves
    *full, tail = chunk_keys(prompt, LAYOUT, CHUNK, include_partial=True)
    assert save.parent is None and [c.keys for c in save.chunks] == [(full[0],), (full[1],), (tail,)]
    assert save.chunks[-1].token_ids == tuple(prompt[512:]) and save.chunks[-1].block_ids == (8,)
    assert p.num_tail_saves == 1
    p.schedule_cached("r", [9], False, 600, 1)  # decoding: the tail is not saved again
    assert not p.take_plan()


def test_chunked_prefill_saves_the_tail_once_the_whole_prompt_is_computed() -> None:
    store, prompt = TailStore(), tokens(600)
    p = tail_planner(store)
    p.match("r", prompt, 0)
    p.allocated("r", 0)
    p.schedule_new("r", prompt, [1, 2, 3, 4], 0, 512)
    (save,) = p.take_plan().saves
    assert len(save.chunks) == 2  # the full chunks; the tail's tokens are not computed yet
    p.schedule_cached("r", [5], False, 512, 88)
    (save,) = p.take_plan().saves
    keys = chunk_keys(prompt, LAYOUT, CHUNK, include_partial=True)
    assert save.parent == (keys[1],) and [c.keys for c in save.chunks] == [(keys[2],)]
    assert save.chunks[0].block_ids == (5,)


def test_the_next_round_loads_the_stored_tail_past_the_last_full_chunk() -> None:
    store, round1 = TailStore(), tokens(600)
    p = tail_planner(store)
    assert run_prompt(p, store, "r1", round1, [4, 5, 6, 7, 8]) == 0
    round2 = round1 + tokens(100, seed=2)  # chunk 2 now holds round 1's tail and more
    assert p.match("r2", round2, 0) == 600
    assert store.parents[-1] is None  # looked up from the prompt's start
    p.allocated("r2", 600)
    assert p.sources("r2", 600) == {"memory": 600}
    p.schedule_new("r2", round2, [10, 11, 12, 13, 14, 15], 600, 100)
    plan = p.take_plan()
    (load,) = plan.loads
    (_, tail) = chunk_keys(round1, LAYOUT, CHUNK, include_partial=True)[1:]
    assert [(c.keys, c.block_ids, c.blocks) for c in load.chunks][-1] == ((tail,), (14,), 1)
    assert load.block_ids() == [10, 11, 12, 13, 14]
    assert (p.num_tail_loads, p.num_tail_tokens) == (1, 88)
    # round 2 saves its own tail (round 1's inside it) after the same two chunks
    (save,) = plan.saves
    assert [len(c.token_ids) for c in save.chunks] == [188] and save.parent == (load.chunks[1].keys[0],)


def test_a_tail_is_capped_before_the_prompts_last_token_and_the_longest_fitting_wins() -> None:
    store, round1 = TailStore(), tokens(600)
    p = tail_planner(store)
    run_prompt(p, store, "r1", round1, [4, 5, 6, 7, 8])
    run_prompt(p, store, "r0", round1[:552], [4, 5, 6, 7, 8])  # a 40-token tail after the same chunks
    assert set(store.tails[chunk_keys(round1, LAYOUT, CHUNK)[1]]) == {88, 40}
    assert p.match("same", round1, 0) == 552  # 88 would reach the last token: the 40-token tail
    assert p.match("longer", [*round1, 7], 0) == 600  # 88 fits before the last token
    assert p.match("short", round1[:553], 0) == 552  # exactly up to the last token
    assert p.match("shorter", round1[:552], 0) == 512


def test_the_tails_tokens_count_under_its_own_tier() -> None:
    store, round1 = TailStore(), tokens(600)
    p = tail_planner(store)
    run_prompt(p, store, "r1", round1, [4, 5, 6, 7, 8])
    store.tiers[chunk_keys(round1, LAYOUT, CHUNK, include_partial=True)[-1]] = "disk"
    assert p.match("r2", [*round1, 1], 128) == 472
    assert p.sources("r2", 472) == {"memory": 384, "disk": 88}


def test_a_tail_whose_key_differs_is_not_loaded() -> None:
    store, round1 = TailStore(), tokens(600)
    p = tail_planner(store)
    run_prompt(p, store, "r1", round1, [4, 5, 6, 7, 8])
    other = round1[:512] + tokens(88, seed=9) + tokens(50, seed=3)  # same chunks, another tail
    assert p.match("r2", other, 0) == 512
    store.tails[chunk_keys(round1, LAYOUT, CHUNK)[1]][88] = b"\0" * 32  # a key the planner never computes
    assert p.match("r3", [*round1, 1], 0) == 512


def test_a_local_hit_of_every_full_chunk_still_finds_the_tail() -> None:
    store, round1 = TailStore(), tokens(600)
    p = tail_planner(store)
    run_prompt(p, store, "r1", round1, [4, 5, 6, 7, 8])
    round2 = round1 + [5] * 20  # still two full chunks, both a local hit
    assert p.match("r2", round2, 512) == 88
    assert store.lookups[-1] == [] and store.parents[-1] == chunk_keys(round1, LAYOUT, CHUNK)[1]
    p.allocated("r2", 88)
    p.schedule_new("r2", round2, [4, 5, 6, 7, 9], 600, 20)
    (load,) = p.take_plan().loads
    assert [(c.first_block, c.block_ids, c.blocks) for c in load.chunks] == [(0, (9,), 1)]


def test_tensor_parallel_ranks_load_and_save_their_own_tail_keys() -> None:
    layouts = [kv_layout("tiny", TINY, block_layout=CPU, tp_rank=r, tp_size=2) for r in range(2)]
    store, round1 = TailStore(), tokens(600)
    p = tail_planner(store, layouts)
    run_prompt(p, store, "r1", round1, [4, 5, 6, 7, 8])
    tails = tuple(chunk_keys(round1, layout, CHUNK, include_partial=True)[-1] for layout in layouts)
    assert store.tails[chunk_keys(round1, layouts[0], CHUNK)[1]] == {88: tails[0]}
    assert p.match("r2", round1 + [3] * 30, 0) == 600
    p.allocated("r2", 600)
    p.schedule_new("r2", round1 + [3] * 30, list(range(10, 16)), 600, 30)
    (load,) = p.take_plan().loads
    assert load.chunks[-1].keys == tails


def test_without_the_tail_lookup_only_full_chunks_are_saved_and_loaded() -> None:
    store, round1 = TailStore(), tokens(600)
    p = planner(store)  # no tail keys, no tail lookup: the off switch
    assert not p.tails
    p.match("r1", round1, 0)
    p.allocated("r1", 0)
    p.schedule_new("r1", round1, [4, 5, 6, 7, 8], 0, 600)
    (save,) = p.take_plan().saves
    assert [len(c.token_ids) for c in save.chunks] == [CHUNK, CHUNK]


def test_handed_off_and_stored_end_count_full_chunks_only() -> None:
    store, round1 = TailStore(), tokens(600)
    p = tail_planner(store)
    run_prompt(p, store, "r1", round1, [4, 5, 6, 7, 8])
    assert p.handed_off("r1") == (512, chunk_keys(round1, LAYOUT, CHUNK)[1])
    assert p.match("r2", [*round1, 1], 0) == 600
    assert p.stored_end("r2") == 512


def test_a_resumed_request_loads_its_tail_again_and_saves_its_own_again() -> None:
    store, round1 = TailStore(), tokens(600)
    p = tail_planner(store)
    run_prompt(p, store, "r1", round1, [4, 5, 6, 7, 8])
    round2 = round1 + [2] * 30
    p.match("r2", round2, 0)
    p.allocated("r2", 600)
    p.schedule_new("r2", round2, [10, 11, 12, 13, 14, 15], 600, 30)
    first = p.take_plan()
    assert first.loads and first.saves
    p.preempted(["r2"])
    p.match("r2", round2, 0)
    p.allocated("r2", 600)
    p.schedule_cached("r2", [20, 21, 22, 23, 24, 25], True, 600, 30)
    again = p.take_plan()
    (load,) = again.loads
    assert load.chunks[-1].block_ids == (24,) and load.chunks[-1].blocks == 1
    (save,) = again.saves
    assert len(save.chunks[-1].token_ids) == 630 - 512
