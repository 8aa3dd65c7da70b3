"""The P/D benchmark's workload: long prompts with long answers among short chats, as ``kvstack.bench`` turns.

``LongAndShort`` plans ``requests`` independent single-round chat requests at ``qps`` (Poisson or uniform
arrivals). Each is long with probability ``long_share``: a prompt of ``long_prompt_len`` words (a uniform
draw in the range; one word is one token of the tiny model's tokenizer) and ``long_answer_len`` output
tokens; else a short chat of ``short_prompt_len`` words and ``short_answer_len`` tokens. Every prompt is
drawn fresh from its own seeded stream, so no two requests share a KV block and no cache hides a prefill.
A turn's ``group`` is ``LONG`` or ``SHORT``, so records can be split by kind. Pure; no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, fields

from kvstack.bench.workloads import Arrival, Turn, arrival_times, words

SHORT, LONG = 0, 1
KIND = {SHORT: "short", LONG: "long"}


@dataclass(frozen=True, kw_only=True)
class LongAndShort:
    """Independent requests, long (prompt and answer) with probability ``long_share``, else short chats."""

    requests: int
    qps: float
    long_share: float = 0.3
    long_prompt_len: tuple[int, int] = (3000, 5000)
    long_answer_len: int = 256
    short_prompt_len: tuple[int, int] = (40, 160)
    short_answer_len: int = 64
    arrival: Arrival = "poisson"
    seed: int = 0
    name: str = "long-and-short"

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests must be at least 1, got {self.requests}")
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"long_share must be within 0..1, got {self.long_share}")
        for name in ("long_prompt_len", "short_prompt_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {(lo, hi)}")

    @property
    def size(self) -> int:
        return self.requests

    def turns(self) -> Iterator[Turn]:
        times = arrival_times(self.qps, self.arrival, random.Random(f"{self.seed}:arrivals"))
        for k, t in zip(range(self.requests), times, strict=False):
            rng = random.Random(f"{self.seed}:request:{k}")
            long = rng.random() < self.long_share
            lo, hi = self.long_prompt_len if long else self.short_prompt_len
            yield Turn(
                index=k,
                arrival=t,
                session=k,
                round=0,
                last=True,
                text=words(rng, rng.randint(lo, hi)),
                max_tokens=self.long_answer_len if long else self.short_answer_len,
                group=LONG if long else SHORT,
            )

    def describe(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
