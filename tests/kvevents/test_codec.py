"""The vLLM KV-event codec: both encodings round-trip, malformed payloads fail one way, bytes match vLLM's."""

import logging
import random
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvstack.kvevents.codec import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    REPLAY_END_SEQ,
    REPLAY_END_SEQ_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from support.engines import require_vllm, vllm_python

_HASH = 16303569632084916100  # a real one, seen from vLLM CPU


def _minimal_batch() -> EventBatch:
    return EventBatch(
        ts=1796203487.62,
        events=[
            BlockStored(block_hashes=[_HASH], parent_block_hash=None, token_ids=[1, 2], block_size=2),
            BlockRemoved(block_hashes=[_HASH]),
            AllBlocksCleared(),
        ],
    )


def _full_batch() -> EventBatch:
    """Every field set away from its default, both hash kinds, the largest unsigned 64-bit hash."""
    return EventBatch(
        ts=1796203487.62,
        events=[
            BlockStored(
                block_hashes=[2**64 - 1, 7],
                parent_block_hash=3,
                token_ids=list(range(8)),
                block_size=4,
                lora_id=5,
                medium=MEDIUM_CPU,
                lora_name="adapter-a",
                # Nested tuples come back as lists under Any, in vLLM's decoder as in ours.
                extra_keys=[("adapter-a", ["mm-1", 0], "salt"), None],
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128,
                locality="LOCAL",
                ownership="offload-tier-1",
                session_id="session-9",
            ),
            BlockStored(
                block_hashes=[b"\x01" * 32],
                parent_block_hash=b"\x02" * 32,
                token_ids=[9, 10, 11, 12],
                block_size=4,
                medium=None,
            ),
            BlockRemoved(
                block_hashes=[2**64 - 1, b"\x03" * 32], medium="STORAGE", group_idx=2, locality="REMOTE"
            ),
            AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )


@pytest.mark.parametrize("legacy_array", [False, True])
@pytest.mark.parametrize("make_batch", [_minimal_batch, _full_batch])
def test_round_trip(make_batch: Any, legacy_array: bool) -> None:
    batch = make_batch()
    assert decode_batch(encode_batch(batch, legacy_array=legacy_array)) == batch


def test_map_encoding_omits_optional_fields_but_always_sends_vllm_required_ones() -> None:
    ts, events, rank = msgspec.msgpack.decode(encode_batch(_minimal_batch()))
    assert ts == 1796203487.62
    assert rank is None  # vLLM's array-like batch keeps a trailing default too
    stored, removed, cleared = events
    # vLLM declares lora_id, medium and lora_name without defaults and rejects messages that lack them.
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert stored["medium"] == MEDIUM_GPU
    assert stored["lora_id"] is None
    assert removed == {"type": "BlockRemoved", "block_hashes": [_HASH], "medium": "GPU"}
    assert cleared == {"type": "AllBlocksCleared"}


def test_legacy_array_encoding_is_positional() -> None:
    batch = _minimal_batch()
    batch.data_parallel_rank = 0
    ts, events, rank = msgspec.msgpack.decode(encode_batch(batch, legacy_array=True))
    assert (ts, rank) == (1796203487.62, 0)
    stored, removed, cleared = events
    assert stored[:8] == ["BlockStored", [_HASH], None, [1, 2], 2, None, "GPU", None]
    assert stored[8:] == [None] * 7
    assert removed == ["BlockRemoved", [_HASH], "GPU", None, None, None]
    assert cleared == ["AllBlocksCleared"]


# vLLM 0.8's event structs, the first release with KV events (the reference's "older" array encoding).
class _V08Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _V08Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class BlockStoredV08(_V08Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemovedV08(_V08Event, tag="BlockRemoved"):
    block_hashes: list[int]


class AllBlocksClearedV08(_V08Event, tag="AllBlocksCleared"):
    pass


class _V08KVBatch(_V08Batch):
    events: list[BlockStoredV08 | BlockRemovedV08 | AllBlocksClearedV08]


def test_legacy_array_output_decodes_with_vllm_08_structs() -> None:
    decoded = msgspec.msgpack.decode(encode_batch(_minimal_batch(), legacy_array=True), type=_V08KVBatch)
    assert decoded.events == [
        BlockStoredV08(
            block_hashes=[_HASH],
            parent_block_hash=None,
            token_ids=[1, 2],
            block_size=2,
            lora_id=None,
        ),
        BlockRemovedV08(block_hashes=[_HASH]),
        AllBlocksClearedV08(),
    ]


def test_decodes_vllm_08_payloads_with_defaults_for_later_fields() -> None:
    payload = msgspec.msgpack.encode(
        _V08KVBatch(
            ts=2.0,
            events=[
                BlockStoredV08(
                    block_hashes=[1, 2], parent_block_hash=0, token_ids=[5, 6], block_size=1, lora_id=4
                ),
                BlockRemovedV08(block_hashes=[2]),
                AllBlocksClearedV08(),
            ],
        )
    )
    assert decode_batch(payload) == EventBatch(
        ts=2.0,
        events=[
            BlockStored(block_hashes=[1, 2], parent_block_hash=0, token_ids=[5, 6], block_size=1, lora_id=4),
            BlockRemoved(block_hashes=[2], medium=MEDIUM_GPU),
            AllBlocksCleared(),
        ],
        data_parallel_rank=None,
    )


def test_unknown_fields_are_ignored_in_both_encodings() -> None:
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1]}
    payload = msgspec.msgpack.encode(
        [
            3.0,
            [
                {**stored, "block_size": 1, "from_the_future": {"x": [1, 2]}},
                ["BlockStored", [1], None, [1], 1, None, "GPU", None, *[None] * 7, "new"],
                ["BlockRemoved", [1], "CPU", None, None, None, "new", "newer"],
            ],
            7,
            "a future batch field",
        ]
    )
    batch = decode_batch(payload)
    expected = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1)
    assert batch.events == [expected, expected, BlockRemoved(block_hashes=[1], medium="CPU")]
    assert batch.data_parallel_rank == 7


