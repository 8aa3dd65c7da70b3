"""The S3 tier against moto's S3 server over HTTP, through the real aiobotocore client: round trips, bounded
concurrency, lookups in windows, corruption, prefixes, events, the endpoint going away and coming back while
a cache server keeps serving, write-behind drops, and ``kvstack cache-server --s3-bucket`` promoting a chunk
memory evicted.

moto's server runs as ``python -m moto.server`` on a free 127.0.0.1 port, stopped by PID; restarted on the
same port it holds nothing (not even the bucket), as a fresh S3-compatible server would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiobotocore.session import AioSession
from blake3 import blake3
from botocore.exceptions import ClientError

from kvstack.cache import ChunkKey, TieredStore
from kvstack.cache.client import AsyncCacheClient
from kvstack.cache.events import medium_of
from kvstack.cache.server import CacheServer
from kvstack.cache.tiers import MemoryTier
from kvstack.cache.tiers.record import HEADER_BYTES
from kvstack.cache.tiers.s3 import S3Tier
from support.cache import TierRecorder
from support.metrics import samples
from support.ports import free_port
from support.processes import spawn, stop_group
from support.waiting import eventually

BUCKET = "kvstack-test"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def key(i: int) -> ChunkKey:
    return ChunkKey(blake3(b"s3-test" + str(i).encode()).digest())


def payload(i: int, size: int = 3000) -> bytes:
    return blake3(b"payload" + str(i).encode()).digest(length=size)


class MotoServer:
    """moto's S3 server in a process of its own, on a fixed port, that can be stopped and started again."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = spawn(cmd, self.workdir / "moto.log")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=1) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        tail = (self.workdir / "moto.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"moto server on port {self.port} did not answer; its log ends:\n{tail}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, timeout_s=10)


def client_for(moto: MotoServer) -> Any:
    """A plain aiobotocore S3 client (an async context manager), to look at and tamper with the bucket."""
    return AioSession().create_client("s3", region_name="us-east-1", endpoint_url=moto.url, **CREDENTIALS)


async def create_bucket(moto: MotoServer) -> None:
    async with client_for(moto) as s3:
        with contextlib.suppress(ClientError):  # already there
            await s3.create_bucket(Bucket=BUCKET)


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def raw(moto: MotoServer) -> AsyncIterator[Any]:
    await create_bucket(moto)
    async with client_for(moto) as s3:
        yield s3


def s3_tier(moto: MotoServer, prefix: str, **kwargs: Any) -> S3Tier:
    return S3Tier(
        BUCKET,
        prefix=prefix,
        endpoint_url=moto.url,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        **kwargs,
    )


@pytest.fixture
async def tier(moto: MotoServer, raw: Any, request: pytest.FixtureRequest) -> AsyncIterator[S3Tier]:
    tier = s3_tier(moto, f"t/{request.node.name}/")
    await tier.start()
    assert tier.up
    yield tier
    await tier.clear()
    await tier.close()


async def read_object(s3: Any, name: str) -> bytes:
    reply = await s3.get_object(Bucket=BUCKET, Key=name)
    async with reply["Body"] as body:
        data: bytes = await body.read()
        return data


async def object_exists(s3: Any, name: str) -> bool:
    try:
        await s3.head_object(Bucket=BUCKET, Key=name)
    except ClientError as e:
        if e.response["ResponseMetadata"]["HTTPStatusCode"] == 404:
            return False
        raise
    return True


def count_requests(tier: S3Tier, operation: str) -> list[int]:
    """A one-element counter of ``operation`` requests the tier sends (botocore's before-send event)."""
    sent = [0]

    def before_send(**kwargs: Any) -> None:
        sent[0] += 1

    assert tier._client is not None  # the tier's own client, once started
    tier._client.meta.events.register(f"before-send.s3.{operation}", before_send)
    return sent


# -- the tier


