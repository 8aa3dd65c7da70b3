"""Fuzz messages for the cache protocol: seeded random frames, from garbage to requests of the right shape
with inconsistent contents, for servers limited to ``MAX_BYTES`` per message and ``MAX_KEYS`` keys."""

from __future__ import annotations

import random
from typing import Any

import msgspec

from kvstack.cache.protocol import OPS, Clear, Evict, Exists, Get, Hello, Lookup, Put, Stats, encode

MAX_BYTES = 64 << 10
MAX_KEYS = 64
SEED = 20_260_517
FIELDS = (
    "op", "v", "id", "keys", "sizes", "offsets", "arena", "parent", "token_ids",
    "region_offset", "region_size", "client", "arena_nonce",
)  # fmt: skip
HUGE_HEADERS = (
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xdb\xff\xff\xff\xf0abc",  # str32
    b"\xdd\xff\xff\xff\xff\x01",  # array32 of 4 G items
    b"\xdf\xff\xff\xff\xff\xa2op",  # map32 of 4 G pairs
    b"\xc9\x7f\xff\xff\xff\x01",  # ext32
    b"\x81\xa4keys\xc6\x7f\xff\xff\xff",  # a map whose keys field declares 2 GiB
)


def _key(rng: random.Random) -> bytes:
    return rng.randbytes(32)


def valid_request(rng: random.Random) -> Any:
    rid = rng.randrange(1, 2**40)
    keys = b"".join(_key(rng) for _ in range(rng.randrange(0, 5)))
    n = len(keys) // 32
    return rng.choice(
        [
            Hello(id=rid, client="fuzz"),
            Lookup(id=rid, keys=keys),
            Exists(id=rid, keys=keys),
            Get(id=rid, keys=keys),
            Put(id=rid, keys=keys, sizes=[0] * n),
            Evict(id=rid, keys=keys),
            Stats(id=rid),
            Clear(id=rid),
        ]
    )


def random_object(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(10 if depth < 4 else 7)
    if kind == 0:
        return rng.choice([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if kind == 1:
        return rng.choice([0.5, float("nan"), float("inf"), -1e300])
    if kind == 2:
        return rng.choice([*OPS, "", "put ", "PUT", "error", "x" * 300])
    if kind == 3:
        return rng.randbytes(rng.choice([0, 1, 31, 32, 33, 64, 100]))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.choice(
            ["../../etc/passwd", "kvstack-arena-nope", "kvstack-arena-" + "a" * 200, "/dev/shm/x"]
        )
    if kind == 6:
        return [rng.randrange(-5, 2**33) for _ in range(rng.randrange(0, 6))]
    if kind in (7, 8):
        return {
            rng.choice(FIELDS) if rng.random() < 0.9 else str(rng.random()): random_object(rng, depth + 1)
            for _ in range(rng.randrange(0, 8))
        }
    return [random_object(rng, depth + 1) for _ in range(rng.randrange(0, 4))]


def shaped_request(rng: random.Random) -> dict[str, Any]:
    """A map that looks like a request (right op and version) with random, inconsistent fields."""
    fields: dict[str, Any] = {"op": rng.choice(OPS), "v": 1, "id": rng.randrange(2**32)}
    for name in rng.sample(FIELDS[3:], rng.randrange(0, 6)):
        fields[name] = random_object(rng, 2)
    if rng.random() < 0.5:
        n = rng.randrange(0, MAX_KEYS + 3)
        fields["keys"] = rng.randbytes(32 * n + rng.choice([0, 0, 0, 1, 31]))
        fields["sizes"] = [rng.choice([0, 1, 100, -1, 2**40]) for _ in range(n + rng.choice([0, 0, 1, -1]))]
        fields["offsets"] = rng.choice([[], [-1] * n, [rng.randrange(-2, 2**20) for _ in range(n)]])
    return fields


def message(rng: random.Random) -> list[bytes]:
    """One fuzz message: the frames after the DEALER's identity."""
    kind = rng.randrange(12)
    if kind == 0:  # random frames
        return [rng.randbytes(rng.choice([0, 1, 5, 40, 300, 3000])) for _ in range(rng.randrange(1, 6))]
    header = encode(valid_request(rng))
    if kind == 1:  # truncated request
        return [header[: rng.randrange(0, len(header))], b""]
    if kind == 2:  # flipped bytes
        data = bytearray(header)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return [bytes(data), b"", *([rng.randbytes(10)] if rng.random() < 0.2 else [])]
    if kind == 3:  # random msgpack
        return [msgspec.msgpack.encode(random_object(rng)), b""]
    if kind == 4:  # the right shape, inconsistent contents, random payload frames
        frames = [rng.randbytes(rng.choice([0, 1, 100])) for _ in range(rng.randrange(0, 4))]
        return [msgspec.msgpack.encode(shaped_request(rng)), rng.choice([b"", rng.randbytes(32)]), *frames]
    if kind == 5:  # another version
        fields = msgspec.msgpack.decode(header)
        fields["v"] = rng.choice([0, 2, 99, -1, "1", None])
        return [msgspec.msgpack.encode(fields), b""]
    if kind == 6:  # unknown op
        fields = msgspec.msgpack.decode(header)
        fields["op"] = rng.choice(["drop_table", "", "Lookup", 7, None])
        return [msgspec.msgpack.encode(fields), b""]
    if kind == 7:  # huge declared sizes, deep nesting
        return [rng.choice([*HUGE_HEADERS, b"\x91" * 50_000 + b"\xc0", b"\x81\xa1a" * 20_000]), b""]
    if kind == 8:  # wrong frame counts: no mac, or payload frames an op does not take
        return rng.choice([[header], [header, b"", b"payload"], [b"", header]])
    if kind == 9:  # too large altogether (each frame under the limit)
        return [header, b"", *(rng.randbytes(MAX_BYTES // 2) for _ in range(3))]
    if kind == 10:  # too many keys
        return [encode(Lookup(id=3, keys=rng.randbytes(32 * (MAX_KEYS + 1)))), b""]
    # Shared-memory requests naming arenas that are not there or not arenas.
    name = rng.choice(["../../etc/passwd", "kvstack-arena-missing", "kvstack-arena-x/../../y", "", "shm"])
    if rng.random() < 0.5:
        request: Any = Get(
            id=9, keys=_key(rng), arena=name, region_offset=rng.randrange(-10, 2**40), region_size=8
        )
    else:
        request = Put(id=9, keys=_key(rng), sizes=[8], offsets=[rng.randrange(-3, 2**20)], arena=name)
    return [encode(request), b""]