def test_unknown_event_types_are_skipped_and_reported() -> None:
    payload = msgspec.msgpack.encode(
        [
            4.0,
            [
                {"type": "BlockMoved", "block_hashes": [1]},
                {"type": "AllBlocksCleared"},
                ["FancyNewEvent", 1, 2],
            ],
            None,
        ]
    )
    reported: list[str] = []
    batch = decode_batch(payload, on_unknown=reported.append)
    assert batch.events == [AllBlocksCleared()]
    assert reported == ["BlockMoved", "FancyNewEvent"]


def test_unknown_event_types_are_logged_without_a_callback(caplog: pytest.LogCaptureFixture) -> None:
    payload = msgspec.msgpack.encode([4.0, [{"type": "BlockMoved"}], None])
    with caplog.at_level(logging.WARNING, logger="kvstack.kvevents.codec"):
        assert decode_batch(payload).events == []
    assert "'BlockMoved'" in caplog.text


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (None, "Expected `array`, got `None`"),
        ({"ts": 1.0, "events": []}, "Expected `array`, got `object`"),
        ([1.0], "at least length 2"),
        ([True, []], "Expected `float`, got `bool`"),
        ([1.0, None], "$[1]"),
        ([1.0, [], "rank"], "$[2]"),
        ([1.0, [7]], "$.events[0] is int"),
        ([1.0, [[]]], "$.events[0] is an empty array"),
        ([1.0, [[3, 4]]], "type tag 3"),
        ([1.0, [{"block_hashes": [1]}]], "type tag None"),
        ([1.0, [["BlockStored", [1]]]], "missing required field `parent_block_hash`"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": "nope"}]], "not a valid BlockRemoved"),
        ([1.0, [["BlockStored", [1], None, [1], "big"]]], "Expected `int`, got `str`"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]], "Expected `int | bytes`"),
    ],
)
def test_malformed_payloads_raise_decode_error_with_location(obj: Any, message: str) -> None:
    with pytest.raises(KVEventDecodeError) as info:
        decode_batch(msgspec.msgpack.encode(obj))
    assert message in str(info.value)


def test_not_msgpack_or_not_bytes_raises_decode_error() -> None:
    for payload in (b"", b"\xc1", b"\x93\xcb", b"\x91" * 100_000, "a str", None):
        with pytest.raises(KVEventDecodeError):
            decode_batch(payload)  # type: ignore[arg-type]  # a str and None on purpose