async def test_round_trip_contains_delete_and_stats(tier: S3Tier, raw: Any) -> None:
    assert await tier.put(key(1), payload(1))
    got = await tier.get(key(1))
    assert got is not None and bytes(got) == payload(1)
    assert await tier.get(key(2)) is None
    stored = await read_object(raw, f"{tier.prefix}{key(1).hex()}")
    assert len(stored) == HEADER_BYTES + 3000 and stored[:4] == b"KVSC"  # the same record as Redis values
    assert await tier.contains([key(1), key(2)]) == 1 and await tier.contains([]) == 0
    assert await tier.delete(key(1)) and not await tier.delete(key(1))
    assert not await object_exists(raw, f"{tier.prefix}{key(1).hex()}")
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.writes, stats.errors, stats.up) == (1, 1, 1, 0, True)
    assert stats.bytes is None and stats.entries is None  # the bucket holds the bytes: the tier does not know


async def test_multi_put_get_and_lookups_in_windows(moto: MotoServer, raw: Any) -> None:
    tier = s3_tier(moto, "windows/", concurrency=4)
    await tier.start()
    items = [(key(i), memoryview(payload(i, 500 + i))) for i in range(11)]
    assert await tier.put_many(items) == 11
    got = await tier.get_many([key(i) for i in range(5)] + [key(99)] + [key(i) for i in range(5, 11)])
    assert got[5] is None
    assert [bytes(g or b"") for g in got[:5] + got[6:]] == [bytes(data) for _, data in items]
    assert await tier.contains([key(i) for i in range(11)]) == 11
    heads = count_requests(tier, "HeadObject")
    # A miss in the first window of 4: that window is asked, the 8 keys after it are not.
    assert await tier.contains([key(0), key(99)] + [key(i) for i in range(1, 11)]) == 1
    assert heads[0] == 4
    heads[0] = 0
    assert await tier.contains([key(i) for i in range(6)] + [key(99), key(7)]) == 6  # windows of 4, 4
    assert heads[0] == 8
    await tier.clear()
    await tier.close()


async def test_requests_in_flight_are_bounded_by_concurrency(moto: MotoServer, raw: Any) -> None:
    tier = s3_tier(moto, "bounded/", concurrency=3)
    await tier.start()
    assert await tier.put_many([(key(i), payload(i)) for i in range(10)]) == 10
    waiting = 0
    most = 0
    gate = asyncio.Event()

    async def hold(**kwargs: Any) -> None:  # every GET waits here, before it is sent, until the gate opens
        nonlocal waiting, most
        waiting += 1
        most = max(most, waiting)
        await gate.wait()
        waiting -= 1

    assert tier._client is not None
    tier._client.meta.events.register("before-send.s3.GetObject", hold)
    reading = asyncio.create_task(tier.get_many([key(i) for i in range(10)]))

    async def three_held() -> bool:
        return waiting >= 3

    await eventually(three_held, timeout_s=20, interval_s=0.05)
    for _ in range(20):  # give the 7 others every chance to get past the tier's bound
        await asyncio.sleep(0.01)
    assert waiting == 3 and not reading.done()
    gate.set()
    got = await reading
    assert [bytes(g or b"") for g in got] == [payload(i) for i in range(10)]
    assert most == 3
    await tier.clear()
    await tier.close()


async def test_flipped_bytes_and_oversized_objects_are_a_miss_deleted_and_counted(
    moto: MotoServer, tier: S3Tier, raw: Any
) -> None:
    for i, offset in enumerate([HEADER_BYTES + 1234, 10, 30, 60]):  # payload, length, key, checksum
        await tier.put(key(i), payload(i))
        name = f"{tier.prefix}{key(i).hex()}"
        value = bytearray(await read_object(raw, name))
        value[offset] ^= 0x40
        await raw.put_object(Bucket=BUCKET, Key=name, Body=bytes(value))
    name = f"{tier.prefix}{key(4).hex()}"
    await tier.put(key(4), payload(4))
    await raw.put_object(Bucket=BUCKET, Key=name, Body=(await read_object(raw, name))[:-1])  # truncated
    got = await tier.get_many([key(i) for i in range(5)])
    assert got == [None] * 5
    assert tier.stats().corrupt == 5 and tier.stats().misses == 5
    for i in range(5):
        assert not await object_exists(raw, f"{tier.prefix}{key(i).hex()}")
    # An object larger than the tier accepts is not read at all.
    small = s3_tier(moto, tier.prefix, max_object_bytes=HEADER_BYTES + 1000)
    await small.start()
    assert await tier.put(key(5), payload(5, 2000)) and not await small.put(key(6), payload(6, 2000))
    assert await small.get(key(5)) is None
    assert small.stats().corrupt == 1 and small.stats().write_drops == 1
    assert not await object_exists(raw, f"{tier.prefix}{key(5).hex()}")
    await small.close()


