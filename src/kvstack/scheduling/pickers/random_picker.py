"""random-picker: a uniformly random order, ignoring scores.

Rule: shuffle the candidates; every candidate is equally likely to be the target.

Parameters: none. Cost: O(candidates).
When to use: identical engines and uniform requests, or as a baseline in benchmarks; filters still apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, ScoredEngine
from kvstack.scheduling.pickers.randomized import RandomizedPicker


class RandomPicker(RandomizedPicker):
    type_name: ClassVar[str] = "random-picker"

    def pick(
        self, request: SchedulingRequest, state: CycleState, scored: Sequence[ScoredEngine]
    ) -> list[EngineState]:
        order = [s.engine for s in scored]
        self.rng.shuffle(order)
        return order
