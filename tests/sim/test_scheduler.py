"""The simulator's scheduler: batching limits, chunked prefill, preemption, accounting, latency model."""

from __future__ import annotations

import pytest

from kvstack.sim.kv_cache import KVCache
from kvstack.sim.scheduler import LatencyModel, Scheduler, SimRequest, Status

EOS = 0


def _sampler(req: SimRequest) -> int:
    return 7


def _req(rid: str, n_prompt: int, max_tokens: int, start: int = 100) -> SimRequest:
    return SimRequest(rid, list(range(start, start + n_prompt)), max_tokens, 0.0, eos_token_id=EOS)


def _run(s: Scheduler, limit: int = 10_000) -> list[SimRequest]:
    finished: list[SimRequest] = []
    t = 0.0
    for _ in range(limit):
        if not s.has_work:
            return finished
        out = s.step(t)
        t += out.stats.duration
        finished += out.finished
    raise AssertionError("scheduler did not drain")


def test_prefix_accounting_matches_vllm() -> None:
    s = Scheduler(KVCache(64, 16), _sampler)
    a = _req("a", 50, 4)
    s.add(a)
    _run(s)
    assert a.num_cached_tokens == 0 and a.finish_reason == "length" and len(a.output_token_ids) == 4
    b = _req("b", 50, 4)
    s.add(b)
    out = s.step(0.0)
    # 50-token prompt: full blocks of the first request cover 48 tokens; the hit is capped at 49 -> 48.
    assert out.stats.admitted == [(50, 48, 0)]
    assert b.num_cached_tokens == 48
    _run(s)
    c = _req("c", 48, 1)
    s.add(c)
    out = s.step(0.0)
    # An exact 48-token repeat must recompute its last block: only 32 tokens hit.
    assert out.stats.admitted == [(48, 32, 0)]


def test_max_num_seqs_limits_the_batch() -> None:
    s = Scheduler(KVCache(256, 16), _sampler, max_num_seqs=3)
    reqs = [_req(str(i), 20, 5, start=1000 * i) for i in range(5)]
    for r in reqs:
        s.add(r)
    s.step(0.0)
    assert len(s.running) == 3 and len(s.waiting) == 2
    done = _run(s)
    assert {r.request_id for r in done} == {str(i) for i in range(5)}


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    s = Scheduler(KVCache(256, 16), _sampler, max_num_batched_tokens=100)
    r = _req("long", 350, 2)
    s.add(r)
    outs = [s.step(0.0) for _ in range(4)]
    assert [o.stats.prefill_tokens for o in outs] == [100, 100, 100, 50]
    assert r.output_token_ids == [7]  # first token only after the whole prompt


def test_preemption_when_blocks_run_out_and_requests_still_finish() -> None:
    # 9 usable blocks of 4 tokens: two requests growing to 20 tokens each cannot both fit.
    s = Scheduler(KVCache(10, 4), _sampler)
    a, b = _req("a", 8, 12, start=0), _req("b", 8, 12, start=500)
    s.add(a)
    s.add(b)
    preempted = 0
    t = 0.0
    done: list[SimRequest] = []
    while s.has_work:
        out = s.step(t)
        t += out.stats.duration
        preempted += out.stats.preempted
        done += out.finished
    assert preempted >= 1
    assert b.num_preemptions >= 1  # the newest request yields
    assert {r.request_id for r in done} == {"a", "b"}
    assert all(len(r.output_token_ids) == 12 for r in done)
    assert s.kv.num_free_blocks == 9


def test_eos_stops_unless_ignored() -> None:
    def eos_at_3(req: SimRequest) -> int:
        return EOS if len(req.output_token_ids) == 2 else 5

    s = Scheduler(KVCache(64, 16), eos_at_3)
    stop, ignore = _req("s", 10, 10), _req("i", 10, 10, start=300)
    ignore.ignore_eos = True
    s.add(stop)
    s.add(ignore)
    _run(s)
    assert stop.finish_reason == "stop" and len(stop.output_token_ids) == 3
    assert ignore.finish_reason == "length" and len(ignore.output_token_ids) == 10


def test_abort_frees_blocks() -> None:
    s = Scheduler(KVCache(64, 16), _sampler)
    r = _req("r", 40, 100)
    s.add(r)
    s.step(0.0)
    assert s.kv.num_free_blocks < 63
    s.abort(r)
    assert r.status is Status.FINISHED and r.finish_reason == "abort"
    assert s.kv.num_free_blocks == 63 and not s.has_work


def test_remote_prefill_counts_external_tokens_and_skips_prefill_time() -> None:
    s = Scheduler(KVCache(64, 16), _sampler)
    r = _req("d", 64, 2)
    r.remote_prefill = True
    s.add(r)
    out = s.step(0.0)
    assert out.stats.admitted == [(64, 0, 63)]
    assert out.stats.prefill_tokens == 1


def test_held_blocks_survive_finish_until_released() -> None:
    s = Scheduler(KVCache(64, 16), _sampler)
    r = _req("p", 40, 1)
    r.hold_blocks_on_finish = True
    s.add(r)
    _run(s)
    assert len(s.held_blocks("p")) == 3 and s.kv.num_free_blocks == 60
    assert s.release_held("p") and s.kv.num_free_blocks == 63


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_latency_model_itl_grows_with_batch(batch: int) -> None:
    m = LatencyModel()
    assert m.step_time(0, batch, batch) > m.step_time(0, 1, 1) or batch == 1
    assert m.step_time(1000, 0, 1) > m.step_time(10, 0, 1)
