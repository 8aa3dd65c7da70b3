"""What remote tiers (Redis, S3) share from the tier base: announcements of entries that can vanish
unseen, and the reconnector that probes a lost service with backoff."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from kvstack.cache.tiers import MemoryTier
from kvstack.cache.tiers.base import Announcements, Reconnector
from support.cache import TierRecorder, key


def test_announcements_report_a_vanished_key_once_and_stay_bounded() -> None:
    heard = TierRecorder()
    tier = MemoryTier(1 << 20)
    tier.listener = heard
    announced = Announcements(tier, limit=3)
    keys = [key(i) for i in range(5)]
    announced.stored(keys)
    assert heard.stored_keys == keys and len(announced) == 3  # only the newest three are remembered
    announced.missing([keys[0], keys[3], key(99)])  # keys[0] was forgotten; key(99) never reported
    assert heard.removed_keys == [keys[3]]
    announced.missing([keys[3]])
    assert heard.removed_keys == [keys[3]]  # reported once
    announced.removed([keys[4]])
    assert heard.removed_keys == [keys[3], keys[4]] and len(announced) == 1
    announced.clear()
    announced.missing([keys[2]])
    assert heard.removed_keys == [keys[3], keys[4]] and len(announced) == 0
    tier.listener = None
    announced.stored([key(7)])  # nobody listens: nothing to remember
    assert len(announced) == 0


async def test_reconnector_probes_with_backoff_logs_changes_once_and_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers: list[str | Exception | None] = [
        "refused",
        "refused",
        "no such bucket",
        RuntimeError("boom"),
        None,
    ]
    probed: list[float] = []
    loop = asyncio.get_running_loop()

    async def probe() -> str | None:
        probed.append(loop.time())
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    logger = logging.getLogger("kvstack.test.reconnector")
    link = Reconnector("tier t: service", probe, 0.01, 0.04, logger)
    link.start()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        link.up = True
        link.down("refused")
        link.down("refused")  # already down: not logged again, one probing task
        assert not link.up
        for _ in range(200):
            if link.up:
                break
            await asyncio.sleep(0.01)
    assert link.up and len(probed) == 5
    gaps = [b - a for a, b in itertools.pairwise(probed)]
    assert gaps[1] >= 0.015 and gaps[2] >= 0.035  # 0.01 doubling, capped at 0.04
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "tier t: service unusable (refused); serving without it, retrying every <= 0.04s",
        "tier t: service still unusable: no such bucket",
        "tier t: service still unusable: RuntimeError: boom",  # an unexpected failure is a failed probe
        "tier t: service is reachable again",
    ]
    await link.stop()
    link.down("refused")  # stopped: no new probing
    await asyncio.sleep(0.05)
    assert len(probed) == 5 and not link.up
