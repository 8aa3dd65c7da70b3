"""random-picker: a uniformly random order, ignoring scores.

Rule: shuffle the candidates; every candidate is equally likely to be the target.

Parameters: none. Cost: O(candidates).
When to use: identical engines and uniform requests, or as a baseline in benchmarks; filters still apply.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, Picker, SchedulingRequest, ScoredEngine


class RandomPicker(Picker):
    type_name: ClassVar[str] = "random-picker"

    def __init__(self, name: str | None = None, *, rng: random.Random | None = None) -> None:
        super().__init__(name)
        self.rng = rng or random.Random()

    def pick(
        self, request: SchedulingRequest, state: CycleState, scored: Sequence[ScoredEngine]
    ) -> list[EngineState]:
        order = [s.engine for s in scored]
        self.rng.shuffle(order)
        return order
