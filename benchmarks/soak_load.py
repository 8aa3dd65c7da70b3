"""The soak's client: a mix of OpenAI requests through one front end with the real ``openai`` client, each
ending in exactly one outcome.

Each request is chat or completions, streaming or not; some streams are closed by the client after a few
chunks. Outcomes: ``ok`` (a ``finish_reason`` arrived), ``error_status`` (an HTTP error whose body is an
OpenAI error object; ``error_status_malformed`` when it is not), ``error_event`` (an SSE error event),
``broken`` (the connection failed or was cut: visible to the client, but no well-formed error),
``truncated`` (the stream ended cleanly without ``finish_reason`` and without an error: silent loss),
``hung`` (nothing ended it within the deadline) and ``cancelled`` (closed by us). The client makes no retries.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import openai

MODEL = "soak-model"
OUTCOMES = (
    "ok",
    "error_status",
    "error_status_malformed",
    "error_event",
    "broken",
    "truncated",
    "hung",
    "cancelled",
)
_WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda")


@dataclass(frozen=True)
class Mix:
    """Shares of the request kinds (each drawn independently)."""

    stream_share: float = 0.7
    chat_share: float = 0.6
    cancel_share: float = 0.1  # of streams: closed by the client after 1-3 chunks
    max_tokens: tuple[int, int] = (8, 48)


@dataclass
class Tally:
    """What one front end's client saw: outcomes, HTTP error statuses, broken-error kinds, requests open."""

    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    broken_kinds: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)  # a few error messages per outcome/status
    sent: int = 0
    open: int = 0

    def example(self, key: str, text: str) -> None:
        seen = self.examples.setdefault(key, [])
        if len(seen) < 3 and text[:200] not in seen:
            seen.append(text[:200])

    def as_json(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "open_at_end": self.open,
            "outcomes": {k: self.outcomes.get(k, 0) for k in OUTCOMES},
            "error_statuses": dict(self.statuses),
            "broken_kinds": dict(self.broken_kinds),
            "examples": self.examples,
            "accounted": sum(self.outcomes.values()),
        }


def _prompt(rng: random.Random) -> str:
    # A few shared openings so that engines and the cache server see repeated prefixes.
    length = rng.choice((40, 80, 120))
    head = " ".join(_WORDS[(i * 7 + rng.randrange(3)) % len(_WORDS)] for i in range(length))
    tail = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30)))
    return f"{head} {tail}"


async def _stream(
    client: openai.AsyncOpenAI, chat: bool, kw: dict[str, Any], cancel_after: int | None
) -> str:
    if chat:
        stream: Any = await client.chat.completions.create(stream=True, **kw)
    else:
        stream = await client.completions.create(stream=True, **kw)
    finished = False
    chunks = 0
    try:
        async for chunk in stream:
            chunks += 1
            if any(c.finish_reason for c in chunk.choices):
                finished = True
            if cancel_after is not None and chunks >= cancel_after and not finished:
                return "cancelled"
    finally:
        await stream.close()
    return "ok" if finished else "truncated"


async def _plain(client: openai.AsyncOpenAI, chat: bool, kw: dict[str, Any]) -> str:
    if chat:
        resp: Any = await client.chat.completions.create(**kw)
    else:
        resp = await client.completions.create(**kw)
    return "ok" if resp.choices and all(c.finish_reason for c in resp.choices) else "truncated"


async def one_request(
    client: openai.AsyncOpenAI, rng: random.Random, mix: Mix, deadline_s: float, tally: Tally
) -> str:
    """Send one request of the mix and record its outcome in ``tally``."""
    chat = rng.random() < mix.chat_share
    stream = rng.random() < mix.stream_share
    cancel_after = rng.randint(1, 3) if stream and rng.random() < mix.cancel_share else None
    prompt = _prompt(rng)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(*mix.max_tokens)}
    if chat:
        kw["messages"] = [{"role": "user", "content": prompt}]
    else:
        kw["prompt"] = prompt
    tally.sent += 1
    tally.open += 1
    try:
        async with asyncio.timeout(deadline_s):
            if stream:
                outcome = await _stream(client, chat, kw, cancel_after)
            else:
                outcome = await _plain(client, chat, kw)
    except TimeoutError:
        outcome = "hung"
    except openai.APITimeoutError:
        outcome = "hung"
    except openai.APIStatusError as e:
        tally.statuses[str(e.status_code)] += 1
        well_formed = isinstance(e.body, dict) and isinstance(e.body.get("message"), str)
        outcome = "error_status" if well_formed else "error_status_malformed"
        tally.example(str(e.status_code), str(e.body))
    except openai.APIConnectionError as e:
        outcome = "broken"
        tally.broken_kinds[type(e.__cause__ or e).__name__] += 1
        tally.example("broken", repr(e.__cause__ or e))
    except openai.APIError as e:
        outcome = "error_event"  # the SSE stream carried {"error": ...}
        tally.example("error_event", str(e.body))
    except Exception as e:  # a transport error raised mid-stream by the HTTP client
        outcome = "broken"
        tally.broken_kinds[type(e).__name__] += 1
        tally.example("broken", repr(e))
    finally:
        tally.open -= 1
    tally.outcomes[outcome] += 1
    return outcome


async def drive(
    base_url: str,
    stop: asyncio.Event,
    tally: Tally,
    *,
    concurrency: int,
    seed: int,
    mix: Mix = Mix(),
    deadline_s: float = 60.0,
    think_s: float = 0.05,
) -> None:
    """``concurrency`` users sending the mix to ``base_url`` (``http://host:port/v1``) until ``stop``."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="soak", max_retries=0, timeout=deadline_s + 30)

    async def user(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while not stop.is_set():
            await one_request(client, rng, mix, deadline_s, tally)
            await asyncio.sleep(rng.uniform(0, 2 * think_s))

    try:
        await asyncio.gather(*(user(i) for i in range(concurrency)))
    finally:
        await client.close()
