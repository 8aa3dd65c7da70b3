"""Conformance: every check runs against the simulator and against real vLLM 0.32 (CPU, tiny dummy model).

Both engines serve the same model directory (so the same tokenizer and chat template) with block size 128,
64 KV blocks, prompt-token details and KV events on. What is compared: response and chunk shapes, error
shapes, /metrics names, types and labels for the modelled set, KV events (decoded by kvstack's decoder),
prefix-cache counters and ``cached_tokens`` for one request sequence, and eviction. Differences that
remain by design are listed in docs/conformance.md.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

import openai
from kvstack.kvevents.codec import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_seq,
    encode_seq,
)
from support.engines import EngineProcess

pytestmark = pytest.mark.vllm

# Families the simulator models; each must exist in real vLLM with the same type and label names.
MODELLED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:engine_sleep_state": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:external_prefix_cache_queries": "counter",
    "vllm:external_prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:prompt_tokens_cached_by_source": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:admission_rejections": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_num_preemptions": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
}


NO_ENGINE_LABEL = {"vllm:cache_config_info": {"model_name"}, "vllm:admission_rejections": {"engine"}}


# -- helpers -----------------------------------------------------------------------------------------
def post(
    engine: EngineProcess,
    path: str,
    body: Any,
    *,
    raw: bytes | None = None,
    content_type: str = "application/json",
) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"{engine.url}{path}", data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get_text(engine: EngineProcess, path: str) -> str:
    with urllib.request.urlopen(f"{engine.url}{path}", timeout=30) as r:
        return r.read().decode()


def stream_lines(engine: EngineProcess, path: str, body: dict[str, Any]) -> list[str]:
    req = urllib.request.Request(
        f"{engine.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = r.read().decode()
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


def metric_values(engine: EngineProcess) -> dict[str, float]:
    """Counter/gauge samples keyed by name plus sorted labels (without model/engine labels)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(get_text(engine, "/metrics")):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + (json.dumps(labels, sort_keys=True) if labels else "")
            out[key] = s.value
    return out


def deltas(before: dict[str, float], after: dict[str, float], names: list[str]) -> dict[str, float]:
    return {n: after.get(n, 0.0) - before.get(n, 0.0) for n in names}


@pytest.fixture
def client(engine: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, timeout=60)


