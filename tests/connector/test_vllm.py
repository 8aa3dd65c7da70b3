"""The vLLM connector against real vLLM (CPU) and a real cache server.

Engine A computes every prompt cold and saves its chunks (asynchronously: the fixture waits until they are
on the server); it is stopped, and engine B (same model, new process, empty local prefix cache) must load
them instead of computing them, and answer as A did: one prompt at a time, six at once, a prompt sharing
only a prefix with A's, and again after B restarts.

The model: the tiny model's shape with real random weights (``support.connector``).
``test_wrong_kv_changes_the_answer`` checks that this model's answers do depend on the KV it is given.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvstack.cache.events import block_hash
from kvstack.cache.keys import ChunkKey, chunk_keys
from kvstack.connector import PAGED_LAYOUT, AttentionShape, block_layout_name, kv_layout
from kvstack.kvevents.codec import BlockStored, decode_batch, decode_seq, encode_seq
from support.cache import CacheServerProcess
from support.connector import MODEL_ID, Answer, assert_close, start_connector_engine
from support.engines import EngineProcess
from support.waiting import wait_until

pytestmark = pytest.mark.vllm

CHUNK = 256  # the cache_server fixture's chunk size (connector/conftest.py)
BLOCK = 128
# What the workers report for vLLM 0.32's CPU backend, and so the namespace of the engines' chunk keys.
BLOCK_LAYOUT = block_layout_name(PAGED_LAYOUT, platform="cpu", backend="CPU_ATTN", block_size=BLOCK)
LAYOUT = kv_layout(
    MODEL_ID, AttentionShape(2, 2, 64, "bfloat16", BLOCK), block_layout=BLOCK_LAYOUT, tp_rank=0, tp_size=1
)


def prompt(seed: int, n: int = 600) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 + 3 for i in range(n)]


MAIN, CORRUPT, DOWN, SWAPPED = prompt(1), prompt(2), prompt(3), prompt(4)
SHORT = prompt(5, 200)
WHOLE = prompt(7, 512)  # exactly two chunks: all stored, so B loads all but the last token
FRESH = prompt(6)  # only ever sent to B
CONCURRENT = [prompt(10 + i, 520 + 20 * i) for i in range(6)]  # two full chunks each
SHARED = prompt(20, 400)  # a full chunk and part of the next
PREFIX_X, PREFIX_Y = SHARED + prompt(21, 300), SHARED + prompt(22, 300)
ROUND1, QUESTION = prompt(30), prompt(31, 50)  # a chat's first round: two full chunks and an 88-token tail
CHAT = [
    {"role": "system", "content": "You answer questions about the document."},
    {
        "role": "user",
        "content": " ".join(f"Section {i} of the report says the value is {i * 7 % 13}." for i in range(70)),
    },
]


def start_engine(model: Path, workdir: Path, server: str) -> EngineProcess:
    return start_connector_engine(model, workdir, server, chunk_size=CHUNK)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        result: dict[str, Any] = json.load(r)
        return result


def complete(
    engine: EngineProcess, tokens: list[int], *, max_tokens: int = 8, cache_salt: str | None = None
) -> Answer:
    """A greedy completion; a ``cache_salt`` makes the connector neither load nor save the prompt."""
    body: dict[str, Any] = {
        "model": engine.model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    reply = _post(f"{engine.url}/v1/completions", body)
    logprobs = reply["choices"][0]["logprobs"]
    return Answer(logprobs["tokens"], logprobs["top_logprobs"], reply["usage"]["prompt_tokens"])


def complete_at_once(engine: EngineProcess, prompts: list[list[int]]) -> list[Answer]:
    """The prompts sent concurrently (one batch for the engine), answers in prompt order."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda tokens: complete(engine, tokens), prompts))


def chat(engine: EngineProcess) -> Answer:
    body = {
        "model": engine.model,
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        "return_tokens_as_token_ids": True,
    }
    reply = _post(f"{engine.url}/v1/chat/completions", body)
    content = reply["choices"][0]["logprobs"]["content"]
    top = [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content]
    return Answer([c["token"] for c in content], top, reply["usage"]["prompt_tokens"])