async def test_prefixes_isolate_tiers_and_clear_deletes_only_its_own_chunks(
    moto: MotoServer, raw: Any
) -> None:
    a = s3_tier(moto, "iso/a/")
    b = s3_tier(moto, "iso/a/b/")  # inside a's prefix: a's clear must leave b's chunks alone
    for t in (a, b):
        await t.start()
    await raw.put_object(Bucket=BUCKET, Key="iso/a/notes.txt", Body=b"not a chunk")
    assert await a.put(key(1), payload(1))
    assert await b.get(key(1)) is None and await b.contains([key(1)]) == 0
    assert await b.put(key(1), payload(2))
    await a.clear()
    assert await a.get(key(1)) is None
    assert bytes(await b.get(key(1)) or b"") == payload(2)
    assert await object_exists(raw, "iso/a/notes.txt")
    await b.clear()
    assert await b.get(key(1)) is None
    await raw.delete_object(Bucket=BUCKET, Key="iso/a/notes.txt")
    for t in (a, b):
        await t.close()


async def test_events_for_stored_deleted_corrupt_and_vanished_chunks(tier: S3Tier, raw: Any) -> None:
    heard = TierRecorder()
    tier.listener = heard
    assert await tier.put_many([(key(i), payload(i)) for i in range(5)]) == 5
    assert heard.stored_keys == [key(i) for i in range(5)]
    # Lifecycle expiry or another client removes objects: nothing tells the tier...
    await raw.delete_object(Bucket=BUCKET, Key=f"{tier.prefix}{key(1).hex()}")
    await raw.delete_object(Bucket=BUCKET, Key=f"{tier.prefix}{key(2).hex()}")
    assert heard.removed_keys == []
    # ...until a lookup or a get finds them missing; keys it never reported stored are not reported.
    assert await tier.contains([key(0), key(1), key(9)]) == 1
    assert heard.removed_keys == [key(1)]
    got = await tier.get_many([key(2), key(3), key(8)])
    assert got[0] is None and got[1] is not None and got[2] is None
    assert heard.removed_keys == [key(1), key(2)]
    assert await tier.contains([key(1), key(2)]) == 0 and heard.removed_keys == [key(1), key(2)]  # once
    assert await tier.delete(key(3)) and heard.removed_keys == [key(1), key(2), key(3)]
    await raw.put_object(Bucket=BUCKET, Key=f"{tier.prefix}{key(4).hex()}", Body=b"garbage")
    assert await tier.get(key(4)) is None and heard.removed_keys[-1] == key(4)


async def test_unreachable_endpoint_at_start_is_down_not_an_error() -> None:
    tier = S3Tier(
        BUCKET,
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        region="us-east-1",
        retry_initial_s=0.05,
        retry_max_s=0.1,
        access_key_id="testing",
        secret_access_key="testing",
    )
    await tier.start()
    assert not tier.up
    assert await tier.get(key(1)) is None and await tier.contains([key(1)]) == 0
    assert not await tier.put(key(1), b"x") and not await tier.delete(key(1))
    await tier.clear()
    stats = tier.stats()
    assert stats.misses == 1 and stats.write_drops == 1 and stats.errors >= 1 and not stats.up
    await tier.close()


async def test_a_missing_bucket_keeps_the_tier_down_until_it_exists(moto: MotoServer, raw: Any) -> None:
    tier = S3Tier(
        "kvstack-later",
        endpoint_url=moto.url,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        retry_initial_s=0.05,
        retry_max_s=0.2,
    )
    await tier.start()
    assert not tier.up and not await tier.put(key(1), payload(1))
    await raw.create_bucket(Bucket="kvstack-later")

    async def up() -> bool:
        return tier.up

    await eventually(up, timeout_s=20, interval_s=0.05)
    assert await tier.put(key(1), payload(1)) and bytes(await tier.get(key(1)) or b"") == payload(1)
    await tier.clear()
    await tier.close()
    await raw.delete_bucket(Bucket="kvstack-later")


