"""The cache server's wire protocol, version 1: msgspec messages in ZMQ multipart frames. No sockets are made
here (`send_frames` and `recv_frames` move one message on a socket they are given).

A request (client DEALER -> server ROUTER; a REQ client's empty delimiter frame is accepted and echoed) is
``[header, mac, *payloads]``: ``header`` is a msgpack map, one of the `Request` structs tagged by ``"op"``
(each one's docstring says what it asks and what its reply holds), with ``v`` (the protocol version) and
``id`` (chosen by the client and echoed, so a late reply to a request the client gave up on is dropped);
``payloads`` are put payloads that travel in frames, in key order. A reply is ``[header, *payloads]``: the
request's op, or ``"error"`` (`ErrorReply`: an `ErrorCode` and a message saying what to fix). Keys travel as
one ``bytes`` field, the 32-byte `ChunkKey` s concatenated (``len(keys) % 32 == 0``).

``mac`` is empty without a shared secret, else ``HMAC-SHA256(secret, header)`` (32 bytes). The secret decides
who may use the server; it does not encrypt, does not cover payload frames or shared memory, and does not
stop a replayed request: on an untrusted network, keep the server on 127.0.0.1 or ipc://. Same-host clients
may use a unix socket (``unix:///path``) instead: the same messages, each behind a head (`unix_head`).

Fields a reader does not know are ignored and new optional fields get defaults, so ``v`` only changes for
an incompatible change; a server answers any other version with error ``version``.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import zmq

from kvstack.cache.keys import KEY_BYTES, ChunkKey

__all__ = [
    "MAC_BYTES",
    "PROTOCOL_VERSION",
    "UNIX_MAGIC",
    "UNIX_SCHEME",
    "Clear",
    "ClearReply",
    "ErrorCode",
    "ErrorReply",
    "Evict",
    "EvictReply",
    "Exists",
    "ExistsReply",
    "Get",
    "GetReply",
    "Hello",
    "HelloReply",
    "Lookup",
    "LookupReply",
    "ProtocolError",
    "Put",
    "PutReply",
    "Reply",
    "Request",
    "Stats",
    "StatsReply",
    "StoredTail",
    "UnixFramer",
    "decode_reply",
    "decode_request",
    "encode",
    "join_keys",
    "key_bytes",
    "recv_frames",
    "request_mac",
    "send_frames",
    "split_keys",
    "unix_head",
]

PROTOCOL_VERSION: Final = 1
MAC_BYTES: Final = 32
IN_FRAME: Final = -1
"""An ``offsets`` entry: this payload travels in a frame, not in shared memory."""


class ErrorCode(enum.StrEnum):
    MALFORMED = "malformed"  # not a msgpack map of a known shape, or wrong frames
    VERSION = "version"  # another protocol version
    UNKNOWN_OP = "unknown_op"
    TOO_LARGE = "too_large"  # over max_message_bytes or max_keys
    AUTH = "auth"  # missing or wrong mac
    BAD_REQUEST = "bad_request"  # well-formed but inconsistent (key length, counts, offsets)
    ARENA = "arena"  # the named shared-memory arena cannot be used: resend the payloads in frames
    INTERNAL = "internal"  # the server failed; the request may be retried


class ProtocolError(Exception):
    """A request the server answers with an error reply."""

    def __init__(self, code: ErrorCode, message: str, request_id: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class _Message(msgspec.Struct, tag_field="op", omit_defaults=True, kw_only=True):
    v: int = PROTOCOL_VERSION
    id: int = 0


# -- requests


class Hello(_Message, tag="hello"):
    """-> `HelloReply` (``node``, ``server``, ``arena_ok``, ``arena_error``, ``max_message_bytes``,
    ``max_keys``): the client names its shared-memory ``arena``; the server maps it and checks the
    ``arena_nonce`` written at its start (proof of a shared host), else the client uses socket payloads
    (see ``kvstack.cache.shm``)."""

    client: str = ""
    arena: str | None = None
    arena_nonce: bytes = b""


class Lookup(_Message, tag="lookup"):
    """-> `LookupReply`: ``count``, the longest consecutive prefix of ``keys`` held, and ``tiers``, a tier
    name per chunk of it. With ``tails``: also ``tails``, the partial tails (`StoredTail`) held right after
    that prefix, i.e. stored with its last key as parent (``parent``, the key before ``keys[0]``, when the
    prefix is empty; None: the prompt's start)."""

    keys: bytes
    tails: bool = False
    parent: bytes | None = None


class Exists(_Message, tag="exists"):
    """-> `ExistsReply`: ``present``, per key, held by any tier."""

    keys: bytes


class Get(_Message, tag="get"):
    """-> `GetReply` (``sizes``, ``offsets``, ``more``): the payloads of the longest consecutive prefix of
    ``keys``. Chunk ``i`` is in the client's ``arena`` at ``offsets[i]`` (inside the region ``region_offset``,
    ``region_size`` the request lent) or, where ``offsets[i] == -1`` (`IN_FRAME`), in the next payload frame.
    ``more``: the reply stopped early at the size limit; ask again for the rest."""

    keys: bytes
    arena: str | None = None
    region_offset: int = 0
    region_size: int = 0


class Put(_Message, tag="put"):
    """-> `PutReply`: ``stored``, the chunks the memory tier kept. ``offsets`` as in `Get` (empty: all
    payloads in frames). ``token_ids`` (one list per chunk) and ``parent`` (the key of the chunk before
    ``keys[0]``, None for a prompt's first chunk) are optional, but without them the server cannot publish
    ``BlockStored`` events for the chunks (a router keys blocks by their tokens). ``model`` (optional): the
    served model name of the engine that computed the chunks, carried in their events so a router credits
    them only to requests for that model."""

    keys: bytes
    sizes: list[int]
    offsets: list[int] = msgspec.field(default_factory=list)
    arena: str | None = None
    parent: bytes | None = None
    token_ids: list[list[int]] | None = None
    model: str | None = None


class Evict(_Message, tag="evict"):
    """-> `EvictReply`: ``removed``, how many of ``keys`` were removed."""

    keys: bytes


class Clear(_Message, tag="clear"):
    """-> `ClearReply` (``{}``): every tier emptied."""


class Stats(_Message, tag="stats"):
    """-> `StatsReply`: ``node`` and ``stats``, the store's and the server's counters as a map."""


Request = Hello | Lookup | Exists | Get | Put | Evict | Clear | Stats
OPS: Final = ("hello", "lookup", "exists", "get", "put", "evict", "clear", "stats")

# -- replies


class HelloReply(_Message, tag="hello"):
    node: str
    server: str
    arena_ok: bool = False
    arena_error: str = ""
    max_message_bytes: int = 0
    max_keys: int = 0


class StoredTail(msgspec.Struct, array_like=True, frozen=True):
    """A prompt's partial last chunk the server holds: ``length`` tokens (fewer than a chunk) under ``key``,
    in tier ``tier``."""

    length: int
    key: bytes
    tier: str


class LookupReply(_Message, tag="lookup"):
    count: int
    tiers: list[str]
    tails: list[StoredTail] = msgspec.field(default_factory=list)


class ExistsReply(_Message, tag="exists"):
    present: list[bool]


class GetReply(_Message, tag="get"):
    sizes: list[int]
    offsets: list[int]
    more: bool = False


class PutReply(_Message, tag="put"):
    stored: int


class EvictReply(_Message, tag="evict"):
    removed: int


class ClearReply(_Message, tag="clear"):
    pass


class StatsReply(_Message, tag="stats"):
    node: str
    stats: dict[str, Any]


class ErrorReply(_Message, tag="error"):
    code: str
    message: str


Reply = (
    HelloReply
    | LookupReply
    | ExistsReply
    | GetReply
    | PutReply
    | EvictReply
    | ClearReply
    | StatsReply
    | ErrorReply
)

_ENCODER: Final = msgspec.msgpack.Encoder()
_REQUEST_DECODER: Final = msgspec.msgpack.Decoder(Request)
_REPLY_DECODER: Final = msgspec.msgpack.Decoder(Reply)
_ANY_DECODER: Final = msgspec.msgpack.Decoder()


def encode(message: _Message) -> bytes:
    return _ENCODER.encode(message)


def decode_request(header: bytes | memoryview) -> Request:
    """The request in ``header``, or `ProtocolError` saying what is wrong (with the id when readable)."""
    try:
        request = _REQUEST_DECODER.decode(header)
    except (msgspec.MsgspecError, TypeError, ValueError, RecursionError) as exc:
        raise _explain(header, exc) from None
    if request.v != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION,
            f"protocol version {request.v} is not served here; this server speaks version {PROTOCOL_VERSION}",
            request.id,
        )
    return request


