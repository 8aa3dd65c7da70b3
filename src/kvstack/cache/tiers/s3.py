"""The S3 tier: chunks in an S3 bucket (AWS or any S3-compatible store), through aiobotocore.

Objects: ``prefix + hex(chunk key)`` in ``bucket`` (prefix default ``kvstack/kv/``), each holding one
`record`, as Redis values do; an object that fails verification, or is larger than ``max_object_bytes``, is
a miss, counted in ``corrupt`` and deleted. Credentials come from the usual chain unless given explicitly.
The tier needs ``s3:ListBucket`` on the bucket and ``s3:GetObject``/``s3:PutObject``/``s3:DeleteObject``
under the prefix; the bucket must exist: the tier does not create it.

At most ``concurrency`` requests are in flight. Connection errors and timeouts mark the tier down: reads are
misses and writes are dropped without touching the network, counted, never raised, until a probe succeeds;
other errors (403, 5xx) are counted in ``errors`` and are a miss or a dropped write. ``start`` never fails on
an unreachable endpoint, a missing bucket or missing credentials: the tier starts down and says why in the
log. S3 has no per-object TTL: bound the cache with the bucket's lifecycle rules. Removals S3 makes on its
own are reported when the tier next finds a chunk it reported stored missing. `S3Tier` says what each call
costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from kvstack.cache.keys import KEY_BYTES, ChunkKey
from kvstack.cache.payload import Payload, byte_view
from kvstack.cache.tiers.base import Announcements, Reconnector, Tier, TierStats
from kvstack.cache.tiers.record import HEADER_BYTES, CorruptRecord, pack_header, payload_of
from kvstack.logs import ThrottledLog

__all__ = ["S3Tier"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_Client = Any  # aiobotocore's S3 client: its methods are generated from botocore's service model
# Errors that mean "S3 cannot be reached (or we cannot sign)": the tier goes down. Any other error is counted.
_UNREACHABLE = (
    BotoConnectionError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
    aiohttp.ClientError,
    OSError,
    asyncio.TimeoutError,
)
_DELETE_BATCH = 1000  # the most keys one DeleteObjects takes
_CHUNK_NAME = re.compile(f"[0-9a-f]{{{2 * KEY_BYTES}}}")


class _Outcome(enum.Enum):
    MISSING = 0
    """S3 answered 404."""
    FAILED = 1
    """The tier is down, or the request failed (counted)."""


_MISSING = _Outcome.MISSING
_FAILED = _Outcome.FAILED


class S3Tier(Tier):
    """Chunks as objects under ``prefix`` in ``bucket`` (see the module docstring).

    - Objects hold a `record`: a 64-byte header with magic, version, length, key and xxh3_128 of the
      payload, then the payload. Credentials: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``
      or ``profile``, ``~/.aws``, an instance or pod role, unless given explicitly. Without ``s3:ListBucket``
      S3 answers 403, not 404, for a missing key, and ``clear`` cannot list.
    - ``contains`` is a HEAD per key, ``concurrency`` at a time, in windows of ``concurrency`` consecutive
      keys; it stops after the first window with a miss, so a prompt S3 does not hold costs one window of
      HEADs (``contains_each`` goes on through every window).
    - ``get_many`` and ``put_many`` are one GET / PUT per chunk, at most ``concurrency`` requests in flight
      for the whole tier (also the size of the HTTP connection pool). A PUT's body is the header and payload
      joined (one copy: botocore takes no buffer list). botocore's own CRC checksums are off
      (``when_required``): the record's checksum already covers the bytes end to end and is verified on
      every read.
    - While the tier is down, a background task probes the bucket (``HEAD`` bucket) with exponential backoff
      (``retry_initial_s`` doubling up to ``retry_max_s``) and marks the tier up again on the first answer.
      botocore's own retries are off, so a dead endpoint costs one failed call, not a retry storm.
    - Expiry: bound the cache with lifecycle rules (e.g. expire objects under the prefix N days after
      creation); ``delete`` (the server's evict) and ``clear`` remove objects here. ``clear`` lists the
      prefix and deletes, 1,000 per request, the objects named like this tier's chunks (the prefix, then 64
      hex digits): not another tier's chunks under a longer prefix, nor anything else.
    - Removals S3 makes on its own (lifecycle expiry, another client's delete) are not pushed to the tier. As
      the Redis tier does, it reports the removal of a chunk it reported stored (the last ``max_announced``)
      when it next finds it missing (a ``contains``, a ``get_many`` or a ``delete``).
    """

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "kvstack/kv/",
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        addressing_style: str = "auto",
        concurrency: int = 16,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        retry_initial_s: float = 0.05,
        retry_max_s: float = 2.0,
        max_object_bytes: int = 256 << 20,
        max_announced: int = 65_536,
        name: str = "s3",
    ) -> None:
        if not bucket:
            raise ValueError("the S3 tier needs a bucket name")
        if endpoint_url is not None and not endpoint_url.startswith(("http://", "https://")):
            raise ValueError(f"S3 endpoint URL must start with http:// or https://, got {endpoint_url!r}")
        if (access_key_id is None) != (secret_access_key is None):
            raise ValueError("give both access_key_id and secret_access_key, or neither (the usual chain)")
        if addressing_style not in ("auto", "path", "virtual"):
            raise ValueError(f"addressing_style must be auto, path or virtual, got {addressing_style!r}")
        if concurrency < 1 or max_object_bytes <= HEADER_BYTES:
            raise ValueError(
                f"need concurrency >= 1 and max_object_bytes > {HEADER_BYTES}, got "
                f"{concurrency}, {max_object_bytes}"
            )
        if not 0 < retry_initial_s <= retry_max_s:
            raise ValueError(f"need 0 < retry_initial_s <= retry_max_s, got {retry_initial_s}, {retry_max_s}")
        self.name = name
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self._where = f"s3://{bucket}/{prefix}" + (f" at {endpoint_url}" if endpoint_url else "")
        self._region = region
        self._session = AioSession(profile=profile)
        try:  # an unknown profile or a broken ~/.aws/config is a setup error: say so now, not at start
            self._session.get_scoped_config()
        except BotoCoreError as e:
            raise ValueError(f"S3 tier: {e}") from e
        self._credentials = {
            "aws_access_key_id": access_key_id,
            "aws_secret_access_key": secret_access_key,
            "aws_session_token": session_token,
        }
        self._config = AioConfig(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"mode": "standard", "total_max_attempts": 1},
            max_pool_connections=concurrency,
            s3={"addressing_style": addressing_style},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)
        self._max_object_bytes = max_object_bytes
        self._exit = contextlib.AsyncExitStack()
        self._client: _Client | None = None
        self._announced = Announcements(self, max_announced)
        self._link = Reconnector(
            f"s3 tier {name}: {self._where}", self._probe, retry_initial_s, retry_max_s, log
        )
        self._errors_log = ThrottledLog(log)
        self._stats = TierStats(bytes=None, entries=None, capacity_bytes=None, up=False)

    @property
    def up(self) -> bool:
        return self._link.up

    # -- lifecycle

    async def start(self) -> None:
        if self._client is not None:
            return
        self._link.start()
        self._client = await self._exit.enter_async_context(
            self._session.create_client(
                "s3",
                region_name=self._region,
                endpoint_url=self.endpoint_url,
                config=self._config,
                **self._credentials,
            )
        )
        problem = await self._probe()
        if problem is None:
            self._link.up = True
        else:
            self._down(problem)

    async def close(self) -> None:
        await self._link.stop()
        self._client = None
        await self._exit.aclose()

    # -- Tier interface

    async def contains(self, keys: Sequence[bytes]) -> int:
        n = 0
        for start in range(0, len(keys), self._concurrency):
            for present in await self._heads(keys[start : start + self._concurrency]):
                if not present:
                    return n
                n += 1
        return n

    async def contains_each(self, keys: Sequence[bytes]) -> list[bool]:
        present: list[bool] = []
        for start in range(0, len(keys), self._concurrency):
            present += await self._heads(keys[start : start + self._concurrency])
        return present

    async def _heads(self, window: Sequence[bytes]) -> list[bool]:
        """One HEAD per key of ``window``, all at once: whether each key is present."""
        found = await asyncio.gather(*(self._head(key) for key in window))
        self._announced.missing(
            [key for key, present in zip(window, found, strict=True) if present is _MISSING]
        )
        return [present is True for present in found]

    async def get(self, key: ChunkKey) -> Payload | None:
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[Payload | None]:
        if not keys:
            return []
        values = await asyncio.gather(*(self._read(key) for key in keys))
        self._announced.missing([key for key, value in zip(keys, values, strict=True) if value is _MISSING])
        out: list[Payload | None] = []
        corrupt: list[ChunkKey] = []
        for key, value in zip(keys, values, strict=True):
            payload = self._unpack(key, value) if isinstance(value, bytes | CorruptRecord) else None
            if payload is None:
                self._stats.misses += 1
                if isinstance(value, bytes | CorruptRecord):
                    corrupt.append(key)
            else:
                self._stats.hits += 1
            out.append(payload)
        if corrupt:
            self._announced.removed(corrupt)
            await asyncio.gather(*(self._delete_object(key) for key in corrupt))
        return out

    async def put(self, key: ChunkKey, data: Payload) -> bool:
        return await self.put_many([(key, data)]) == 1

    async def put_many(self, items: Sequence[tuple[ChunkKey, Payload]]) -> int:
        if not items:
            return 0
        results = await asyncio.gather(*(self._write(key, data) for key, data in items))
        stored_keys = [key for (key, _), ok in zip(items, results, strict=True) if ok]
        self._announced.stored(stored_keys)
        self._stats.writes += len(stored_keys)
        self._stats.write_drops += len(items) - len(stored_keys)
        return len(stored_keys)

    async def delete(self, key: ChunkKey) -> bool:
        # DeleteObject answers 204 whether or not the key existed: a HEAD first tells which.
        present = await self._head(key)
        if present is _MISSING:
            self._announced.missing([key])
        if present is not True:
            return False
        if not await self._delete_object(key):
            return False
        self._announced.removed((key,))
        return True

    async def clear(self) -> None:

        async def delete_prefix(client: _Client) -> int:
            failed = 0
            paginator = client.get_paginator("list_objects_v2")
            batch: list[dict[str, str]] = []
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                batch += [
                    {"Key": item["Key"]} for item in page.get("Contents", ()) if self._ours(item["Key"])
                ]
                while len(batch) >= _DELETE_BATCH:
                    failed += await self._delete_objects(client, batch[:_DELETE_BATCH])
                    del batch[:_DELETE_BATCH]
            if batch:
                failed += await self._delete_objects(client, batch)
            return failed

        failed = await self._call(delete_prefix)
        if isinstance(failed, _Outcome):
            return
        if failed:
            self._stats.errors += failed
            self._errors_log.warning("s3 tier %s: clear could not delete %d objects", self.name, failed)
        self._announced.clear()

    def stats(self) -> TierStats:
        stats = self._stats.copy()
        stats.up = self._link.up
        return stats

    # -- requests

    def _key(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def _ours(self, name: str) -> bool:
        """Whether object ``name`` is a chunk of this tier: the prefix, then a key in hex and nothing else
        (not another tier's chunk under a longer prefix, nor an object someone else put there)."""
        return _CHUNK_NAME.fullmatch(name, len(self.prefix)) is not None and name.startswith(self.prefix)

    async def _head(self, key: bytes) -> bool | _Outcome:
        """True when ``key``'s object exists, else `_MISSING` or `_FAILED`."""
        name = self._key(key)
        found = await self._call(lambda c: c.head_object(Bucket=self.bucket, Key=name))
        return found if isinstance(found, _Outcome) else True

    async def _read(self, key: ChunkKey) -> bytes | CorruptRecord | _Outcome:
        name = self._key(key)

        async def get_object(client: _Client) -> bytes | CorruptRecord:
            reply = await client.get_object(Bucket=self.bucket, Key=name)
            async with reply["Body"] as body:
                size = reply.get("ContentLength", 0)
                if size > self._max_object_bytes:  # not read: memory stays bounded whatever the bucket holds
                    return CorruptRecord(f"object of {size} bytes is over max_object_bytes")
                data: bytes = await body.read()
                return data

        return await self._call(get_object)

    async def _delete_object(self, key: bytes) -> bool:
        name = self._key(key)
        deleted = await self._call(lambda c: c.delete_object(Bucket=self.bucket, Key=name))
        return not isinstance(deleted, _Outcome)

    async def _write(self, key: ChunkKey, data: Payload) -> bool:
        payload = byte_view(data)
        if HEADER_BYTES + payload.nbytes > self._max_object_bytes:
            self._errors_log.warning(
                "s3 tier %s: dropping a %d-byte chunk (max_object_bytes is %d)",
                self.name,
                payload.nbytes,
                self._max_object_bytes,
            )
            return False
        name = self._key(key)

        async def put_object(client: _Client) -> None:
            body = b"".join((pack_header(key, payload), payload))
            await client.put_object(Bucket=self.bucket, Key=name, Body=body)

        return not isinstance(await self._call(put_object), _Outcome)

    async def _delete_objects(self, client: _Client, batch: list[dict[str, str]]) -> int:
        """Delete ``batch`` in one request; how many S3 reported it could not delete."""
        reply = await client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        return len(reply.get("Errors", ()))

    def _unpack(self, key: ChunkKey, value: bytes | CorruptRecord) -> memoryview | None:
        try:
            if isinstance(value, CorruptRecord):
                raise value
            return payload_of(key, value)
        except CorruptRecord as e:
            self._stats.corrupt += 1
            log.warning("s3 tier %s: deleting corrupt object %s (%s)", self.name, self._key(key), e)
            return None

    async def _call(self, call: Callable[[_Client], Awaitable[_T]]) -> _T | _Outcome:
        """``await call(client)`` holding one of the tier's ``concurrency`` slots; `_MISSING` on a 404,
        `_FAILED` when the tier is down (without calling) or the call fails (counted, and the tier marked
        down when S3 cannot be reached)."""
        if not self._link.up or self._client is None:
            return _FAILED
        async with self._slots:
            if not self._link.up:  # went down while this call waited for a slot
                return _FAILED
            try:
                return await call(self._client)
            except ClientError as e:
                if _status(e) == 404:
                    return _MISSING
                self._stats.errors += 1
                self._errors_log.warning("s3 tier %s: %s", self.name, e)
            except _UNREACHABLE as e:
                self._mark_down(e)
            except BotoCoreError as e:
                self._stats.errors += 1
                self._errors_log.warning("s3 tier %s: %s: %s", self.name, type(e).__name__, e)
        return _FAILED

    # -- down and up

    async def _probe(self) -> str | None:
        """None when the bucket answers a HEAD, else what went wrong (with the fix where one is known)."""
        if self._client is None:
            return "closed"
        try:
            await self._client.head_bucket(Bucket=self.bucket)
        except (*_UNREACHABLE, BotoCoreError, ClientError) as e:
            return _explain(e, self.bucket)
        return None

    def _mark_down(self, error: BaseException) -> None:
        self._down(_explain(error, self.bucket))

    def _down(self, why: str) -> None:
        self._stats.errors += 1
        self._link.down(why)


def _status(error: ClientError) -> int | None:
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _explain(error: BaseException, bucket: str) -> str:
    """What went wrong, with the fix where one is known."""
    if isinstance(error, NoCredentialsError | PartialCredentialsError):
        return (
            f"{error}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / --s3-profile, "
            "or give the process a role"
        )
    if isinstance(error, ClientError):
        status = _status(error)
        if status == 404:
            return f"bucket {bucket} does not exist (create it: the tier does not create buckets)"
        if status == 403:
            return f"access to bucket {bucket} denied (the tier needs s3:ListBucket on it): {error}"
    return f"{type(error).__name__}: {error}"
