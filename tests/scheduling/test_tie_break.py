"""max-score-picker's hash tie-break and the replica presets: independent pickers order a request alike."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from kvstack.engines.state import Endpoint, EngineState, LoadSignals, MetricsReading
from kvstack.scheduling import (
    PluginConfigError,
    SchedulingRequest,
    ScoredEngine,
    build_scheduler,
    default_registry,
    preset_config,
)
from kvstack.scheduling.interfaces import CycleState, PrefixView
from kvstack.scheduling.pickers.max_score import MaxScorePicker, request_key

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def engine(
    url: str, *, queue: float = 0.0, kv: float = 0.0, in_flight: int = 0, **state: object
) -> EngineState:
    return EngineState(
        Endpoint(url, models=frozenset({"m"})),
        metrics=MetricsReading(LoadSignals(queue=queue, running=0.0, kv_usage=kv), scraped_at=0.0),
        in_flight=in_flight,
        metrics_stale=False,
        in_flight_at_scrape=in_flight,
        **state,  # type: ignore[arg-type]  # EngineState fields
    )


def tied(urls: Sequence[str] = URLS, score: float = 1.0) -> list[ScoredEngine]:
    return [ScoredEngine(engine(u), score) for u in urls]


def req(
    request_id: str = "r", *, tokens: Sequence[int] | None = None, session: str | None = None
) -> SchedulingRequest:
    return SchedulingRequest(model="m", request_id=request_id, prompt_token_ids=tokens, session_key=session)


def order(picker: MaxScorePicker, request: SchedulingRequest, scored: Sequence[ScoredEngine]) -> list[str]:
    return [e.url for e in picker.pick(request, CycleState(0.0), scored)]


def hashing() -> MaxScorePicker:
    picker = default_registry().create("max-score-picker", None, {"tieBreak": "hash"})
    assert isinstance(picker, MaxScorePicker)
    return picker


def test_tie_break_parameter_defaults_to_random_and_is_checked() -> None:
    assert MaxScorePicker.from_params(None, None).tie_break == "random"
    with pytest.raises(PluginConfigError, match="'tieBreak' must be random or hash, got 'hashed'"):
        default_registry().create("max-score-picker", None, {"tieBreak": "hashed"})
    with pytest.raises(PluginConfigError, match="'hashPrefixTokens' must be an integer >= 1"):
        default_registry().create("max-score-picker", None, {"hashPrefixTokens": 0})
    with pytest.raises(PluginConfigError, match="'tieTolerance' must be a number >= 0"):
        default_registry().create("max-score-picker", None, {"tieTolerance": -0.1})


def test_hash_ties_spread_evenly_over_engines_across_requests() -> None:
    picker = hashing()
    firsts = Counter(order(picker, req(f"req-{i}"), tied())[0] for i in range(4000))
    assert set(firsts) == set(URLS)
    assert all(850 <= n <= 1150 for n in firsts.values()), firsts  # fair share 1000 each
    # Prompts too: different first tokens spread.
    prompts = Counter(order(picker, req(tokens=[i, 7, 7, 7]), tied())[0] for i in range(4000))
    assert all(850 <= n <= 1150 for n in prompts.values()), prompts


def test_the_same_key_gives_the_same_whole_order_on_independent_pickers() -> None:
    a, b = hashing(), MaxScorePicker(tie_break="hash", rng=random.Random(99))
    shuffled = tied()
    random.Random(5).shuffle(shuffled)  # another replica may list its engines in another order
    for i in range(200):
        request = req(f"req-{i}")
        assert order(a, request, tied()) == order(b, request, shuffled) == order(a, request, tied())


def test_scores_still_dominate_and_only_ties_are_hashed() -> None:
    picker = hashing()
    scored = [ScoredEngine(engine(URLS[0]), 1.0), *tied(URLS[1:3], 2.5), ScoredEngine(engine(URLS[3]), 4.0)]
    for i in range(100):
        ranked = order(picker, req(f"req-{i}"), scored)
        assert ranked[0] == URLS[3] and set(ranked[1:3]) == {URLS[1], URLS[2]} and ranked[3] == URLS[0]


def test_a_tolerance_makes_near_ties_hash_and_leaves_real_differences_to_the_score() -> None:
    picker = MaxScorePicker(tie_break="hash", tie_tolerance=0.05)
    near = [ScoredEngine(engine(URLS[0]), 3.0), ScoredEngine(engine(URLS[1]), 2.97), *tied(URLS[2:], 2.0)]
    firsts = Counter(order(picker, req(f"req-{i}"), near)[0] for i in range(1000))
    assert set(firsts) == set(URLS[:2]) and min(firsts.values()) > 400, firsts
    for i in range(100):  # the rest keep their order by score, near ties hashed among themselves
        assert set(order(picker, req(f"req-{i}"), near)[2:]) == set(URLS[2:])
    apart = [ScoredEngine(engine(URLS[0]), 3.0), ScoredEngine(engine(URLS[1]), 2.9)]
    assert all(order(picker, req(f"req-{i}"), apart)[0] == URLS[0] for i in range(100))
    # Without a tolerance the same near tie always goes to the higher total.
    exact = MaxScorePicker(tie_break="hash")
    assert all(order(exact, req(f"req-{i}"), near)[0] == URLS[0] for i in range(100))


def test_key_is_session_then_prompt_start_then_request_id() -> None:
    tokens = list(range(300))
    same_prompt = {request_key(req(f"id-{i}", tokens=tokens)) for i in range(20)}
    assert len(same_prompt) == 1  # the prompt decides, not the id
    # Only the first hashPrefixTokens count: a conversation's later turns keep its key.
    assert request_key(req(tokens=tokens)) == request_key(req(tokens=[*tokens, 1, 2, 3]))
    assert request_key(req(tokens=tokens), 400) != request_key(req(tokens=[*tokens, 1, 2, 3]), 400)
    assert request_key(req(tokens=tokens, session="alice")) == request_key(req("x", session="alice"))
    assert request_key(req("a")) != request_key(req("b"))


def test_removing_an_engine_moves_only_the_requests_it_was_first_for() -> None:
    picker = hashing()
    moved = 0
    for i in range(1000):
        request = req(f"req-{i}")
        before = order(picker, request, tied())
        after = order(picker, request, tied(URLS[:3]))
        assert after == [u for u in before if u != URLS[3]]  # fallbacks keep their order too
        moved += before[0] == URLS[3]
    assert 200 <= moved <= 300


def test_kv_aware_replicas_ignores_replica_local_history_and_follows_the_cache() -> None:
    """Two replicas with different send histories and in-flight-free engines choose the same."""
    one, two = (build_scheduler(preset_config("kv-aware-replicas")) for _ in range(2))
    assert one.needs_prefix
    # Each replica sent recent requests to different engines; kv-aware would read that (least-qps,
    # no-hit-lru), kv-aware-replicas must not.
    seen_by_one = [
        engine(u, recent_requests=[1.0] * (i + 1), knowledge="kv-events") for i, u in enumerate(URLS)
    ]
    seen_by_two = [
        engine(u, recent_requests=[1.0] * (4 - i), knowledge="kv-events") for i, u in enumerate(URLS)
    ]
    firsts: Counter[str] = Counter()
    for i in range(400):
        cold = SchedulingRequest("m", f"r{i}", prompt_token_ids=[i, 1, 2], prefix=PrefixView(3))
        a = one.schedule(cold, seen_by_one, 10.0)
        b = two.schedule(cold, seen_by_two, 10.0)
        assert [e.url for e in a.primary.targets] == [e.url for e in b.primary.targets]
        firsts[a.target.url] += 1
    assert all(60 <= n <= 140 for n in firsts.values()), firsts  # cold prompts spread over the fleet
    warm = SchedulingRequest(
        "m", "w", prompt_token_ids=[5] * 64, prefix=PrefixView(64, {URLS[2]: (64, 64, 64, 64)})
    )
    assert one.schedule(warm, seen_by_one, 10.0).target.url == URLS[2]
    # Routing history (approximate) of an event-less engine is replica-local too: not used.
    guessed = SchedulingRequest(
        "m", "g", prompt_token_ids=[5] * 64, prefix=PrefixView(64, approximate={URLS[1]: 64})
    )
    engines = [engine(u) for u in URLS]
    picks = {
        one.schedule(guessed, engines, 10.0).target.url,
        two.schedule(guessed, engines[::-1], 10.0).target.url,
    }
    assert len(picks) == 1


def test_kv_aware_replicas_agree_when_one_scrape_caught_a_running_request() -> None:
    """One replica's latest scrape saw an engine busy with one request (some KV usage), the other not."""
    one, two = (build_scheduler(preset_config("kv-aware-replicas")) for _ in range(2))
    idle = [engine(u, knowledge="kv-events") for u in URLS]
    caught = [engine(u, knowledge="kv-events", kv=0.006 if u == URLS[0] else 0.0) for u in URLS]
    for i in range(200):
        cold = SchedulingRequest("m", f"r{i}", prompt_token_ids=[i, 1, 2], prefix=PrefixView(3))
        assert one.schedule(cold, idle, 10.0).target.url == two.schedule(cold, caught, 10.0).target.url


def test_load_still_breaks_a_prefix_tie_in_kv_aware_replicas() -> None:
    scheduler = build_scheduler(preset_config("kv-aware-replicas"))
    engines = [engine(u, knowledge="kv-events", in_flight=0 if u == URLS[1] else 2) for u in URLS]
    for i in range(50):
        cold = SchedulingRequest("m", f"r{i}", prompt_token_ids=[i], prefix=PrefixView(1))
        assert scheduler.schedule(cold, engines, 10.0).target.url == URLS[1]


def test_default_replicas_is_default_with_hash_ties() -> None:
    one, two = (build_scheduler(preset_config("default-replicas")) for _ in range(2))
    engines = [engine(u) for u in URLS]
    for i in range(100):
        request = req(f"req-{i}")
        a = one.schedule(request, engines, 0.0)
        assert [e.url for e in a.primary.targets] == [
            e.url for e in two.schedule(request, engines[::-1], 0.0).primary.targets
        ]
    busy = [engine(u, queue=3.0 if u != URLS[0] else 0.0) for u in URLS]
    assert all(one.schedule(req(f"q{i}"), busy, 0.0).target.url == URLS[0] for i in range(20))
