"""Chunk keys of the KV cache tier: stable across processes, namespaced by layout and TP rank, chained."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import textwrap
from array import array
from typing import Any

import numpy as np
import pytest

from kvstack.cache.keys import DEFAULT_CHUNK_SIZE as C
from kvstack.cache.keys import ChunkKey, KVLayout, chunk_keys, pack_token_ids

LAYOUT = KVLayout(
    model="tiny-llama",
    num_layers=2,
    num_kv_heads=4,
    head_size=64,
    dtype="bfloat16",
    block_layout="vllm-cpu:[blocks,kv_heads,block,2*head]",
    tp_rank=0,
    tp_size=2,
)


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(n)]


def test_one_key_per_full_chunk_32_bytes_and_chunk_size_configurable() -> None:
    tokens = _tokens(C * 3 + 100)
    keys = chunk_keys(tokens, LAYOUT)
    assert len(keys) == 3
    assert all(isinstance(k, ChunkKey) and len(k) == 32 for k in keys)
    assert len(set(keys)) == 3
    assert keys == chunk_keys(tokens[: C * 3], LAYOUT)
    assert chunk_keys(tokens[: C - 1], LAYOUT) == []
    assert chunk_keys([], LAYOUT, include_partial=True) == []
    assert len(chunk_keys(tokens, LAYOUT, chunk_size=64)) == len(tokens) // 64
    # A chunk size is part of the namespace: 2 chunks of C/2 never share a key with 1 chunk of C.
    assert not set(chunk_keys(tokens, LAYOUT, chunk_size=C // 2)) & set(keys)
    assert ChunkKey.from_hex(keys[0].hex()) == keys[0]
    assert str(keys[0]) == keys[0].hex() and len(str(keys[0])) == 64


def test_keys_are_pinned_values() -> None:
    # A silent change of the key scheme would orphan every stored chunk: pin a few values.
    layout = KVLayout("m", 1, 1, 8, "float16")
    keys = chunk_keys(list(range(10)), layout, chunk_size=4, include_partial=True)
    assert [k.hex()[:16] for k in keys] == ["0ac9d45bf37ab47d", "2e412b5af23d5675", "5b0ee4e3f7b41c55"]


def test_keys_stable_across_processes_and_hash_seeds() -> None:
    tokens = _tokens(1000, seed=7)
    # Each process computes the keys from three forms of the ids: a list, a packed array and numpy int64.
    script = textwrap.dedent(
        """
        import json, sys
        from array import array
        import numpy
        from kvstack.cache.keys import KVLayout, chunk_keys
        args = json.loads(sys.stdin.read())
        layout = KVLayout(**args["layout"])
        forms = [args["tokens"], array("I", args["tokens"]), numpy.array(args["tokens"], dtype=numpy.int64)]
        keys = [chunk_keys(ids, layout, chunk_size=128, include_partial=True) for ids in forms]
        assert keys[0] == keys[1] == keys[2], "input forms disagree"
        print(json.dumps([k.hex() for k in keys[0]]))
        """
    )
    stdin = json.dumps({"tokens": tokens, "layout": dataclasses.asdict(LAYOUT)})
    results = []
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script], input=stdin, capture_output=True, text=True, env=env, check=True
        )
        results.append(json.loads(out.stdout))
    here = [k.hex() for k in chunk_keys(tokens, LAYOUT, chunk_size=128, include_partial=True)]
    assert results == [here, here, here]


@pytest.mark.parametrize(
    "change",
    [
        {"model": "tiny-llama-2"},
        {"num_layers": 3},
        {"num_kv_heads": 8},
        {"head_size": 128},
        {"dtype": "float16"},
        {"block_layout": "cuda-flash:[2,blocks,block,kv_heads,head]"},
        {"tp_rank": 1},
        {"tp_size": 4},
    ],
    ids=lambda change: next(iter(change)),
)
def test_every_layout_field_changes_every_key(change: dict[str, Any]) -> None:
    tokens = _tokens(C * 4 + 10)
    other = dataclasses.replace(LAYOUT, **change)
    assert other.namespace() != LAYOUT.namespace()
    ours = chunk_keys(tokens, LAYOUT, include_partial=True)
    theirs = chunk_keys(tokens, other, include_partial=True)
    assert len(ours) == len(theirs) == 5
    assert not set(ours) & set(theirs)


def test_an_early_token_changes_every_later_key_and_no_earlier_one() -> None:
    tokens = _tokens(C * 5 + 3)
    base = chunk_keys(tokens, LAYOUT, include_partial=True)
    changed = list(tokens)
    changed[C + 17] += 1  # inside chunk 1
    keys = chunk_keys(changed, LAYOUT, include_partial=True)
    assert keys[0] == base[0]
    assert all(a != b for a, b in zip(keys[1:], base[1:], strict=True))


def test_same_chunk_tokens_after_different_prefixes_get_different_keys() -> None:
    shared = _tokens(C, seed=1)
    a = chunk_keys(_tokens(C, seed=2) + shared, LAYOUT)
    b = chunk_keys(_tokens(C, seed=3) + shared, LAYOUT)
    assert a[1] != b[1]


def test_partial_tail_only_when_enabled_and_never_equal_to_a_full_chunk() -> None:
    tokens = _tokens(C * 2 + 40)
    full = chunk_keys(tokens, LAYOUT)
    with_tail = chunk_keys(tokens, LAYOUT, include_partial=True)
    assert len(full) == 2 and len(with_tail) == 3 and with_tail[:2] == full
    # A tail of 64 tokens under chunk size C covers the same tokens as a full chunk of size 64: still
    # distinct keys, and tails of different lengths differ from each other.
    head = tokens[:64]
    assert chunk_keys(head, LAYOUT, include_partial=True) != chunk_keys(head, LAYOUT, chunk_size=64)
    tails = {chunk_keys(tokens[:n], LAYOUT, include_partial=True)[0] for n in range(1, C)}
    assert len(tails) == C - 1
    assert chunk_keys(tokens[:C], LAYOUT, include_partial=True) == chunk_keys(tokens[:C], LAYOUT)


def test_parent_continues_the_chain() -> None:
    tokens = _tokens(C * 4)
    keys = chunk_keys(tokens, LAYOUT)
    assert chunk_keys(tokens[2 * C :], LAYOUT, parent=keys[1]) == keys[2:]


def test_every_form_of_the_same_ids_gives_the_same_keys() -> None:
    tokens = _tokens(C * 3 + 50)
    expected = chunk_keys(tokens, LAYOUT, include_partial=True)
    forms = {
        "tuple": tuple(tokens),
        "array I": array("I", tokens),
        "array L": array("L", tokens),
        "array q": array("q", tokens),
        "numpy uint32": np.array(tokens, dtype=np.uint32),
        "numpy int64": np.array(tokens, dtype=np.int64),
        "numpy int32": np.array(tokens, dtype=np.int32),
        "numpy strided": np.array([tokens, tokens], dtype=np.uint32).T[:, 0],
        "packed bytes": memoryview(np.array(tokens, dtype="<u4").tobytes()).cast("I"),
        "pack_token_ids": pack_token_ids(tokens),
    }
    for name, ids in forms.items():
        assert chunk_keys(ids, LAYOUT, include_partial=True) == expected, name
        assert chunk_keys(ids, LAYOUT, chunk_size=64) == chunk_keys(tokens, LAYOUT, chunk_size=64), name
    # Small ids: bytes and uint8/uint16 buffers hold the same integers as the list.
    small = [t % 256 for t in tokens]
    want = chunk_keys(small, LAYOUT)
    for ids in (bytes(small), bytearray(small), array("H", small), np.array(small, dtype=np.uint8)):
        assert chunk_keys(ids, LAYOUT) == want, type(ids)
    # A chain continued from a packed slice equals the whole chain.
    packed = np.array(tokens, dtype=np.uint32)
    assert chunk_keys(packed[2 * C :], LAYOUT, parent=expected[1], include_partial=True) == expected[2:]


def test_pack_token_ids_hashes_a_native_uint32_buffer_in_place() -> None:
    ids = array("I", range(10))
    view = pack_token_ids(ids)
    assert view.format == "I" and view.readonly and list(view) == list(range(10))
    ids[3] = 99  # the view is the array's own memory, not a copy
    assert view[3] == 99
    assert pack_token_ids([1, 2, 3]).tobytes() == b"\x01\0\0\0\x02\0\0\0\x03\0\0\0"


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (np.array([1, -1]), "from -1 to 1"),
        (np.array([1, 2**32]), r"\[0, 2\*\*32\)"),
        (np.array([1.0, 2.0]), "integers"),
        (np.array([[1, 2], [3, 4]], dtype=np.uint32), "one-dimensional"),
        (np.array([1, 2], dtype=">u4"), "native byte order"),
        (array("q", [1, -5]), r"\[0, 2\*\*32\)"),
        ((1, 2.5), "integers"),
    ],
    ids=["negative", "too large", "float", "2-d", "big-endian", "array negative", "tuple float"],
)
def test_bad_token_id_forms_are_clear_errors(ids: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chunk_keys(ids, LAYOUT, chunk_size=1)


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="token ids"):
        chunk_keys([1, -1], LAYOUT, chunk_size=1)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_keys([1], LAYOUT, chunk_size=0)
    with pytest.raises(ValueError, match="tp_rank"):
        dataclasses.replace(LAYOUT, tp_rank=2)
    with pytest.raises(ValueError, match="32 bytes"):
        ChunkKey(b"short")


@pytest.mark.parametrize("n", [0, 1, 128, 1025])
def test_protocol_key_splitting_round_trips(n: int) -> None:
    from kvstack.cache.protocol import ProtocolError, join_keys, key_bytes, split_keys

    keys = [ChunkKey(os.urandom(32)) for _ in range(n)]
    raw = join_keys(keys)
    assert split_keys(raw) == keys and all(type(k) is ChunkKey for k in split_keys(raw))
    assert list(key_bytes(raw)) == keys  # plain bytes, equal (and hashing equal) to the ChunkKeys
    assert {k: 1 for k in keys}.keys() >= set(key_bytes(raw))
    with pytest.raises(ProtocolError, match="multiple of 32"):
        key_bytes(raw + b"x")