def test_fuzzed_payloads_only_ever_raise_decode_error() -> None:
    rng = random.Random(20240917)
    seeds = [
        encode_batch(_full_batch()),
        encode_batch(_full_batch(), legacy_array=True),
        encode_batch(_minimal_batch(), legacy_array=True),
    ]
    decoded = failed = 0
    for _ in range(30_000):
        seed = rng.choice(seeds)
        roll = rng.random()
        if roll < 0.25:
            payload = rng.randbytes(rng.randint(0, 64))
        elif roll < 0.5:
            payload = seed[: rng.randint(0, len(seed))]
        else:
            mutated = bytearray(seed)
            for _ in range(rng.randint(1, 6)):
                mutated[rng.randrange(len(mutated))] = rng.getrandbits(8)
            payload = bytes(mutated)
        try:
            result = decode_batch(payload, on_unknown=lambda _tag: None)
        except KVEventDecodeError:
            failed += 1
        else:
            assert isinstance(result, EventBatch)
            decoded += 1
    # Both outcomes must actually occur, or the fuzzing proves nothing.
    assert decoded > 100
    assert failed > 100


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(KVEventDecodeError, ValueError)


def test_seq_frames() -> None:
    assert encode_seq(0) == b"\x00" * 8
    assert encode_seq(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert decode_seq(encode_seq(2**63 - 1)) == 2**63 - 1
    assert REPLAY_END_SEQ_BYTES == b"\xff" * 8 == encode_seq(REPLAY_END_SEQ)
    assert decode_seq(REPLAY_END_SEQ_BYTES) == REPLAY_END_SEQ == -1
    with pytest.raises(KVEventDecodeError, match="7 bytes"):
        decode_seq(b"\x00" * 7)


# Runs in the vLLM virtualenv: builds each batch with vLLM's own classes and encoder, re-encodes kvstack's
# payloads after decoding them with vLLM's own decoder, and lists vLLM's event fields. Exit 3: no vLLM here.
_VLLM_SCRIPT = textwrap.dedent(
    """
    import sys
    import msgspec
    try:
        from vllm.distributed import kv_events as v
    except ImportError as exc:
        print(f"cannot import vllm.distributed.kv_events: {exc}", file=sys.stderr)
        sys.exit(3)

    with open(sys.argv[1], "rb") as f:
        request = msgspec.msgpack.decode(f.read())
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(v.KVEventBatch)
    built = []
    for ts, events, rank in request["batches"]:
        objs = [getattr(v, name)(**kwargs) for name, kwargs in events]
        built.append(encoder.encode(v.KVEventBatch(ts=ts, events=objs, data_parallel_rank=rank)))
    reencoded = [encoder.encode(decoder.decode(payload)) for payload in request["ours"]]
    fields = {
        cls.__name__: list(cls.__struct_fields__)
        for cls in (v.BlockStored, v.BlockRemoved, v.AllBlocksCleared, v.KVEventBatch)
    }
    with open(sys.argv[2], "wb") as f:
        f.write(msgspec.msgpack.encode({"built": built, "reencoded": reencoded, "fields": fields}))
    """
)


@pytest.mark.vllm
def test_bytes_and_fields_match_vllm_own_classes(tmp_path: Path) -> None:
    require_vllm()
    on_rank_0 = _minimal_batch()
    on_rank_0.data_parallel_rank = 0  # what vLLM's publisher fills in on rank 0
    ours = [_minimal_batch(), on_rank_0, _full_batch()]
    request = {
        "batches": [
            [
                batch.ts,
                [[type(ev).__name__, msgspec.structs.asdict(ev)] for ev in batch.events],
                batch.data_parallel_rank,
            ]
            for batch in ours
        ],
        "ours": [encode_batch(batch) for batch in ours],
    }
    request_path, result_path = tmp_path / "request.msgpack", tmp_path / "result.msgpack"
    request_path.write_bytes(msgspec.msgpack.encode(request))
    done = subprocess.run(
        [str(vllm_python()), "-c", _VLLM_SCRIPT, str(request_path), str(result_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == 3:
        pytest.skip(f"{vllm_python()}: {done.stderr.strip().splitlines()[-1]} (still installing?)")
    assert done.returncode == 0, done.stderr[-4000:]
    result = msgspec.msgpack.decode(result_path.read_bytes())
    assert result["built"] == request["ours"]
    assert result["reencoded"] == request["ours"]
    for payload, batch in zip(result["built"], ours, strict=True):
        assert decode_batch(payload) == batch
    assert result["fields"] == {
        "BlockStored": list(BlockStored.__struct_fields__),
        "BlockRemoved": list(BlockRemoved.__struct_fields__),
        "AllBlocksCleared": [],
        "KVEventBatch": list(EventBatch.__struct_fields__),
    }
