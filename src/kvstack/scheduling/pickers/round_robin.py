"""round-robin-picker: rotate through the candidates in URL order, ignoring scores.

Rule: sort the candidates by URL; the n-th decision starts at index n mod len(candidates) and the
remaining candidates follow in rotation as fallbacks. The counter belongs to the picker instance, so
each router process rotates on its own; when the candidate set changes the rotation continues over
the new list.

Parameters: none. Cost: O(candidates * log candidates) for the sort.
When to use: identical engines and uniform requests, or a predictable order for tests and debugging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, Picker, SchedulingRequest, ScoredEngine


class RoundRobinPicker(Picker):
    type_name: ClassVar[str] = "round-robin-picker"

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._next = 0

    def pick(
        self, request: SchedulingRequest, state: CycleState, scored: Sequence[ScoredEngine]
    ) -> list[EngineState]:
        order = sorted((s.engine for s in scored), key=lambda e: e.url)
        if not order:
            return order
        start = self._next % len(order)
        self._next += 1
        return order[start:] + order[:start]
