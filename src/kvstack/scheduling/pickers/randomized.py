"""The base of the pickers that draw at random: it holds their `rng`, which tests seed for a fixed order.

Not a registered picker itself: max-score-picker, power-of-two-picker, random-picker and
weighted-random-picker build on it.
"""

from __future__ import annotations

import random

from kvstack.scheduling.interfaces import Picker


class RandomizedPicker(Picker):
    """A picker with its own random source; ``rng`` None means a fresh, unseeded `random.Random`."""

    def __init__(self, name: str | None = None, *, rng: random.Random | None = None) -> None:
        super().__init__(name)
        self.rng = rng or random.Random()
