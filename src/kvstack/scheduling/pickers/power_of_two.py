"""power-of-two-picker: sample two candidates at random and take the better scored one.

Rule: draw two distinct candidates uniformly; the one with the higher total score is the target (a tie
goes to the first drawn, itself random), the other is the first fallback, and the remaining candidates
follow by score (ties at random). With one or two candidates it is max-score. The worst-scored candidate
is never the target while another scores strictly higher: every pair that contains it also contains a
better one.

Parameters: none. Cost: O(candidates * log candidates) for the fallback order; the choice itself is O(1)
after scoring.
When to use: "power of two choices" load balancing. It follows load almost as well as max-score, but
because it only compares two random engines it does not send a whole burst to the single best-looking
engine when the scores are stale. Pair it with load scorers (the power-of-two preset).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, ScoredEngine
from kvstack.scheduling.pickers.max_score import order_by_score
from kvstack.scheduling.pickers.randomized import RandomizedPicker


class PowerOfTwoPicker(RandomizedPicker):
    type_name: ClassVar[str] = "power-of-two-picker"

    def pick(
        self, request: SchedulingRequest, state: CycleState, scored: Sequence[ScoredEngine]
    ) -> list[EngineState]:
        if len(scored) <= 2:
            return order_by_score(scored, self.rng)
        i, j = self.rng.sample(range(len(scored)), 2)
        a, b = scored[i], scored[j]
        first, second = (b, a) if b.score > a.score else (a, b)
        rest = order_by_score([s for k, s in enumerate(scored) if k != i and k != j], self.rng)
        return [first.engine, second.engine, *rest]
