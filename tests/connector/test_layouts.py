"""KV cache layouts: which ones the connector detects from tensor shapes, that it moves blocks of each of
them bit for bit through a real cache server, that their key namespaces never meet, and that the halves
agree on the namespace (or the connector turns itself off).

The copies run with torch in the vLLM environment (CPU tensors shaped like the GPU layouts; the device
path's staging is run with CPU tensors too, its device events cannot be), against a ``kvstack
cache-server`` process."""

from __future__ import annotations

import itertools
import os
import subprocess
import textwrap
from collections.abc import Callable

import pytest

from kvstack.cache.keys import chunk_keys
from kvstack.connector import PAGED_LAYOUT, AttentionShape, block_layout_name, detect_layout, kv_layout
from support.cache import CacheServerProcess
from support.engines import REPO, vllm_python

ATTN = AttentionShape(num_layers=3, num_kv_heads=2, head_size=16, dtype="bfloat16", block_size=32)
SPLIT_KV = [
    "[2,blocks,block,kv_heads,head]",
    "[2,blocks,kv_heads,block,head]",
    "[blocks,2,block,kv_heads,head]",
    "[blocks,2,kv_heads,block,head]",
]


# -- detection (no torch)


@pytest.mark.parametrize(
    ("shape", "name", "block_dim"),
    [
        ((64, 2, 32, 32), PAGED_LAYOUT, 0),
        ((2, 64, 32, 2, 16), SPLIT_KV[0], 1),
        ((2, 64, 2, 32, 16), SPLIT_KV[1], 1),
        ((64, 2, 32, 2, 16), SPLIT_KV[2], 0),
        ((64, 2, 2, 32, 16), SPLIT_KV[3], 0),
    ],
)
def test_supported_layouts_are_named_with_their_block_dimension(
    shape: tuple[int, ...], name: str, block_dim: int
) -> None:
    verdict = detect_layout(shape, ATTN)
    assert (verdict.name, verdict.supported, verdict.block_dim, verdict.reason) == (name, True, block_dim, "")


@pytest.mark.parametrize(
    ("shape", "name", "says"),
    [
        ((64, 32, 576), "[blocks,block,latent]", "MLA latent KV cache is not supported"),
        ((64, 2, 32, 16), "unknown", "unknown KV cache shape (64, 2, 32, 16)"),  # K only?
        ((64, 4, 32, 32), "unknown", "for 2 KV heads"),  # another head count
        ((256, 2, 8, 32), "unknown", "kernel blocks"),  # blocks split into kernel blocks of 8
        ((2, 64, 32, 2, 8), "unknown", "head size 16"),
        ((2, 2, 32, 2, 16), "unknown", "ambiguous"),  # K/V first, or 2 blocks first?
    ],
)
def test_other_shapes_are_refused_with_the_reason(shape: tuple[int, ...], name: str, says: str) -> None:
    verdict = detect_layout(shape, ATTN)
    assert (verdict.name, verdict.supported) == (name, False)
    assert says in verdict.reason


def test_equal_heads_and_block_size_name_the_block_major_order() -> None:
    square = AttentionShape(num_layers=2, num_kv_heads=16, head_size=64, dtype="float16", block_size=16)
    assert detect_layout((2, 100, 16, 16, 64), square).name == SPLIT_KV[0]
    assert detect_layout((100, 2, 16, 16, 64), square).name == SPLIT_KV[2]


# -- the key namespace (no torch)


def test_the_namespace_names_platform_backend_layout_and_block_size() -> None:
    assert (
        block_layout_name(PAGED_LAYOUT, platform="cpu", backend="CPU_ATTN", block_size=128)
        == "vllm-cpu/CPU_ATTN:[blocks,kv_heads,block=128,2*head]"
    )
    assert (
        block_layout_name(SPLIT_KV[1], platform="cuda", backend="FLASH_ATTN", block_size=16)
        == "vllm-cuda/FLASH_ATTN:[2,blocks,kv_heads,block=16,head]"
    )
    names = [
        block_layout_name(layout, platform=platform, backend=backend, block_size=block)
        for layout, platform, backend, block in itertools.product(
            [PAGED_LAYOUT, *SPLIT_KV], ["cpu", "cuda"], ["CPU_ATTN", "FLASH_ATTN", "FLASHINFER"], [16, 32]
        )
    ]
    assert len(set(names)) == len(names)
    prompt = list(range(3, 3 + 4 * 64))
    keys = [
        set(chunk_keys(prompt, kv_layout("m", ATTN, block_layout=n, tp_rank=0, tp_size=1), 64)) for n in names
    ]
    assert all(len(k) == 4 for k in keys)
    assert len(set().union(*keys)) == 4 * len(names)  # no two namespaces share a key


