"""Response bodies in vLLM 0.32's exact shapes (field names, nulls, order), as plain dicts.

Pure functions; the server fills them in. Keeping every null field vLLM sends lets clients that
index fields (not only the OpenAI SDK) see the same documents from the simulator and from vLLM.
"""

from __future__ import annotations

import math
from typing import Any

import xxhash

SYSTEM_FINGERPRINT = "kvstack-sim"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, *, chat: bool, full: bool = True
) -> dict[str, Any]:
    """The ``usage`` object; ``cached_tokens`` None leaves prompt_tokens_details null (vLLM's default)."""
    details: dict[str, Any] | None = None
    if cached_tokens is not None:
        details = {"cached_tokens": cached_tokens}
        if full:
            details["created_cache_tokens"] = 0 if chat else None
            details["multimodal_tokens"] = None
        elif chat:
            details["created_cache_tokens"] = 0
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    }
    if full:
        out["completion_tokens_details"] = None
    return out


def fake_logprob(token_id: int, position: int) -> float:
    """A stable negative log-probability for a generated token (the simulator has no logits)."""
    h = xxhash.xxh32_intdigest(f"{token_id}:{position}".encode())
    return -round(0.05 + (h % 10_000) / 2_000.0, 6)


def top_alternatives(token_id: int, position: int, k: int, vocab_size: int) -> list[tuple[int, float]]:
    """The chosen token first, then ``k - 1`` other ids with lower log-probabilities."""
    lp = fake_logprob(token_id, position)
    out = [(token_id, lp)]
    for j in range(1, k):
        other = (token_id + j * 7919) % max(vocab_size, 1)
        out.append((other, lp - math.log1p(j)))
    return out


def completion_logprobs(
    tokens: list[tuple[int, str]], k: int, vocab_size: int, text_of: Any, start_offset: int = 0
) -> dict[str, Any]:
    """Legacy completions ``logprobs`` for (token_id, text) pairs; ``text_of`` maps id -> text."""
    offsets, token_lps, strs, tops = [], [], [], []
    offset = start_offset
    for pos, (tid, text) in enumerate(tokens):
        offsets.append(offset)
        offset += len(text)
        alts = top_alternatives(tid, pos, max(k, 1), vocab_size)
        token_lps.append(alts[0][1])
        strs.append(text)
        tops.append({text_of(a): lp for a, lp in alts[:k]} if k else None)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": strs, "top_logprobs": tops}


def chat_logprobs(
    tokens: list[tuple[int, str]], k: int, vocab_size: int, text_of: Any, start_position: int = 0
) -> dict[str, Any]:
    content = []
    for i, (tid, text) in enumerate(tokens):
        alts = top_alternatives(tid, start_position + i, max(k, 1), vocab_size)
        content.append(
            {
                "token": text,
                "logprob": alts[0][1],
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": text_of(a), "logprob": lp, "bytes": list(text_of(a).encode())}
                    for a, lp in alts[:k]
                ],
            }
        )
    return {"content": content}


def completion_choice(
    index: int, text: str, finish_reason: str | None, *, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


def completion_response(
    request_id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_obj: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage_obj,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None,
    *,
    logprobs: dict[str, Any] | None = None,
    stop_reason: str | None = None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
    }


def chat_choice(
    index: int, content: str, finish_reason: str | None, *, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        },
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }


def chat_response(
    request_id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_obj: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage_obj,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_role_chunk(request_id: str, model: str, created: int, index: int) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": None,
        "prompt_text": None,
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    content: str,
    finish_reason: str | None,
    *,
    logprobs: dict[str, Any] | None = None,
    stop_reason: str | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "delta": {"content": content},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = None
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(
    request_id: str, model: str, created: int, usage_obj: dict[str, Any], *, chat: bool
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_obj,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def models_list(names: list[str], root: str, max_model_len: int, created: int) -> dict[str, Any]:
    data = []
    for name in names:
        data.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{xxhash.xxh64_hexdigest(name.encode())}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        )
    return {"object": "list", "data": data}
