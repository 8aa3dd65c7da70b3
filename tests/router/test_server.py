"""The router's process set-up (kvstack.router.server)."""

from __future__ import annotations

import gc

from kvstack.router.server import settle_garbage_collector


def test_settling_the_collector_freezes_the_start_up_heap_and_keeps_pythons_thresholds() -> None:
    before = gc.get_threshold()
    try:
        settle_garbage_collector()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == before
    finally:
        gc.unfreeze()