# -- moving blocks (torch, a real cache server)


MOVER_SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    import torch
    from kvstack.cache.client import CacheClient
    from kvstack.cache.keys import chunk_keys
    from kvstack.connector import AttentionShape, block_layout_name, detect_layout, kv_layout
    from kvstack.connector.plan import RequestLoad, RequestSave, plan_load, plan_save
    from kvstack.connector.saves import SaveQueue
    from kvstack.connector.worker import BlockMover

    endpoint, name, strided, device_path = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
    ATTN = AttentionShape(num_layers=3, num_kv_heads=2, head_size=16, dtype="bfloat16", block_size=32)
    B, H, N, D = 32, 2, 32, 16
    SHAPES = {
        "[blocks,kv_heads,block,2*head]": (B, H, N, 2 * D),
        "[2,blocks,block,kv_heads,head]": (2, B, N, H, D),
        "[2,blocks,kv_heads,block,head]": (2, B, H, N, D),
        "[blocks,2,block,kv_heads,head]": (B, 2, N, H, D),
        "[blocks,2,kv_heads,block,head]": (B, 2, H, N, D),
    }
    shape = SHAPES[name]

    def cache(seed):
        # Random bits, every bfloat16 pattern (NaNs too): compared as int16, bit for bit.
        g = torch.Generator().manual_seed(seed)
        if strided:  # the physical order [blocks, block, kv_heads, 2*head] (vLLM's LBNHC), viewed logically
            t = torch.randint(-(2**15), 2**15, (B, N, H, 2 * D), dtype=torch.int16, generator=g)
            t = t.view(torch.bfloat16).permute(0, 2, 1, 3)
            assert t.shape == shape and not t.is_contiguous()
            return t
        return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)

    verdict = detect_layout(shape, ATTN)
    assert verdict.supported and verdict.name == name, verdict

    def block(t, b):
        # Block b as the payload holds it: for [2, blocks, ...], its K half then its V half.
        return (t[:, b] if verdict.block_dim else t[b]).view(torch.int16)

    def mover(layers, client, save_client=None):
        m = BlockMover(
            layers,
            blocks_per_chunk=2,
            rank=0,
            client=client,
            save_client=save_client,
            block_dim=verdict.block_dim,
        )
        if device_path:  # the staging a device cache takes, run on CPU tensors
            m._on_host = False
        return m

    bl = block_layout_name(name, platform="cpu", backend="TEST", block_size=32)
    layout = kv_layout(f"layouts-{strided}-{device_path}", ATTN, block_layout=bl, tp_rank=0, tp_size=1)
    tokens = list(range(1000, 1000 + 3 * 64 + 10))  # three chunks of 64 tokens (2 blocks) and a bit
    keys = [(k,) for k in chunk_keys(tokens, layout, 64)]
    flat = [k[0] for k in keys]
    for shm in (True, False):
        client, save_client = CacheClient(endpoint, shm=shm), CacheClient(endpoint, shm=shm)
        client.evict(flat)
        layers = [cache(seed) for seed in range(3)]
        originals = [t.clone() for t in layers]
        a = mover(layers, client, save_client)
        assert a.chunk_shape == (3, 2, *block(layers[0], 0).shape), a.chunk_shape
        # Blocks 3-8 hold the prompt: chunk 0 saved at once, chunks 1-2 by the save thread (gathered into
        # arena regions, then sent), as the connector's asynchronous saves do.
        saves = plan_save(keys, tokens, 0, 3, chunk_size=64, block_size=32, block_ids=[3, 4, 5, 6, 7, 8])
        assert a.save(RequestSave("r", None, saves[:1]))
        queue = SaveQueue(a.gather, a.send, capacity=4)
        ready = None if device_path else a.written()  # no device here: its event cannot be recorded
        assert ready is None
        assert queue.submit(RequestSave("r", keys[0], saves[1:]), ready)
        assert queue.close(10) and (queue.stats.saved, queue.stats.failed) == (1, 0), queue.stats
        for t, o in zip(layers, originals):
            assert torch.equal(t.view(torch.int16), o.view(torch.int16)), "a save never writes"

        # The payload: [layers, blocks_per_chunk, *block] of the block-first view.
        with client.get(flat) as got:
            assert len(got) == 3
            for c, payload in enumerate(got):
                chunk = torch.frombuffer(bytearray(payload), dtype=torch.int16).view(a.chunk_shape)
                for l, t in enumerate(layers):
                    for j in range(2):
                        assert torch.equal(chunk[l, j], block(t, 3 + 2 * c + j)), (c, l, j)

        # Engine B: fresh caches, a local prefix hit of one block; the rest loads into blocks 10-14.
        fresh = [cache(seed) for seed in range(100, 103)]
        before = [t.clone() for t in fresh]
        b = mover(fresh, client)
        loads = plan_load(keys, 32, 192, chunk_size=64, block_size=32, block_ids=[9, 10, 11, 12, 13, 14])
        assert b.load(RequestLoad("r", loads)) == (3, [])
        moved = dict(zip([10, 11, 12, 13, 14], [4, 5, 6, 7, 8]))
        for l in range(3):
            for dst in range(B):
                want = block(layers[l], moved[dst]) if dst in moved else block(before[l], dst)
                assert torch.equal(block(fresh[l], dst), want), (l, dst, dst in moved)

        # A load ending inside a block (the prompt's last token) copies that block whole.
        loads = plan_load(keys, 0, 191, chunk_size=64, block_size=32, block_ids=[20, 21, 22, 23, 24, 25])
        assert b.load(RequestLoad("p", loads)) == (3, [])
        for l in range(3):
            for src, dst in zip(range(3, 9), range(20, 26)):
                assert torch.equal(block(fresh[l], dst), block(layers[l], src)), (l, dst)

        # The prompt's partial tail (10 tokens, one block): saved after the last chunk, loaded after chunk 2.
        (tail,) = chunk_keys(tokens[192:], layout, 64, include_partial=True, parent=flat[2])
        assert chunk_keys(tokens, layout, 64, include_partial=True)[-1] == tail
        with_tail = plan_save(
            keys, tokens, 2, 3, chunk_size=64, block_size=32, block_ids=[3, 4, 5, 6, 7, 8, 9], tail=(tail,)
        )
        assert with_tail[-1].block_ids == (9,) and with_tail[-1].token_ids == tuple(tokens[192:])
        assert a.save(RequestSave("r", keys[1], with_tail))
        with client.get([tail]) as got:
            assert [len(p) for p in got] == [a.chunk_bytes // 2]  # one block of two
        loads = plan_load(
            keys[:3], 128, 202, chunk_size=64, block_size=32, block_ids=list(range(15, 22)), tail=(tail,)
        )
        assert [(c.blocks, c.block_ids) for c in loads] == [(None, (19, 20)), (1, (21,))]
        assert b.load(RequestLoad("t", loads)) == (2, [])
        for l in range(3):
            for src, dst in ((7, 19), (8, 20), (9, 21)):
                assert torch.equal(block(fresh[l], dst), block(layers[l], src)), (l, dst)
        client.evict([tail])
        assert b.load(RequestLoad("t", loads)) == (1, [21])  # a lost tail: its block recomputed

        # A lost chunk: the chunks before it load, it and every later block are reported failed.
        loads = plan_load(keys, 0, 192, chunk_size=64, block_size=32, block_ids=[26, 27, 28, 29, 30, 31])
        client.evict([flat[1]])
        assert b.load(RequestLoad("q", loads)) == (1, [28, 29, 30, 31])
        assert torch.equal(block(fresh[0], 27), block(layers[0], 4))
        assert torch.equal(block(fresh[0], 28), block(before[0], 28)), "a failed block is left alone"
        # A chunk of the wrong size: the same, and it is evicted.
        assert client.put([flat[1]], [b"x" * 100], parent=flat[0])
        assert b.load(RequestLoad("q", loads)) == (1, [28, 29, 30, 31])
        assert client.exists([flat[1]]) == [False]
        # Nothing stored: every block failed, nothing raised.
        client.evict(flat)
        assert b.load(RequestLoad("q", loads)) == (0, [26, 27, 28, 29, 30, 31])
        assert client.stats.shm_bytes > 0 if shm else client.stats.shm_bytes == 0
        client.close()
        save_client.close()
    print("OK")
    """
)


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("layout", "strided", "device_path"),
    [
        (PAGED_LAYOUT, False, False),
        (PAGED_LAYOUT, True, False),  # vLLM's LBNHC physical order behind the same logical view
        *[(name, False, False) for name in SPLIT_KV],
        (PAGED_LAYOUT, True, True),
        (SPLIT_KV[0], False, True),
        (SPLIT_KV[3], False, True),
    ],
)
def test_blocks_of_every_layout_round_trip_bit_for_bit(
    cache_server: CacheServerProcess, layout: str, strided: bool, device_path: bool
) -> None:
    """Saved (at once and by the save thread) and loaded into fresh caches, through shared memory and the
    socket: the payload is the block-first view, the loaded blocks equal the saved ones bit for bit,
    other blocks are untouched; lost and malformed chunks are failed loads."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    flags = [str(int(strided)), str(int(device_path))]
    run = subprocess.run(
        [str(vllm_python()), "-c", MOVER_SCRIPT, cache_server.endpoint, layout, *flags],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]


# -- the halves agree on the namespace (the vLLM adapter built by hand)


NAMESPACE_SCRIPT = """
from kvstack.cache.client import CacheClient
from kvstack.cache.keys import chunk_keys
from kvstack.connector.plan import ChunkLoad, ChunkSave, RequestLoad, RequestSave, StepPlan
from kvstack.connector.vllm_v1 import KVStackConnectorMetadata

SPLIT = block_layout_name(
    "[2,blocks,block,kv_heads,head]", platform="cpu", backend="CPU_ATTN", block_size=128
)
r = request("r", 1)

def keys_of(block_layout):
    return chunk_keys(
        r.prompt_token_ids, kv_layout("hand-built", SHAPE, block_layout=block_layout, tp_rank=0, tp_size=1)
    )

split_keys, cpu_keys = keys_of(SPLIT), keys_of(CPU_LAYOUT)
with CacheClient(sys.argv[1]) as client:
    client.evict(split_keys + cpu_keys)
    assert client.put(split_keys, [b"x" * 10] * len(split_keys))  # the prompt's full chunks

# A worker with a K/V-outer cache reports that layout; the scheduler half keys chunks in its namespace.
scheduler, worker = connector(KVConnectorRole.SCHEDULER), connector(KVConnectorRole.WORKER)
assert scheduler.get_num_new_matched_tokens(r, 0) == (0, False)  # nothing keyed before the report
worker.register_kv_caches({name: torch.zeros(2, 16, 128, 2, 64, dtype=torch.bfloat16) for name in LAYERS})
report = worker.get_handshake_metadata()
assert (report.block_layout, report.problem) == (SPLIT, None), report
scheduler.set_xfer_handshake_metadata({0: report})
assert scheduler.get_num_new_matched_tokens(r, 0) == (512, False)
assert any(f"block_layout='{SPLIT}'" in line for line in LOG), LOG

# A worker whose KV cache contradicts the plan's namespace turns itself off: its loads fail (vLLM
# recomputes them), its saves are skipped, and it tells the scheduler half, which stops keying.
load = RequestLoad("r", (ChunkLoad((cpu_keys[0],), 0, (3, 4)),))
save = RequestSave("r", None, (ChunkSave((cpu_keys[1],), tuple(r.prompt_token_ids[256:512]), (5, 6)),))
plan = StepPlan(loads=[load], saves=[save], block_layout=CPU_LAYOUT)
worker.bind_connector_metadata(KVStackConnectorMetadata(plan))
worker.start_load_kv(None)
worker.wait_for_save()
assert worker.get_block_ids_with_load_errors() == {3, 4}
assert worker._saves.stats.skipped == 1 and worker._saves.stats.queued == 0
off = worker.build_connector_worker_meta()
assert f"keys chunks of KV cache layout '{CPU_LAYOUT}', this worker's is '{SPLIT}'" in off.disabled, off
assert off.saved == {"r": 1}  # the skipped save is acknowledged: vLLM may free its blocks
scheduler.update_connector_output(NS(kv_connector_worker_meta=off))
assert scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
worker.shutdown()

# Ranks that disagree, a rank missing, a rank that cannot move its cache: off, saying why.
for reports, says in [
    ({0: KVStackLayoutReport(SPLIT), 1: KVStackLayoutReport(CPU_LAYOUT)}, "KV cache layouts differ"),
    ({0: KVStackLayoutReport(SPLIT)}, "ranks [1] reported no KV cache layout"),
    ({0: KVStackLayoutReport(SPLIT), 1: KVStackLayoutReport(None, "nope")}, "rank 1: nope"),
]:
    two = connector(KVConnectorRole.SCHEDULER, tp_size=2)
    two.set_xfer_handshake_metadata(reports)
    assert two.get_num_new_matched_tokens(r, 0) == (0, False)
    assert any(says in line for line in LOG[-3:]), (says, LOG[-3:])

# Layers on two attention backends: no single namespace, the worker says so at start-up.
mixed = connector(KVConnectorRole.WORKER)
vllm_v1.layer_backends = lambda vllm_config, names: dict(zip(names, ["CPU_ATTN", "FLASH_ATTN"]))
mixed.register_kv_caches({name: torch.zeros(16, 2, 128, 128, dtype=torch.bfloat16) for name in LAYERS})
assert "backends ['CPU_ATTN', 'FLASH_ATTN']" in mixed.get_handshake_metadata().problem
print("OK")
"""


@pytest.mark.vllm
def test_the_workers_layout_is_the_namespace_and_a_contradiction_turns_the_connector_off(
    run_hand_built: Callable[[str], None],
) -> None:
    run_hand_built(NAMESPACE_SCRIPT)