def test_bad_settings_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="bucket"):
        S3Tier("")
    with pytest.raises(ValueError, match="http:// or https://"):
        S3Tier(BUCKET, endpoint_url="127.0.0.1:9000")
    with pytest.raises(ValueError, match="both"):
        S3Tier(BUCKET, access_key_id="only-the-id")
    with pytest.raises(ValueError, match="profile"):
        S3Tier(BUCKET, profile="kvstack-no-such-profile")


def test_cache_server_options_put_s3_after_the_other_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvstack.cache.cli import _tiers, add_cache_server_parser, main

    parser = argparse.ArgumentParser()
    add_cache_server_parser(parser.add_subparsers())
    disk_and_redis = ["--disk-dir", str(tmp_path), "--redis-url", "redis://127.0.0.1:1/0"]
    s3_options = ["--s3-bucket", BUCKET, "--s3-prefix", "p/", "--s3-endpoint-url", "http://127.0.0.1:1"]
    args = parser.parse_args(["cache-server", *disk_and_redis, *s3_options])
    tiers = _tiers(args)
    assert [t.name for t in tiers] == ["memory", "disk", "redis", "s3"]
    s3 = tiers[-1]
    assert isinstance(s3, S3Tier) and (s3.bucket, s3.prefix, s3.endpoint_url) == (
        BUCKET,
        "p/",
        "http://127.0.0.1:1",
    )
    assert medium_of(s3) == "REMOTE"  # its admit/evict events carry the remote medium, as Redis's do
    assert main(["cache-server", "--s3-bucket", BUCKET, "--s3-endpoint-url", "127.0.0.1:9000"]) == 2
    assert "http:// or https://" in capsys.readouterr().err
    assert main(["cache-server", "--s3-bucket", BUCKET, "--s3-concurrency", "0"]) == 2


async def test_bounded_write_queue_drops_and_counts_when_full(moto: MotoServer, raw: Any) -> None:
    remote = s3_tier(moto, "queue/")
    store = TieredStore([MemoryTier(1 << 20), remote], write_queue_size=2)
    await store.start()
    keys = [key(i) for i in range(5)]
    assert store.put(keys, [payload(i) for i in range(5)]) == 5  # never awaits: the writer has not run yet
    assert store.stats().queue_drops == {"s3": 3} and store.stats().queued == {"s3": 2}
    await store.flush()
    assert await remote.contains(keys) == 2 and await remote.contains(keys[2:3]) == 0
    assert remote.stats().writes == 2
    await remote.clear()
    await store.stop()


# -- behind a cache server


async def test_s3_stopped_mid_run_server_keeps_serving_then_recovers(moto: MotoServer, raw: Any) -> None:
    remote = s3_tier(moto, "restart/", retry_initial_s=0.02, retry_max_s=0.2)
    store = TieredStore([MemoryTier(16 << 20), remote])
    await store.start()
    server = CacheServer(store, "tcp://127.0.0.1:0", http_port=0, node="s3-node")
    await server.start()
    metrics_url = f"http://127.0.0.1:{server.http_port}/metrics"
    keys = [key(i) for i in range(4)]
    async with (
        AsyncCacheClient(server.endpoint or "", timeout_s=10) as client,
        aiohttp.ClientSession() as http,
    ):

        async def scrape() -> dict[str, float]:
            async with http.get(metrics_url) as reply:
                return samples(await reply.text())

        try:
            assert await client.put(keys, [payload(i) for i in range(4)])
            await store.flush()
            assert await remote.contains(keys) == 4
            moto.stop()
            # A lookup past what memory holds reaches S3 and finds it gone.
            assert await client.lookup([*keys, key(100)]) == 4
            assert not remote.up
            chunks = await client.get(keys)  # served by memory
            assert chunks is not None and [bytes(c) for c in chunks] == [payload(i) for i in range(4)]
            chunks.release()
            assert await client.put([key(10)], [payload(10)])
            await store.flush()
            assert remote.stats().write_drops == 1  # dropped and counted while down, never raised
            down = await scrape()
            assert down["kvstack_cache_tier_up{tier=s3}"] == 0
            assert down["kvstack_cache_tier_errors_total{tier=s3}"] >= 1
            assert down["kvstack_cache_write_drops_total{tier=s3}"] == 1
        finally:
            await asyncio.to_thread(moto.start)
        await create_bucket(moto)  # a fresh server holds nothing, not even the bucket

        async def back_up() -> bool:
            return (await scrape())["kvstack_cache_tier_up{tier=s3}"] == 1

        await eventually(back_up, timeout_s=20, interval_s=0.05)
        assert await client.put([key(20)], [payload(20)])
        await store.flush()
        assert await object_exists(raw, f"restart/{key(20).hex()}")
        assert bytes(await remote.get(key(20)) or b"") == payload(20)
    await server.stop()
    await remote.clear()
    await store.stop()


