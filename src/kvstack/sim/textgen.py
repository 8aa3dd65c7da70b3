"""Deterministic "model output" for the simulated engine.

Each output token is a pure function of (engine seed, the request's sample key, position), so a
greedy request (temperature 0) gives the same text for the same prompt on every run and every
engine with the same seed, and a request ``seed`` reproduces sampled output, as on vLLM.
Tokens are drawn from ids that decode to clean printable text on their own, so streamed deltas
concatenate to exactly the final text. The request stops at EOS after its natural length.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from kvstack.engines.tokenizer import Tokenizer
    from kvstack.sim.scheduler import SimRequest


def printable_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids whose text is printable ASCII and not a special token, in id order."""
    ids: list[int] = []
    for tid in range(tokenizer.vocab_size):
        try:
            text = tokenizer.token_str(tid)
        except (ValueError, IndexError, KeyError):
            continue
        if (
            text
            and text.isascii()
            and text.isprintable()
            and not (text.startswith("<|") and text.endswith("|>"))
        ):
            ids.append(tid)
    if not ids:
        raise ValueError(f"tokenizer {tokenizer.name} has no printable tokens to generate")
    return ids


class OutputSampler:
    """Chooses each output token of a request deterministically."""

    def __init__(self, tokenizer: Tokenizer, *, seed: int = 0, mean_output_len: int = 128) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        self.mean_output_len = mean_output_len
        self._ids = printable_token_ids(tokenizer)
        self._texts = {tid: tokenizer.token_str(tid) for tid in self._ids}

    def sample_key(self, prompt_token_ids: Sequence[int], *, temperature: float, seed: int | None) -> int:
        """The key that fixes a request's output: the prompt when greedy, else the request seed or chance."""
        if seed is not None:
            return xxhash.xxh3_64_intdigest(seed.to_bytes(8, "big", signed=True), seed=self.seed)
        if temperature == 0.0:
            data = b"".join(t.to_bytes(4, "big", signed=True) for t in prompt_token_ids)
            return xxhash.xxh3_64_intdigest(data, seed=self.seed)
        return random.getrandbits(64)

    def natural_len(self, key: int) -> int:
        """How many tokens the request writes before EOS: geometric around the configured mean."""
        rng = random.Random(key ^ 0x5EED)
        return max(1, min(int(rng.expovariate(1.0 / self.mean_output_len)) + 1, 16 * self.mean_output_len))

    def __call__(self, req: SimRequest) -> int:
        pos = len(req.output_token_ids)
        if (
            req.eos_token_id is not None
            and not req.ignore_eos
            and req.natural_len is not None
            and pos + 1 >= max(req.natural_len, req.min_tokens)
        ):
            return req.eos_token_id
        h = xxhash.xxh3_64_intdigest(pos.to_bytes(4, "big"), seed=req.sample_key)
        return self._ids[h % len(self._ids)]

    def text(self, token_id: int) -> str:
        """Text of a generated token ('' for EOS and other specials)."""
        return self._texts.get(token_id, "")