def _explain(header: bytes | memoryview, exc: Exception) -> ProtocolError:
    """Why a header failed to decode: looks at it as plain msgpack to name the version, op and id."""
    try:
        raw = _ANY_DECODER.decode(header)
    except (msgspec.MsgspecError, TypeError, ValueError, RecursionError):
        return ProtocolError(ErrorCode.MALFORMED, f"header is not msgpack ({len(header)} bytes): {exc}")
    if not isinstance(raw, dict):
        return ProtocolError(ErrorCode.MALFORMED, f"header is a msgpack {type(raw).__name__}, expected a map")
    rid = raw.get("id")
    request_id = rid if type(rid) is int and 0 <= rid < 2**64 else 0  # not a bool: `true` is no id
    version = raw.get("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        return ProtocolError(
            ErrorCode.VERSION,
            f"protocol version {version!r} is not served here; this server speaks version {PROTOCOL_VERSION}"
            + (" (an integer)" if not isinstance(version, int) else ""),
            request_id,
        )
    op = raw.get("op")
    if op not in OPS:
        return ProtocolError(
            ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; known ops: {', '.join(OPS)}", request_id
        )
    return ProtocolError(ErrorCode.MALFORMED, f"invalid {op} request: {exc}", request_id)


def decode_reply(header: bytes | memoryview) -> Reply:
    """The reply in ``header``; raises ``msgspec.MsgspecError`` (or ValueError) when it is not one."""
    return _REPLY_DECODER.decode(header)


