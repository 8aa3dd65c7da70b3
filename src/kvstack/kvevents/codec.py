"""vLLM's KV-cache event wire format as typed msgspec Structs, and its codec. No sockets.

A message is three ZMQ frames ``[topic, seq, payload]``: ``seq`` 8 bytes big-endian, counting batches from
0 per publisher (a restart starts again at 0), -1 (signed) ending a replay; ``payload`` a msgpack
``EventBatch``, array-like ``[ts, events, data_parallel_rank]``. ``encode_batch`` writes events as vLLM
0.32 does (maps tagged by ``"type"``, optional fields omitted at their default) or, with ``legacy_array``,
as older vLLM's positional arrays; ``decode_batch`` reads both (vLLM 0.8's shorter arrays too) and skips
unknown event types.

Block hashes are the engine's own (int, or bytes); they depend on its hash algorithm and seed, so consumers
key blocks by ``token_ids`` and keep hashes only to match removals. ``MODEL_EXTRA_KEY`` is kvstack's tag in
a block's ``extra_keys``: ``(MODEL_EXTRA_KEY, model)`` names the model of a cache server's chunk.
"""

import logging
from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "MODEL_EXTRA_KEY",
    "REPLAY_END_SEQ",
    "REPLAY_END_SEQ_BYTES",
    "SEQ_BYTES",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEvent",
    "KVEventDecodeError",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
]

logger = logging.getLogger(__name__)

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"

# kvstack's extra_keys tag, not vLLM's: a cache server's ("kvstack-model", model) names its chunk's model.
MODEL_EXTRA_KEY: Final = "kvstack-model"

REPLAY_END_SEQ: Final = -1
SEQ_BYTES: Final = 8

BlockHash = int | bytes

_T = TypeVar("_T")


class KVEventDecodeError(ValueError):
    """A payload or frame is not a vLLM KV event batch; the message says what was wrong and where."""


def _always_encoded(value: _T) -> _T:
    # vLLM declares these fields without a default, so it always puts them on the wire and its own decoder
    # rejects a message that lacks them. A default_factory gives Python callers a default while omit_defaults
    # still encodes the field: msgspec only omits values it can compare against a plain default.
    return msgspec.field(default_factory=lambda: value)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type", tag=True):
    """Base of the KV-cache events; the tag is the class name, as in vLLM."""


class BlockStored(KVCacheEvent, tag="BlockStored"):
    """Consecutive full blocks entered the cache; ``token_ids`` holds all their tokens, in order."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = _always_encoded(None)
    medium: str | None = _always_encoded(MEDIUM_GPU)
    lora_name: str | None = _always_encoded(None)
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    # No further fields (e.g. a later vLLM's lookahead_token_ids): with a 16th map entry msgspec writes a
    # map16 header instead of vLLM 0.32's fixmap, and the bytes would differ. decode_batch ignores them.


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    """Blocks left the cache on ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None = _always_encoded(MEDIUM_GPU)
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    """Every block is gone (cache reset, /sleep)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

_EVENT_TYPES: Final[dict[str, type[KVEvent]]] = {
    str(cls.__struct_config__.tag): cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One scheduler step's events; one batch per ZMQ message."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _LooseBatch(msgspec.Struct, array_like=True, gc=False):
    # The batch envelope with events left undecoded, for legacy arrays and unknown event types.
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_ENCODER: Final = msgspec.msgpack.Encoder()
_STRICT_DECODER: Final = msgspec.msgpack.Decoder(EventBatch)
_LOOSE_DECODER: Final = msgspec.msgpack.Decoder(_LooseBatch)


def encode_batch(batch: EventBatch, *, legacy_array: bool = False) -> bytes:
    """Encode ``batch`` as vLLM 0.32 does, or with events as positional arrays (``legacy_array``)."""
    if not legacy_array:
        return _ENCODER.encode(batch)
    events = [[ev.__struct_config__.tag, *msgspec.structs.astuple(ev)] for ev in batch.events]
    return _ENCODER.encode([batch.ts, events, batch.data_parallel_rank])


def decode_batch(payload: bytes, *, on_unknown: Callable[[str], None] | None = None) -> EventBatch:
    """Decode either encoding; skip unknown event types, reporting each to ``on_unknown`` (else a warning).

    Unknown extra fields are ignored. Anything malformed raises ``KVEventDecodeError``.
    """
    try:
        return _STRICT_DECODER.decode(payload)
    except (msgspec.MsgspecError, TypeError):
        # Legacy arrays and unknown event types fail the strict schema; the tolerant path sorts them out and
        # raises with a precise message when the payload really is malformed.
        pass
    try:
        loose = _LOOSE_DECODER.decode(payload)
    except (msgspec.MsgspecError, TypeError) as exc:
        raise KVEventDecodeError(
            f"KV event payload ({_describe(payload)}) is not a vLLM EventBatch: {exc}"
        ) from exc
    events: list[KVEvent] = []
    for index, raw in enumerate(loose.events):
        event = _decode_event(raw, index)
        if isinstance(event, str):
            if on_unknown is not None:
                on_unknown(event)
            else:
                logger.warning("skipping KV event of unknown type %r (newer vLLM than kvstack knows?)", event)
            continue
        events.append(event)
    return EventBatch(ts=loose.ts, events=events, data_parallel_rank=loose.data_parallel_rank)


def _decode_event(raw: Any, index: int) -> KVEvent | str:
    """Return the event, or its type name when the type is unknown."""
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        kind = "an empty array" if raw == [] else type(raw).__name__
        raise KVEventDecodeError(f"KV event $.events[{index}] is {kind}, expected a tagged map or array")
    if not isinstance(tag, str):
        raise KVEventDecodeError(f"KV event $.events[{index}] has type tag {tag!r}, expected a string")
    cls = _EVENT_TYPES.get(tag)
    if cls is None:
        return tag
    if isinstance(raw, dict):
        fields = raw
    else:
        # Newer array-era fields beyond the ones kvstack knows are dropped here, like unknown map keys.
        fields = dict(zip(cls.__struct_fields__, raw[1:], strict=False))
        fields["type"] = tag
    try:
        return msgspec.convert(fields, cls)
    except (msgspec.MsgspecError, TypeError) as exc:
        raise KVEventDecodeError(f"KV event $.events[{index}] is not a valid {tag}: {exc}") from exc


def _describe(payload: object) -> str:
    if isinstance(payload, bytes | bytearray | memoryview):
        head = bytes(payload[:16]).hex()
        return f"{len(payload)} bytes, starting {head}"
    return type(payload).__name__


def encode_seq(seq: int) -> bytes:
    """The seq frame: 8 bytes big-endian; negative only for the replay end marker."""
    return seq.to_bytes(SEQ_BYTES, "big", signed=seq < 0)


def decode_seq(frame: bytes) -> int:
    """Read a seq frame as signed, so the replay end marker reads as ``REPLAY_END_SEQ``."""
    if len(frame) != SEQ_BYTES:
        raise KVEventDecodeError(f"seq frame has {len(frame)} bytes, expected {SEQ_BYTES} (big-endian)")
    return int.from_bytes(frame, "big", signed=True)


REPLAY_END_SEQ_BYTES: Final = encode_seq(REPLAY_END_SEQ)