class EventTap:
    """A ZMQ SUB on an engine's KV events, decoding with kvstack's decoder."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        time.sleep(0.3)  # let the subscription reach the publisher (ZMQ slow joiner)

    def drain(self, wait: float = 0.5) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        while self.sock.poll(int(wait * 1000)):
            _topic, seq, payload = self.sock.recv_multipart()
            batch = decode_batch(payload)
            out.extend((decode_seq(seq), ev) for ev in batch.events)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def tap(engine: EngineProcess) -> Iterator[EventTap]:
    t = EventTap(engine.events_endpoint)
    yield t
    t.close()


def fresh_prompt(tag: int, n: int) -> list[int]:
    """Token ids no other test uses (keyed by ``tag``), avoiding the special ids 0-2."""
    return [3 + (tag * 7919 + i * 31) % 4000 for i in range(n)]


# -- shapes -----------------------------------------------------------------------------------------
def test_models(engine: EngineProcess) -> None:
    status, body = 200, json.loads(get_text(engine, "/v1/models"))
    assert status == 200 and body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == "tiny" and model["object"] == "model" and model["max_model_len"] == 2048
    assert set(model) == {
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    }


def test_completion_shape(engine: EngineProcess, client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length" and r.choices[0].index == 0
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == 0
    status, raw = post(engine, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert status == 200
    assert set(raw) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    }
    assert set(raw["choices"][0]) == {
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
    }
    assert set(raw["usage"]) == {
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    }


def test_completion_default_max_tokens_is_16(engine: EngineProcess) -> None:
    status, raw = post(engine, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "ignore_eos": True})
    assert status == 200 and raw["usage"]["completion_tokens"] == 16


def test_completion_n_and_batch(engine: EngineProcess) -> None:
    body = {"model": "tiny", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "n": 2, "ignore_eos": True}
    status, raw = post(engine, "/v1/completions", body)
    assert status == 200
    assert sorted(c["index"] for c in raw["choices"]) == [0, 1, 2, 3]
    assert raw["usage"]["prompt_tokens"] == 5 and raw["usage"]["completion_tokens"] == 8


def test_completion_stream(engine: EngineProcess, client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="hello world",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *token_chunks, usage_chunk = chunks
    # One chunk per token normally; vLLM merges tokens into one chunk when the client reads slowly.
    assert 1 <= len(token_chunks) <= 4
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 4
    assert usage_chunk.usage.prompt_tokens_details is not None
    lines = stream_lines(
        engine,
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True, "ignore_eos": True},
    )
    assert lines[-1] == "[DONE]"
    chunks_json = [json.loads(x) for x in lines[:-1]]
    # Without a usage chunk the terminal chunk carries the fingerprint; the others do not.
    *middle, last = chunks_json
    assert all(set(c) == {"id", "object", "created", "model", "choices"} for c in middle)
    assert set(last) == {"id", "object", "created", "model", "choices", "system_fingerprint"}
    assert set(last["choices"][0]) == {
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "prompt_token_ids",
        "token_ids",
    }
    assert all("usage" not in c for c in chunks_json)


def test_chat_shape(engine: EngineProcess, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 3
    status, raw = post(
        engine,
        "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 200
    assert set(raw) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    }
    assert set(raw["choices"][0]["message"]) >= {"role", "content", "refusal", "annotations", "reasoning"}


def test_chat_stream(engine: EngineProcess, client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    role, *tokens, usage = chunks
    assert role.choices[0].delta.role == "assistant" and role.choices[0].delta.content == ""
    assert 1 <= len(tokens) <= 3 and tokens[-1].choices[0].finish_reason == "length"
    assert usage.usage is not None and usage.usage.completion_tokens == 3 and usage.choices == []
    lines = stream_lines(
        engine,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True},
    )
    *chunks_json, _done = [json.loads(x) if x != "[DONE]" else x for x in lines]
    assert "system_fingerprint" in chunks_json[-1]
    assert all("system_fingerprint" not in c for c in chunks_json[:-1])


def test_chat_prompt_tokens_match_render_and_tokenize(engine: EngineProcess) -> None:
    messages = [
        {"role": "system", "content": "You route requests."},
        {"role": "user", "content": "Hello, cache!"},
    ]
    _, tok = post(engine, "/tokenize", {"model": "tiny", "messages": messages})
    _, render = post(engine, "/v1/chat/completions/render", {"model": "tiny", "messages": messages})
    _, chat = post(engine, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 1})
    assert render["token_ids"] == tok["tokens"]
    assert chat["usage"]["prompt_tokens"] == tok["count"] == len(tok["tokens"])


def test_tokenize_and_render_agree_across_engines(
    sim_engine: EngineProcess, vllm_engine: EngineProcess
) -> None:
    bodies = [
        ("/tokenize", {"model": "tiny", "prompt": "Prefix caching saves 1234 tokens, naïvely."}),
        ("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}]}),
        (
            "/tokenize",
            {
                "model": "tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
                "add_generation_prompt": False,
            },
        ),
        ("/v1/completions/render", {"model": "tiny", "prompt": "render me", "max_tokens": 7}),
        ("/v1/chat/completions/render", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
        ("/detokenize", {"model": "tiny", "tokens": [300, 301, 302, 1, 2]}),
    ]
    for path, body in bodies:
        s_status, s = post(sim_engine, path, body)
        v_status, v = post(vllm_engine, path, body)
        assert s_status == v_status == 200, (path, s, v)
        if "render" in path:
            s_items, v_items = (s, v) if isinstance(s, list) else ([s], [v])
            assert [i["token_ids"] for i in s_items] == [i["token_ids"] for i in v_items]
            assert [i["sampling_params"]["max_tokens"] for i in s_items] == [
                i["sampling_params"]["max_tokens"] for i in v_items
            ]
            assert set(s_items[0]) == set(v_items[0])
        else:
            assert s == v, path


# -- errors -----------------------------------------------------------------------------------------
LONG = [5] * 2100
BAD_INPUTS: list[tuple[str, str, Any, int, str | None]] = [
    # (id, path, body or raw bytes, status, param); the type is compared across engines
    ("bad-json", "/v1/completions", b'{"model": "tiny", "prompt": "x"', 400, None),
    ("not-object", "/v1/completions", [1, 2], 400, "body"),
    ("unknown-model", "/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    (
        "max-tokens-negative",
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "max_tokens": -1},
        400,
        "max_tokens",
    ),
    (
        "max-tokens-too-big",
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "max_tokens": 5000},
        400,
        "max_tokens",
    ),
    (
        "temperature",
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "temperature": -1},
        400,
        "temperature",
    ),
    ("prompt-too-long", "/v1/completions", {"model": "tiny", "prompt": LONG}, 400, "input_tokens"),
    ("token-out-of-vocab", "/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, 400, None),
    ("missing-prompt", "/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("messages-not-list", "/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "body.messages"),
    ("chat-unknown-model", "/v1/chat/completions", {"model": "nope", "messages": []}, 404, "model"),
    (
        "chat-n-zero",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0},
        400,
        None,
    ),
    (
        "chat-too-long",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "word " * 2100}]},
        400,
        "input_tokens",
    ),
]


@pytest.mark.parametrize(
    ("case", "path", "body", "status", "param"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_errors(
    engine: EngineProcess, case: str, path: str, body: Any, status: int, param: str | None
) -> None:
    raw = body if isinstance(body, bytes) else None
    got_status, got = post(engine, path, body, raw=raw)
    assert got_status == status, got
    err = got["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if case != "bad-json":  # pydantic reports a byte offset here, which has no stable meaning across parsers
        assert err["param"] == param
    assert err["type"] in ("BadRequestError", "Bad Request", "NotFoundError")


def test_error_types_agree_across_engines(sim_engine: EngineProcess, vllm_engine: EngineProcess) -> None:
    for case, path, body, _, _ in BAD_INPUTS:
        raw = body if isinstance(body, bytes) else None
        _, s = post(sim_engine, path, body, raw=raw)
        _, v = post(vllm_engine, path, body, raw=raw)
        assert s["error"]["type"] == v["error"]["type"], case


def test_non_json_content_type(engine: EngineProcess) -> None:
    status, body = post(engine, "/v1/completions", None, raw=b"prompt=x", content_type="text/plain")
    assert status == 400 and "application/json" in body["error"]["message"]


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=LONG, max_tokens=1)


# -- metrics -----------------------------------------------------------------------------------------
def test_metrics_names_types_and_labels(engine: EngineProcess) -> None:
    # Make sure histograms have observations on both engines.
    post(
        engine, "/v1/completions", {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 3, "ignore_eos": True}
    )
    families = {f.name: f for f in text_string_to_metric_families(get_text(engine, "/metrics"))}
    for name, kind in MODELLED.items():
        assert name in families, f"{engine.kind} lacks {name}"
        assert families[name].type == kind, name
        labels = set().union(*(s.labels for s in families[name].samples))
        # Two families carry no engine label in vLLM either.
        expected = {"model_name", "engine"} - NO_ENGINE_LABEL.get(name, set())
        assert expected <= labels, (name, labels)
    by_source = {s.labels["source"] for s in families["vllm:prompt_tokens_by_source"].samples}
    assert by_source == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    info = next(iter(families["vllm:cache_config_info"].samples)).labels
    assert info["block_size"] == "128" and info["num_gpu_blocks"] == "64"


def test_metric_label_sets_agree(sim_engine: EngineProcess, vllm_engine: EngineProcess) -> None:
    def labelnames(engine: EngineProcess) -> dict[str, set[str]]:
        fams = text_string_to_metric_families(get_text(engine, "/metrics"))
        return {
            f.name: set().union(*(s.labels for s in f.samples)) - {"le"} for f in fams if f.name in MODELLED
        }

    sim, real = labelnames(sim_engine), labelnames(vllm_engine)
    for name in MODELLED:
        if name == "vllm:cache_config_info":
            assert (
                sim[name] <= real[name]
            )  # vLLM exports dozens of config labels; the sim the ones routers read
        else:
            assert sim[name] == real[name], name


# -- prefix caching and KV events -----------------------------------------------------------------------
COUNTERS = [
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    'vllm:prompt_tokens_by_source_total{"source": "local_compute"}',
    'vllm:prompt_tokens_by_source_total{"source": "local_cache_hit"}',
    "vllm:prompt_tokens_total",
]


def test_prefix_counters_and_cached_tokens(engine: EngineProcess) -> None:
    p = fresh_prompt(1, 300)
    sequence = [(p, 10), (p, 10), (p[:256], 2), (p[:257], 2), (p[:100], 2)]
    # (queries, hits, local_compute, local_cache_hit, prompt_tokens) and cached_tokens, as vLLM counts them.
    expected = [
        ([300, 0, 300, 0, 300], 0),
        ([300, 256, 44, 256, 300], 256),
        ([256, 128, 128, 128, 256], 128),
        ([257, 256, 1, 256, 257], 256),
        ([100, 0, 100, 0, 100], 0),
    ]
    for (prompt, max_tokens), (want, want_cached) in zip(sequence, expected, strict=True):
        before = metric_values(engine)
        status, r = post(
            engine,
            "/v1/completions",
            {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
        )
        assert status == 200
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == want_cached
        got = deltas(before, metric_values(engine), COUNTERS)
        assert [got[c] for c in COUNTERS] == want, (engine.kind, len(prompt), got)


def test_kv_events_full_blocks_only_with_parent_chain(engine: EngineProcess, tap: EventTap) -> None:
    reset_prefix_cache(engine)  # a cache filled by earlier tests would evict (BlockRemoved) during this one
    tap.drain(0.2)
    short = fresh_prompt(2, 100)
    post(engine, "/v1/completions", {"model": "tiny", "prompt": short, "max_tokens": 2, "ignore_eos": True})
    # The reset's AllBlocksCleared comes with this step's batch (vLLM publishes once per engine step).
    after_short = [ev for _, ev in tap.drain() if ev != AllBlocksCleared()]
    assert after_short == [], "a prompt shorter than one block must produce no events"
    p = fresh_prompt(3, 300)
    post(engine, "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 5, "ignore_eos": True})
    events = [ev for _, ev in tap.drain()]
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    first = events[0]
    assert first.block_size == 128 and len(first.block_hashes) == 2
    assert first.token_ids == p[:256] and first.parent_block_hash is None
    # Extending the prompt by another full block stores exactly that block, chained to the last one.
    p2 = p + fresh_prompt(4, 100)
    post(engine, "/v1/completions", {"model": "tiny", "prompt": p2, "max_tokens": 2, "ignore_eos": True})
    events = [ev for _, ev in tap.drain()]
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    assert events[0].parent_block_hash == first.block_hashes[-1]
    assert events[0].token_ids == p2[256:384] and len(events[0].block_hashes) == 1


def test_eviction_event_streams_match(sim_engine: EngineProcess, vllm_engine: EngineProcess) -> None:
    """The same 48 requests overflow 63 blocks on both engines; the event streams must match block for block.

    Hashes differ between engines by design, so events are compared by the tokens of the blocks they name.
    """
    streams = {}
    for engine in (sim_engine, vllm_engine):
        reset_prefix_cache(engine)
        tap = EventTap(engine.events_endpoint)
        try:
            tap.drain(0.2)
            seen: dict[Any, tuple[int, ...]] = {}  # engine hash -> block tokens
            log: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
            for i in range(48):
                prompt = fresh_prompt(100 + i % 40, 300)
                status, _ = post(
                    engine,
                    "/v1/completions",
                    {"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True},
                )
                assert status == 200
                for _, ev in tap.drain(0.3):
                    if isinstance(ev, BlockStored):
                        blocks = [
                            tuple(ev.token_ids[j * 128 : (j + 1) * 128]) for j in range(len(ev.block_hashes))
                        ]
                        seen.update(zip(ev.block_hashes, blocks, strict=True))
                        log.append(("stored", tuple(blocks)))
                    elif isinstance(ev, BlockRemoved):
                        log.append(("removed", tuple(seen[h] for h in ev.block_hashes)))
            streams[engine.kind] = log
        finally:
            tap.close()
    assert any(kind == "removed" for kind, _ in streams["vllm"]), "the workload must evict"
    assert streams["sim"] == streams["vllm"]


def test_replay_returns_buffered_batches(engine: EngineProcess) -> None:
    assert engine.replay_endpoint is not None
    post(engine, "/v1/completions", {"model": "tiny", "prompt": fresh_prompt(5, 200), "max_tokens": 1})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(engine.replay_endpoint)
        sock.send_multipart([b"", encode_seq(0)])
        seqs = []
        while sock.poll(5000):
            _, _topic, seq, payload = sock.recv_multipart()
            s = decode_seq(seq)
            if s == REPLAY_END_SEQ:
                break
            decode_batch(payload)
            seqs.append(s)
        assert seqs and seqs == sorted(seqs) and seqs[0] == 0
    finally:
        sock.close(linger=0)
        ctx.term()


def test_kv_event_sources(engine: EngineProcess) -> None:
    cfg = json.loads(get_text(engine, "/kv_event_sources"))["0"]
    assert cfg["enable_kv_cache_events"] is True and cfg["publisher"] == "zmq"
    assert cfg["endpoint"].startswith("tcp://*:") and cfg["endpoint"].endswith(
        engine.events_endpoint.rsplit(":")[-1]
    )


def test_usage_gauge_returns_to_zero(engine: EngineProcess) -> None:
    post(engine, "/v1/completions", {"model": "tiny", "prompt": fresh_prompt(6, 50), "max_tokens": 2})
    time.sleep(0.2)
    assert metric_values(engine)["vllm:kv_cache_usage_perc"] == 0.0


def reset_prefix_cache(engine: EngineProcess) -> None:
    status, body = post(engine, "/reset_prefix_cache", None, raw=b"")
    assert status == 200 and body == {"success": True}


def test_all_blocks_cleared_on_reset(engine: EngineProcess, tap: EventTap) -> None:
    post(engine, "/v1/completions", {"model": "tiny", "prompt": fresh_prompt(7, 200), "max_tokens": 1})
    tap.drain(0.3)
    reset_prefix_cache(engine)
    # The cache really is empty: the same prompt hits nothing.
    _, r = post(engine, "/v1/completions", {"model": "tiny", "prompt": fresh_prompt(7, 200), "max_tokens": 1})
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # vLLM publishes events once per engine step, so the clear arrives with the next step's batch.
    events = [ev for _, ev in tap.drain()]
    assert events[0] == AllBlocksCleared()
    assert [type(ev) for ev in events[1:]] == [BlockStored]


def test_engine_input_errors_arrive_in_the_stream(engine: EngineProcess) -> None:
    """Errors found when the engine takes a request are an SSE error event after a 200 when streaming."""
    body = {"model": "tiny", "prompt": [1, 99999], "max_tokens": 2, "stream": True}
    lines = stream_lines(engine, "/v1/completions", body)
    assert lines[-1] == "[DONE]"
    err = json.loads(lines[0])["error"]
    assert err["code"] == 400 and "out of vocabulary" in err["message"]
    status, _ = post(engine, "/v1/completions", {**body, "stream": False})
    assert status == 400
