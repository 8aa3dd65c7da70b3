"""The router's process set-up (kvstack.router.server)."""

from __future__ import annotations

import gc

from kvstack.router.server import YOUNG_COLLECTION_THRESHOLD, settle_garbage_collector


def test_settling_the_collector_freezes_the_start_up_heap_and_raises_the_young_threshold() -> None:
    before = gc.get_threshold()
    try:
        settle_garbage_collector()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, before[1], before[2])
        assert 700 < YOUNG_COLLECTION_THRESHOLD <= 10_000  # above Python's default, bounded for cycles
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
