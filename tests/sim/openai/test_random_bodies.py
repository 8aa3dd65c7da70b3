"""Random bodies and random bytes: parsing raises nothing but `OpenAIError` (a 4xx, always encodable),
and what it accepts passes the engine checks or is refused with a 400."""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any

import msgspec

from kvstack.openai.errors import OpenAIError
from kvstack.sim.openai.protocol import ChatRequest, check_engine_input, check_lengths
from support.openai_bodies import LIMITS, MSG, PARSERS, VOCAB, chat, cmpl

_ATOMS: list[Any] = [None, True, False, 0, 1, -1, 2, 21, 5000, 2**70, -(2**64), 1.5, -0.0, 1e20, float("inf")]
_ATOMS += ["", "x", "5", "1.0", "yes", "none", "auto", "text", "user", "\ud800", "a/b"]
_KEYS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "logit_bias",
    "tools",
    "tool_choice",
    "role",
    "content",
    "name",
    "type",
    "text",
    "function",
    "include_usage",
    "continuous_usage_stats",
    "cache_salt",
    "structured_outputs",
    "response_format",
    "continue_final_message",
    "add_generation_prompt",
    "tokens",
    "prompt_embeds",
    "bad_words",
    "min_tokens",
    "allowed_token_ids",
    "tool_calls",
    "image_url",
    "truncate_prompt_tokens",
    "chat_template_kwargs",
    "logprob_token_ids",
    "use_beam_search",
    "kv_transfer_params",
    "media_io_kwargs",
    "json",
    "regex",
    "choice",
]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.55:
        return rng.choice(_ATOMS)
    if roll < 0.75:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(_KEYS): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _random_body(rng: random.Random) -> Any:
    base: dict[str, Any] = rng.choice(
        [cmpl(), chat(), {"prompt": "hi"}, {"messages": MSG}, {"tokens": [1, 2]}, {}]
    )
    body = json.loads(json.dumps(base))
    for _ in range(rng.randint(0, 5)):
        body[rng.choice(_KEYS)] = _random_value(rng)
    if rng.random() < 0.05:
        return _random_value(rng)
    return body


def _encode(rng: random.Random, body: Any) -> bytes | str:
    text = json.dumps(body, allow_nan=True)
    if rng.random() < 0.1:  # corrupt it
        cut = rng.randint(0, len(text))
        text = text[:cut] + rng.choice(["", "}", "{", ",", '"', "\\", "NaN", "\x00"]) + text[cut + 1 :]
    if rng.random() < 0.3:
        return text
    return text.encode("utf-8", "surrogatepass")


def test_random_bodies_raise_nothing_but_openai_errors() -> None:
    rng = random.Random(2024)
    accepted = 0
    for _ in range(4000):
        body = _encode(rng, _random_body(rng))
        for parse in PARSERS.values():
            for limits in (LIMITS, None):
                try:
                    req = parse(body, limits)
                except OpenAIError as err:
                    msgspec.json.decode(err.to_json())  # always encodable
                    assert 400 <= err.status < 500
                    continue
                accepted += 1
                _run_engine_checks(req)
    assert accepted > 100  # the generator also produces valid bodies


def _run_engine_checks(req: Any) -> None:
    options = getattr(req, "options", None)
    if options is None:
        return
    try:
        limit = check_lengths(
            3, options.max_tokens, 2048, chat=isinstance(req, ChatRequest), min_tokens=options.min_tokens
        )
        assert limit >= 1
        check_engine_input(options, [1, 2, 3], VOCAB)
    except OpenAIError as err:
        assert err.status == 400


def test_random_bytes_raise_nothing_but_openai_errors() -> None:
    rng = random.Random(7)
    alphabet = b'{}[]":,0123456789.-+eE truefalsnul\\\xff\xef\xbb\xbf'
    for _ in range(3000):
        body = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        for parse in PARSERS.values():
            with contextlib.suppress(OpenAIError):
                parse(body, LIMITS)
