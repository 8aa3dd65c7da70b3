"""Fixtures of the cache tests: a started disk tier in both of its read modes, an asyncio ZMQ context."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq.asyncio

from kvstack.cache.tiers import DiskTier


@pytest.fixture(params=["page-cache-on-loop", "threads-only"])
async def disk(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[DiskTier]:
    """A disk tier that reads cached files on the loop (the default), and one that never does."""
    inline = 16 << 20 if request.param == "page-cache-on-loop" else 0
    tier = DiskTier(tmp_path / "kv", 1 << 20, inline_read_bytes=inline)
    await tier.start()
    yield tier
    await tier.close()


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)