def request_mac(secret: bytes, header: bytes | memoryview) -> bytes:
    return hmac.new(secret, header, hashlib.sha256).digest()


def join_keys(keys: Sequence[bytes]) -> bytes:
    joined = b"".join(keys)
    if len(joined) != KEY_BYTES * len(keys) or set(map(len, keys)) - {KEY_BYTES}:  # no Python loop
        bad = next(len(key) for key in keys if len(key) != KEY_BYTES)
        raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got {bad}")
    return joined


def split_keys(keys: bytes, request_id: int = 0) -> list[ChunkKey]:
    """The `ChunkKey` s concatenated in ``keys`` (for requests whose keys a tier may store)."""
    # Each part is 32 bytes by construction: build the keys without ChunkKey's per-key length check.
    new_key = bytes.__new__
    return [new_key(ChunkKey, key) for key in key_bytes(keys, request_id)]


def key_bytes(keys: bytes, request_id: int = 0) -> tuple[bytes, ...]:
    """The 32-byte keys concatenated in ``keys`` as plain ``bytes`` (for queries: a `ChunkKey` hashes and
    compares as its bytes, and no ChunkKey is built: 128 keys in ~4 µs instead of ~40 µs)."""
    if len(keys) % KEY_BYTES:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"keys is {len(keys)} bytes, not a multiple of {KEY_BYTES} (32-byte chunk keys concatenated)",
            request_id,
        )
    n = len(keys) // KEY_BYTES
    if n > _STRUCT_KEYS:  # a format per count is cached: bound its size
        return tuple(keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES))
    parts: tuple[bytes, ...] = _key_struct(n).unpack(keys)
    return parts


