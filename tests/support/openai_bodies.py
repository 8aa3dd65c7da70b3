"""OpenAI request bodies and the serving limits the simulator's request-parsing tests check them against:
vLLM 0.32 serving the tiny model as "tiny" (max_model_len 2048, vocabulary 4096)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from kvstack.openai.errors import OpenAIError
from kvstack.sim.openai.protocol import (
    ServingLimits,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)

LIMITS = ServingLimits(served_models=("tiny",), max_model_len=2048)
VOCAB = 4096
MSG = [{"role": "user", "content": "hi"}]
Parse = Callable[..., Any]
PARSERS: dict[str, Parse] = {
    "cmpl": parse_completion_request,
    "chat": parse_chat_request,
    "tokenize": parse_tokenize_request,
    "detokenize": parse_detokenize_request,
}


def outcome(parse: Parse, body: Any, limits: ServingLimits | None = LIMITS) -> tuple[int, str, str | None]:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    with pytest.raises(OpenAIError) as info:
        parse(raw, limits)
    err = info.value
    return err.status, err.err_type, err.param


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MSG, **fields}


BAD = "Bad Request"  # FastAPI-level validation
BRE = "BadRequestError"  # vLLM's own checks