def reset_prefix_cache(engine: EngineProcess) -> None:
    """Empty the engine's local prefix cache; vLLM refuses (``success: false``) while blocks are held."""
    for _ in range(100):
        request = urllib.request.Request(f"{engine.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=10) as r:
            if json.load(r).get("success"):
                return
        time.sleep(0.1)
    raise AssertionError(f"{engine.url} did not reset its prefix cache: blocks still held")


def metric(engine: EngineProcess, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` (a counter's ``_total``) whose labels include ``labels``."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{engine.url}/metrics has no {name} with {labels}"
    return total


def external_hits(engine: EngineProcess) -> float:
    return metric(engine, "vllm:external_prefix_cache_hits_total")


def keys(tokens: list[int]) -> list[ChunkKey]:
    return chunk_keys(tokens, LAYOUT, CHUNK)


def stored(server: CacheServerProcess, tokens: list[int]) -> int:
    """How many of the prompt's chunks, from the first, the server holds."""
    client = server.client()
    try:
        return client.lookup(keys(tokens))
    finally:
        client.close()


def wait_stored(server: CacheServerProcess, prompts: list[list[int]], within_s: float = 30.0) -> float:
    """Seconds until every full chunk of ``prompts`` is on the server (saves are asynchronous)."""
    started = time.monotonic()
    while True:
        missing = [i for i, tokens in enumerate(prompts) if stored(server, tokens) < len(keys(tokens))]
        if not missing:
            return time.monotonic() - started
        if time.monotonic() - started > within_s:
            raise AssertionError(f"prompts {missing} not saved within {within_s}s")
        time.sleep(0.05)


def stored_events(replay_endpoint: str) -> list[BlockStored]:
    """Every ``BlockStored`` the cache server published, from its replay socket."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(replay_endpoint)
        sock.send_multipart([b"", encode_seq(0)])
        events: list[BlockStored] = []
        while True:
            _, _topic, seq, payload = sock.recv_multipart()
            if decode_seq(seq) < 0:
                return events
            events += [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
    finally:
        sock.close()
        ctx.term()


@pytest.fixture(scope="module")
def cold(
    model_dir: Path, cache_server: CacheServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Engine A, with an empty store: every prompt computed cold (and its chunks saved); then stopped, so
    that at most two vLLM processes run (with the session's ``vllm_engine``)."""
    engine = start_engine(model_dir, tmp_path_factory.mktemp("vllm-a"), cache_server.endpoint)
    try:
        answers: dict[str, Any] = {
            "main": complete(engine, MAIN),
            "main-saved-s": wait_stored(cache_server, [MAIN]),
            "main-warm": complete(engine, MAIN),  # a local prefix hit: the same split as a load
            "corrupt": complete(engine, CORRUPT),
            "down": complete(engine, DOWN),
            "swapped": complete(engine, SWAPPED),
            "short": complete(engine, SHORT),
            "whole": complete(engine, WHOLE),
            "chat": chat(engine),
            "concurrent": complete_at_once(engine, CONCURRENT),
            "prefix-x": complete(engine, PREFIX_X),
            # Cold, and not saved: with a cache salt the connector leaves the prompt alone.
            "prefix-y": complete(engine, PREFIX_Y, cache_salt="cold"),
            "external_hits": external_hits(engine),
            "log": engine.log_path,
        }
        wait_stored(cache_server, [MAIN, CORRUPT, DOWN, SWAPPED, WHOLE, *CONCURRENT, PREFIX_X])
    finally:
        engine.stop()
    return answers


@pytest.fixture(scope="module")
def engine_b(
    model_dir: Path,
    cache_server: CacheServerProcess,
    cold: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcess]:
    """Engine B, on the cache server's unix socket (A uses its ZMQ endpoint: both reach the same chunks);
    ``test_the_cache_survives_an_engine_restart`` restarts it in place."""
    engine = start_engine(model_dir, tmp_path_factory.mktemp("vllm-b"), cache_server.unix_endpoint)
    engine.extra["restart"] = lambda: start_engine(
        model_dir, tmp_path_factory.mktemp("vllm-b-restarted"), cache_server.unix_endpoint
    )
    yield engine
    engine.stop()


ADAPTER_SCRIPT = """
from kvstack.connector.plan import ChunkLoad, RequestLoad, StepPlan
from kvstack.connector.vllm_v1 import KVStackConnectorMetadata
from vllm.v1.kv_cache_interface import SlidingWindowSpec

r = request("r", 1)

# A KV cache the worker cannot move (an MLA-like latent cache): it says so at start-up, and the scheduler
# half never keys or looks up anything; loads planned anyway fail (vLLM recomputes them).
scheduler, worker = connector(KVConnectorRole.SCHEDULER), connector(KVConnectorRole.WORKER)
assert scheduler.get_num_new_matched_tokens(r, 0) == (0, False)  # no namespace before the workers report
worker.register_kv_caches({name: torch.zeros(8, 128, 576, dtype=torch.bfloat16) for name in LAYERS})
report = worker.get_handshake_metadata()
assert report.block_layout is None and "MLA latent KV cache" in report.problem, report
scheduler.set_xfer_handshake_metadata({0: report})
assert scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
assert any("off (rank 0: KV cache layout [blocks,block,latent]" in line for line in LOG), LOG
load = RequestLoad("r", (ChunkLoad((b"k" * 32,), 0, (3, 4)),))
worker.bind_connector_metadata(KVStackConnectorMetadata(StepPlan(loads=[load], block_layout=CPU_LAYOUT)))
worker.start_load_kv(None)
worker.wait_for_save()
assert worker.get_block_ids_with_load_errors() == {3, 4}
assert worker.get_block_ids_with_load_errors() == set()
report = worker.build_connector_worker_meta()
assert "[blocks,block,latent]" in report.disabled, report
assert worker.build_connector_worker_meta() is None  # said once
scheduler.update_connector_output(NS(kv_connector_worker_meta=report))
assert scheduler.get_num_new_matched_tokens(r, 0) == (0, False)

# A model it cannot handle: off from the start.
sliding = SlidingWindowSpec(
    block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64
)
off = connector(KVConnectorRole.SCHEDULER, spec=sliding)
assert off.get_num_new_matched_tokens(r, 0) == (0, False)
cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
step = NS(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=cached)
assert not off.build_connector_meta(step).plan

# No server: misses, one timeout and then none while it is considered down.
down = connector(KVConnectorRole.SCHEDULER, server="tcp://127.0.0.1:9")
down.set_xfer_handshake_metadata({0: KVStackLayoutReport(CPU_LAYOUT)})
started = time.monotonic()
assert [down.get_num_new_matched_tokens(r, 0) for _ in range(20)] == [(0, False)] * 20
assert time.monotonic() - started < 5

# A configuration that cannot work: an error at start-up that says what to set.
try:
    connector(KVConnectorRole.SCHEDULER, chunk_size=200)
except ValueError as e:
    assert "multiple of vLLM's block size 128" in str(e), e
else:
    raise AssertionError("chunk_size 200 accepted")
print("OK")
"""


CONTRACT_SCRIPT = """
from kvstack.cache.client import CacheClient
from kvstack.cache.keys import chunk_keys
from kvstack.connector.vllm_v1 import KVStackWorkerReport

scheduler = connector(KVConnectorRole.SCHEDULER, timeout_s=2.0, chunk_size=256)
worker = connector(KVConnectorRole.WORKER, timeout_s=2.0, chunk_size=256)
torch.manual_seed(0)
kv = {name: torch.randn(16, 2, 128, 128).to(torch.bfloat16) for name in LAYERS}
worker.register_kv_caches(kv)
scheduler.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})  # as vLLM's engine core does
layout = kv_layout("hand-built", SHAPE, block_layout=CPU_LAYOUT, tp_rank=0, tp_size=1)
sent, acked, vllm_finished = [], {}, set()

def apply(report):
    if report is not None:
        for rid, n in report.saved.items():
            acked[rid] = acked.get(rid, 0) + n
        scheduler.update_connector_output(NS(kv_connector_worker_meta=report))

def step(new=(), finished=(), preempted=(), report_back=True):
    # One engine step in vLLM's order: the scheduler half plans, the worker runs, the report returns.
    for r, _ in new:
        assert scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
        scheduler.update_state_after_alloc(r, None, 0)
    out = NS(
        scheduled_new_reqs=[
            NS(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids, block_ids=(b,),
               num_computed_tokens=0)
            for r, b in new
        ],
        scheduled_cached_reqs=NS(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens={r.request_id: 600 for r, _ in new},
        preempted_req_ids=set(preempted),
        finished_req_ids=set(finished),
    )
    vllm_finished.update(finished)
    meta = scheduler.build_connector_meta(out)
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    sending, recving = worker.get_finished(out.finished_req_ids)
    report = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    assert recving is None and set(sending or ()) <= vllm_finished, (sending, vllm_finished)
    sent.extend(sorted(sending or ()))
    if report_back:
        apply(report)
    return meta.plan, report

def idle_until(done, within=10.0):
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, (sent, acked)
        step()
        time.sleep(0.01)
    for _ in range(3):
        step()

r1, r2, r3 = request("r1", 1), request("r2", 2), request("r3", 3)

# r1 finishes in the step that computed it: its save may still read its blocks, so vLLM keeps them
# (request_finished runs before the step's report is applied) until the worker reports it, once.
plan, report = step(new=[(r1, [0, 1, 2, 3, 4])], report_back=False)
assert len(plan.saves) == 1 and sent == []
assert scheduler.request_finished(r1, [0, 1, 2, 3, 4]) == (True, None)
apply(report)
plan, _ = step(finished={"r1"})
assert plan.held == ["r1"], plan
idle_until(lambda: "r1" in sent)
assert sent == ["r1"], sent

# Its chunks reach the server, bit for bit the blocks (gathered straight into arena regions).
with CacheClient(sys.argv[1]) as client:
    k = chunk_keys(r1.prompt_token_ids, layout, 256)
    deadline = time.monotonic() + 10
    while client.lookup(k) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with client.get(k) as got:
        for c, payload in enumerate(got):
            want = torch.stack([kv[name][[2 * c, 2 * c + 1]] for name in LAYERS])
            assert bytes(payload) == want.view(-1).view(torch.uint8).numpy().tobytes()

# r2's save is acknowledged before it finishes: its blocks are freed at once, and never reported.
step(new=[(r2, [5, 6, 7, 8, 9])])
idle_until(lambda: acked.get("r2") == 1)
assert scheduler.request_finished(r2, [5, 6, 7, 8, 9]) == (False, None)
plan, _ = step(finished={"r2"})
idle_until(lambda: True)
assert plan.held == [] and sent == ["r1"], sent

# r3 is preempted with its save in flight: the worker stops reading its blocks before the next
# forward pass (dropped if still queued); it is acknowledged either way, then finishes freely.
_, report = step(new=[(r3, [10, 11, 12, 13, 14])], report_back=False)
plan, _ = step(preempted={"r3"})
assert plan.preempted == ["r3"], plan
apply(report)
idle_until(lambda: acked.get("r3") == 1)
assert scheduler.request_finished(r3, [10, 11, 12, 13, 14]) == (False, None)

# Reports from several workers add up.
a, b = KVStackWorkerReport(None, {"x": 1}), KVStackWorkerReport("off", {"x": 1, "y": 2})
assert a.aggregate(b) == KVStackWorkerReport("off", {"x": 2, "y": 2})

started = time.monotonic()
worker.shutdown()
scheduler.shutdown()
assert time.monotonic() - started < 6
print("OK")
"""


def test_connector_faults_never_reach_vllm(run_hand_built: Callable[[str], None]) -> None:
    """The adapter built by hand (no engine): a refused layout, an unsupported model, no server, a bad
    setting."""
    run_hand_built(ADAPTER_SCRIPT)


def test_the_halves_follow_vllms_contract_for_asynchronous_saves(
    run_hand_built: Callable[[str], None],
) -> None:
    """Both halves built by hand (real torch KV, real server), stepped in vLLM's order: request_finished
    holds blocks only while a save may read them, get_finished reports each held request once, a
    preemption stops reads, the saved chunks are the blocks bit for bit."""
    run_hand_built(CONTRACT_SCRIPT)


def test_engine_a_saves_full_prompt_chunks_under_keys_anyone_can_compute(
    cold: dict[str, Any], cache_server: CacheServerProcess
) -> None:
    assert cold["external_hits"] == 0  # A started with an empty store
    assert cold["main-warm"].tokens == cold["main"].tokens
    client = cache_server.client()
    try:
        # This process computes the keys engine A used: same model id and layout, another process.
        for tokens in (MAIN, CORRUPT, DOWN, SWAPPED):
            assert client.lookup(keys(tokens)) == 2
        assert keys(SHORT) == []  # shorter than a chunk: nothing to save
    finally:
        client.close()
    # The server announces A's chunks with their tokens, for the router's prefix index.
    chunks = {h: e for e in stored_events(cache_server.replay_endpoint) for h in e.block_hashes}
    main = keys(MAIN)
    first, second = chunks[block_hash(main[0])], chunks[block_hash(main[1])]
    assert (first.parent_block_hash, first.block_size, first.medium) == (None, CHUNK, "CPU")
    if first is second:  # one event for both chunks, as vLLM batches a request's blocks
        assert first.token_ids == MAIN[: 2 * CHUNK]
    else:
        assert (first.token_ids, second.token_ids) == (MAIN[:CHUNK], MAIN[CHUNK : 2 * CHUNK])
        assert second.parent_block_hash == block_hash(main[0])
    log = cold["log"].read_text(errors="replace")
    assert "kvstack connector: 2 KV cache layers, each (64, 2, 128, 128) torch.bfloat16" in log
    assert "not saved" not in log  # no save dropped or failed
    # The worker found vLLM's CPU backend and its layout; the scheduler half got them at start-up, through
    # vLLM's handshake metadata, and keyed the chunks (the lookups above) in that namespace.
    assert f"kvstack connector: layout {BLOCK_LAYOUT}, " in log
    assert f"kvstack connector: keys of KVLayout(model='{MODEL_ID}'" in log
    assert f"block_layout='{BLOCK_LAYOUT}'" in log


def test_engine_b_loads_the_prompt_instead_of_computing_it(
    engine_b: EngineProcess, cold: dict[str, Any]
) -> None:
    before = {
        "hits": external_hits(engine_b),
        "external": metric(engine_b, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        "host": metric(engine_b, "vllm:prompt_tokens_cached_by_source_total", source="host"),
    }
    answer = complete(engine_b, MAIN)
    # 600 tokens: two stored chunks, 512 tokens; vLLM computes the remaining 88.
    assert external_hits(engine_b) - before["hits"] == 512
    assert metric(engine_b, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == (
        before["external"] + 512
    )
    assert (
        metric(engine_b, "vllm:prompt_tokens_cached_by_source_total", source="host") == before["host"] + 512
    )
    assert_close(answer, cold["main"])
    assert answer == cold["main-warm"]  # the same split as A's local prefix hit: identical to the last bit


def test_a_fully_stored_prompt_loads_into_its_last_block(
    engine_b: EngineProcess, cold: dict[str, Any]
) -> None:
    computed = metric(engine_b, "vllm:prompt_tokens_by_source_total", source="local_compute")
    before = external_hits(engine_b)
    answer = complete(engine_b, WHOLE)
    # 512 tokens, both chunks stored: 511 loaded (the last block partly), only the last token computed.
    assert external_hits(engine_b) - before == 511
    assert metric(engine_b, "vllm:prompt_tokens_by_source_total", source="local_compute") == computed + 1
    assert_close(answer, cold["whole"])


def test_concurrent_requests_each_load_their_own_chunks(
    engine_b: EngineProcess, cold: dict[str, Any]
) -> None:
    before = external_hits(engine_b)
    answers = complete_at_once(engine_b, CONCURRENT)
    assert external_hits(engine_b) - before == len(CONCURRENT) * 2 * CHUNK
    for answer, want in zip(answers, cold["concurrent"], strict=True):
        assert_close(answer, want)


def test_a_shared_prefix_loads_only_its_full_chunks(
    engine_b: EngineProcess, cold: dict[str, Any], cache_server: CacheServerProcess
) -> None:
    """A computed P+X; B gets P+Y: chunk 0 is all P (loaded), chunk 1 mixes P and X (computed)."""
    assert stored(cache_server, PREFIX_X) == 2
    assert stored(cache_server, PREFIX_Y) == 1  # A's salted P+Y saved nothing
    before = external_hits(engine_b)
    answer = complete(engine_b, PREFIX_Y)
    assert external_hits(engine_b) - before == CHUNK
    assert_close(answer, cold["prefix-y"])


def test_saves_reach_the_server_while_the_engine_runs(
    engine_b: EngineProcess, cold: dict[str, Any], cache_server: CacheServerProcess
) -> None:
    """Saves are asynchronous: the chunks of an answered prompt appear on the server shortly after, with
    the engine still running (A's first prompt did too, before A stopped).

    One output token: the request finishes in the step that computed its chunks, before the workers can
    acknowledge the save, so vLLM keeps its blocks until the worker reports it (finished_sending). The
    prefix cache can be reset only when no request holds blocks: the held blocks were freed."""
    assert cold["main-saved-s"] < 30
    assert stored(cache_server, FRESH) == 0
    complete(engine_b, FRESH, max_tokens=1)
    assert wait_stored(cache_server, [FRESH], within_s=20) < 20
    reset_prefix_cache(engine_b)
    log = engine_b.log_path.read_text(errors="replace")
    assert "finished with saves in flight; vLLM keeps its blocks" in log
    assert "not saved" not in log and "Traceback" not in log


def test_the_next_chat_round_loads_the_previous_prompts_partial_tail(
    engine_b: EngineProcess, cache_server: CacheServerProcess
) -> None:
    """Round 1 is computed and saved: its two full chunks and its 88-token tail. With the engine's prefix
    cache reset, round 2 (round 1, its answer, a question) loads both chunks and the tail, 600 tokens, past
    the last full chunk, and answers as the same prompt computed without the tier (a cache salt)."""
    first = complete(engine_b, ROUND1)
    round2 = ROUND1 + [int(t.removeprefix("token_id:")) for t in first.tokens] + QUESTION
    tail = chunk_keys(ROUND1, LAYOUT, CHUNK, include_partial=True)[-1]
    client = cache_server.client()
    try:
        wait_until(lambda: client.exists([tail]) == [True], what="round 1's tail saved", timeout_s=20)
    finally:
        client.close()
    reset_prefix_cache(engine_b)
    without_tier = complete(engine_b, round2, cache_salt="no tier")
    reset_prefix_cache(engine_b)
    hits = external_hits(engine_b)
    computed = metric(engine_b, "vllm:prompt_tokens_by_source_total", source="local_compute")
    answer = complete(engine_b, round2)
    assert external_hits(engine_b) - hits == 600  # without the tail: 512
    assert metric(engine_b, "vllm:prompt_tokens_by_source_total", source="local_compute") == (
        computed + len(round2) - 600
    )
    assert_close(answer, without_tier)
    assert "to recompute" not in engine_b.log_path.read_text(errors="replace")


def test_a_chat_prompt_is_loaded_too(engine_b: EngineProcess, cold: dict[str, Any]) -> None:
    before = external_hits(engine_b)
    answer = chat(engine_b)
    assert answer.prompt_tokens >= 2 * CHUNK
    loaded = external_hits(engine_b) - before
    assert loaded == min(answer.prompt_tokens // CHUNK * CHUNK, (answer.prompt_tokens - 1) // BLOCK * BLOCK)
    assert_close(answer, cold["chat"])


def test_a_prompt_shorter_than_a_chunk_loads_nothing(engine_b: EngineProcess, cold: dict[str, Any]) -> None:
    before = external_hits(engine_b)
    assert complete(engine_b, SHORT) == cold["short"]
    assert external_hits(engine_b) == before


def test_a_corrupt_chunk_is_recomputed(
    engine_b: EngineProcess, cold: dict[str, Any], cache_server: CacheServerProcess
) -> None:
    client = cache_server.client()
    try:
        k = keys(CORRUPT)
        assert client.evict(k[1:]) == 1 and client.put(k[1:], [b"not a chunk"], parent=k[0])
    finally:
        client.close()
    answer = complete(engine_b, CORRUPT)
    assert_close(answer, cold["corrupt"])
    assert "loaded 1 of 2 chunks; 2 blocks to recompute" in engine_b.log_path.read_text(errors="replace")
    client = cache_server.client()
    try:
        assert client.lookup(keys(CORRUPT)) == 1  # the engine evicted the chunk that cannot load
    finally:
        client.close()


def test_wrong_kv_changes_the_answer(
    engine_b: EngineProcess, cold: dict[str, Any], cache_server: CacheServerProcess
) -> None:
    """The control for the tests above: another prompt's chunks under this prompt's keys (the right size)
    change the answer, so equal answers do show that the right KV arrived."""
    client = cache_server.client()
    try:
        chunks = client.get(keys(MAIN))
        assert chunks is not None
        with chunks as other:
            payloads = [bytes(p) for p in other]
        assert len(payloads) == 2
        assert client.evict(keys(SWAPPED)) == 2 and client.put(keys(SWAPPED), payloads)
    finally:
        client.close()
    before = external_hits(engine_b)
    answer = complete(engine_b, SWAPPED)
    assert external_hits(engine_b) - before == 512
    assert answer.tokens != cold["swapped"].tokens


def test_the_cache_survives_an_engine_restart(
    engine_b: EngineProcess, cold: dict[str, Any], cache_server: CacheServerProcess
) -> None:
    """B is stopped (its process group, by PID) and started again: the new process, with an empty local
    prefix cache, loads A's chunks from the server."""
    old_pid = engine_b.proc.pid
    engine_b.stop()
    assert engine_b.proc.poll() is not None
    restart = engine_b.extra["restart"]
    assert callable(restart)
    restarted = restart()
    # In place: the module's later tests use the restarted engine (and the fixture stops it).
    vars(engine_b).update({k: v for k, v in vars(restarted).items() if k != "extra"})
    assert engine_b.proc.pid != old_pid
    assert external_hits(engine_b) == 0
    answer = complete(engine_b, MAIN)
    assert external_hits(engine_b) == 2 * CHUNK
    assert answer == cold["main-warm"]


def test_without_the_cache_server_the_engine_still_answers(
    engine_b: EngineProcess, cold: dict[str, Any], cache_server: CacheServerProcess
) -> None:
    """Runs last in this module: it stops the module's cache server."""
    cache_server.stop()
    before = external_hits(engine_b)
    reset_prefix_cache(engine_b)
    started = time.monotonic()
    answer = complete(engine_b, DOWN)
    assert time.monotonic() - started < 30
    assert answer == cold["down"]  # computed cold, as A did
    assert external_hits(engine_b) == before
    assert complete(engine_b, MAIN) == cold["main"]  # computed cold again