_STRUCT_KEYS: Final = 1024


@functools.lru_cache(maxsize=128)
def _key_struct(n: int) -> struct.Struct:
    return struct.Struct(f"{KEY_BYTES}s" * n)


_MORE: Final = int(zmq.SNDMORE)


def send_frames(sock: zmq.Socket[Any], frames: Sequence[Any], flags: int = 0) -> None:
    """Send one multipart message (``flags``: e.g. ``zmq.NOBLOCK`` as an int). pyzmq's send_multipart does
    the same with enum-typed flags per frame, about twice the cost for a small message."""
    send = sock.send
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        send(frame, flags if i == last else flags | _MORE, copy=False)


def recv_frames(sock: zmq.Socket[Any], flags: int = 0) -> list[zmq.Frame]:
    """Receive one multipart message; ``flags`` apply to its first frame (the rest arrive with it). Reads
    each frame's ``more`` flag instead of asking the socket for ZMQ_RCVMORE as recv_multipart does."""
    frames = [sock.recv(flags, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(0, copy=False))
    return frames


UNIX_SCHEME: Final = "unix://"
UNIX_MAGIC: Final = b"KVS1"
_UNIX_HEAD = struct.Struct("<4sI")  # magic, frame count; then one uint32 length per frame


@functools.lru_cache(maxsize=64)
def _lengths_struct(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}I")


def unix_head(frames: Sequence[Any]) -> bytes:
    """The head that goes before ``frames`` (buffers) on a unix socket: ``b"KVS1"`` (`UNIX_MAGIC`), the frame
    count and each frame's length, little-endian uint32; the frames follow back to back."""
    sizes = [memoryview(frame).nbytes for frame in frames]
    return _UNIX_HEAD.pack(UNIX_MAGIC, len(frames)) + _lengths_struct(len(frames)).pack(*sizes)


class UnixFramer:
    """Cuts the bytes read from a unix socket into messages: ``feed`` what was read, then take each whole
    message with ``next`` (its frames as read-only views of one buffer). A head that is not ours, or one
    announcing more than ``max_frames`` frames or ``max_bytes`` bytes, raises `ProtocolError` (the stream
    cannot be trusted past it: close the connection)."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self._lengths: tuple[int, ...] | None = None  # of the message whose head was read
        self._head = 0  # its head's bytes
        self._end = 0  # where it ends in the buffer

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    def next(self) -> list[memoryview] | None:
        """The next whole message, or None until more is fed."""
        buf = self._buf
        if self._lengths is None:
            if len(buf) < _UNIX_HEAD.size:
                return None
            magic, n = _UNIX_HEAD.unpack_from(buf)
            if magic != UNIX_MAGIC:
                raise ProtocolError(
                    ErrorCode.MALFORMED, f"not a kvstack unix-socket message (head {magic!r})"
                )
            if not 1 <= n <= self.max_frames:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"{n} frames; 1 to {self.max_frames} allowed")
            head = _UNIX_HEAD.size + 4 * n
            if len(buf) < head:
                return None
            lengths = _lengths_struct(n).unpack_from(buf, _UNIX_HEAD.size)
            body_bytes = sum(lengths)
            if body_bytes > self.max_bytes:
                raise ProtocolError(
                    ErrorCode.TOO_LARGE,
                    f"message of {body_bytes} bytes is over max_message_bytes={self.max_bytes}",
                )
            self._lengths, self._head, self._end = lengths, head, head + body_bytes
        lengths, end = self._lengths, self._end
        if len(buf) < end:
            return None
        body = memoryview(bytes(buf[self._head : end]))  # one copy; the frames are views of it
        del buf[:end]
        self._lengths = None
        frames = []
        offset = 0
        for length in lengths:
            frames.append(body[offset : offset + length])
            offset += length
        return frames