def start_cache_server(moto: MotoServer, port: int, http_port: int, memory_bytes: int, workdir: Path) -> Any:
    """``kvstack cache-server`` with memory and S3 tiers, in a process of its own (credentials from env)."""
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_CONFIG_FILE": str(workdir / "no-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "no-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    cmd = [
        sys.executable,
        "-m",
        "kvstack.cache.cli",
        "cache-server",
        "--bind",
        f"tcp://127.0.0.1:{port}",
        "--memory-gb",
        str(memory_bytes / (1 << 30)),
        "--s3-bucket",
        BUCKET,
        "--s3-endpoint-url",
        moto.url,
        "--s3-region",
        "us-east-1",
        "--s3-prefix",
        "cli/",
        "--http-port",
        str(http_port),
        "--log-level",
        "warning",
    ]
    return spawn(cmd, workdir / "server.log", env=env)


async def test_cache_server_command_promotes_a_chunk_memory_evicted_from_s3(
    moto: MotoServer, raw: Any, tmp_path: Path
) -> None:
    size = 64 << 10
    port, http_port = free_port(), free_port()
    proc = start_cache_server(moto, port, http_port, int(3.5 * size), tmp_path)  # memory for three chunks
    log = tmp_path / "server.log"
    keys = [key(i) for i in range(6)]
    try:
        async with (
            AsyncCacheClient(f"tcp://127.0.0.1:{port}", timeout_s=10) as client,
            aiohttp.ClientSession() as http,
        ):

            async def scrape() -> dict[str, float]:
                try:
                    async with http.get(f"http://127.0.0.1:{http_port}/metrics") as reply:
                        return samples(await reply.text())
                except aiohttp.ClientError:
                    assert proc.poll() is None, log.read_text()
                    return {}

            async def serving() -> bool:
                return (await scrape()).get("kvstack_cache_tier_up{tier=s3}") == 1

            await eventually(serving, timeout_s=60, interval_s=0.05)
            for i, k in enumerate(keys):
                # One at a time: a chunk queued for S3 holds its memory pages until written.
                assert await client.put([k], [payload(i, size)])

                async def in_s3(name: str = f"cli/{k.hex()}") -> bool:
                    return await object_exists(raw, name)

                await eventually(in_s3, timeout_s=20, interval_s=0.05)
            before = await scrape()
            assert before["kvstack_cache_entries{tier=memory}"] == 3
            assert before["kvstack_cache_evictions_total{tier=memory}"] == 3
            assert await client.lookup(keys) == 6  # chunks 0-2 from S3, 3-5 from memory
            chunks = await client.get(keys[:1])
            assert chunks is not None and [bytes(c) for c in chunks] == [payload(0, size)]
            chunks.release()
            after = await scrape()
            assert after["kvstack_cache_promotions_total"] == before["kvstack_cache_promotions_total"] + 1
            assert (
                after["kvstack_cache_hits_total{tier=s3}"] == before["kvstack_cache_hits_total{tier=s3}"] + 1
            )
            assert await client.locate(keys[:1]) == ["memory"]  # promoted
            chunks = await client.get(keys)
            assert chunks is not None and [bytes(c) for c in chunks] == [payload(i, size) for i in range(6)]
            chunks.release()
            assert await client.clear()
    finally:
        stop_group(proc, timeout_s=15)
    assert proc.returncode == 0, log.read_text()
    assert not await object_exists(raw, f"cli/{keys[0].hex()}")  # the server's clear emptied the prefix
