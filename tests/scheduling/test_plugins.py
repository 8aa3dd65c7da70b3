"""Each scheduling plugin on hand-made engine states: its formula, its parameters, unknown load never idle."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest
from multidict import CIMultiDict

from kvstack.engines.state import CircuitState, Endpoint, EngineState, LoadSignals, MetricsReading
from kvstack.scheduling import (
    CycleState,
    PluginConfigError,
    SchedulingRequest,
    ScoredEngine,
    Scorer,
    default_registry,
    extract_session_key,
)
from kvstack.scheduling.filters.health import HealthFilter
from kvstack.scheduling.filters.model import ModelFilter
from kvstack.scheduling.filters.saturation import SaturationFilter
from kvstack.scheduling.pickers.max_score import MaxScorePicker
from kvstack.scheduling.pickers.power_of_two import PowerOfTwoPicker
from kvstack.scheduling.pickers.random_picker import RandomPicker
from kvstack.scheduling.pickers.round_robin import RoundRobinPicker
from kvstack.scheduling.pickers.weighted_random import WeightedRandomPicker
from kvstack.scheduling.scorers.active_requests import ActiveRequestsScorer
from kvstack.scheduling.scorers.kv_utilization import KVCacheUtilizationScorer
from kvstack.scheduling.scorers.least_qps import LeastQPSScorer
from kvstack.scheduling.scorers.load_aware import LoadAwareScorer
from kvstack.scheduling.scorers.queue import QueueScorer
from kvstack.scheduling.scorers.running import RunningRequestsScorer
from kvstack.scheduling.scorers.session_affinity import SessionAffinityScorer

REQ = SchedulingRequest(model="m", request_id="r")


def engine(
    url: str,
    *,
    queue: float | None = 0.0,
    running: float | None = 0.0,
    kv: float | None = 0.0,
    stale: bool = False,
    scraped: bool = True,
    models: Sequence[str] = ("m",),
    in_flight: int = 0,
    healthy: bool = True,
    draining: bool = False,
    circuit: CircuitState = CircuitState.CLOSED,
    recent: Sequence[float] = (),
) -> EngineState:
    metrics = MetricsReading(LoadSignals(queue=queue, running=running, kv_usage=kv), scraped_at=0.0)
    return EngineState(
        Endpoint(url, models=frozenset(models)),
        metrics=metrics if scraped else None,
        metrics_stale=stale,
        healthy=healthy,
        draining=draining,
        circuit=circuit,
        in_flight=in_flight,
        recent_requests=list(recent),
    )


def cycle(pool: Sequence[EngineState] = (), now: float = 100.0) -> CycleState:
    return CycleState(now, pool)


def urls(engines: Sequence[EngineState]) -> list[str]:
    return [e.url for e in engines]


def scored(*pairs: tuple[str, float]) -> list[ScoredEngine]:
    return [ScoredEngine(engine(url), score) for url, score in pairs]


# --- parameters and registry ---------------------------------------------------------------------------


def test_params_defaults_and_values() -> None:
    f = SaturationFilter.from_params(None, {"queueThreshold": 3, "kvUsageThreshold": 0.5})
    assert (f.name, f.queue_threshold, f.kv_usage_threshold) == ("saturation-filter", 3.0, 0.5)
    assert isinstance(f.queue_threshold, float)
    d = SaturationFilter.from_params("sat", None)
    assert (d.name, d.queue_threshold, d.kv_usage_threshold) == ("sat", 5.0, 0.8)


@pytest.mark.parametrize(
    ("type_name", "params", "expected"),
    [
        (
            "saturation-filter",
            {"queueThreshold": -1},
            "parameter 'queueThreshold' must be a number >= 0, got -1",
        ),
        ("saturation-filter", {"kvUsageThreshold": 1.5}, "'kvUsageThreshold' must be a number in [0, 1]"),
        ("saturation-filter", {"queueThreshold": "5"}, "'queueThreshold' must be a number >= 0, got '5'"),
        ("saturation-filter", {"queueThreshold": True}, "'queueThreshold' must be a number >= 0, got True"),
        (
            "saturation-filter",
            {"queueThresold": 5},
            "unknown parameter 'queueThresold'; known parameters: kvUs",
        ),
        ("load-aware-scorer", {"limit": 0}, "parameter 'limit' must be an integer >= 1, got 0"),
        ("load-aware-scorer", {"limit": 2.5}, "parameter 'limit' must be an integer >= 1, got 2.5"),
        ("least-qps-scorer", {"windowSeconds": 0}, "'windowSeconds' must be a number in (0, 10]"),
        ("least-qps-scorer", {"windowSeconds": 60}, "'windowSeconds' must be a number in (0, 10]"),
        ("session-affinity-scorer", {"virtualNodes": 0}, "'virtualNodes' must be an integer in [1, 10000]"),
        ("queue-scorer", {"x": 1}, "unknown parameter 'x'; known parameters: none"),
        ("queue-scorer", [1], "parameters must be a mapping, got list"),
    ],
)
def test_param_errors_name_plugin_and_parameter(type_name: str, params: object, expected: str) -> None:
    with pytest.raises(PluginConfigError) as info:
        default_registry().create(type_name, "mine", params)  # type: ignore[arg-type]  # wrong on purpose
    assert f"plugin 'mine' (type {type_name})" in str(info.value)
    assert expected in str(info.value)


def test_registry_unknown_type_lists_known() -> None:
    with pytest.raises(
        PluginConfigError, match=r"unknown plugin type 'qeue-scorer'; known types: .*queue-scorer"
    ):
        default_registry().create("qeue-scorer")


def test_registry_has_every_builtin_with_a_docstring_formula() -> None:
    registry = default_registry()
    expected = {
        "model-filter", "health-filter", "saturation-filter",
        "queue-scorer", "running-requests-scorer", "kv-cache-utilization-scorer", "load-aware-scorer",
        "active-requests-scorer", "session-affinity-scorer", "least-qps-scorer",
        "precise-prefix-scorer", "approximate-prefix-scorer", "no-hit-lru-scorer",
        "max-score-picker", "random-picker", "weighted-random-picker", "round-robin-picker",
        "power-of-two-picker", "single-profile-handler", "role-filter", "pd-profile-handler",
    }  # fmt: skip
    assert set(registry.types) == expected
    for plugin_type in registry.types.values():
        module_doc = __import__(plugin_type.__module__, fromlist=["_"]).__doc__ or ""
        assert module_doc.startswith(f"{plugin_type.type_name}:"), plugin_type
        assert "Parameters:" in module_doc and "When to use:" in module_doc and "Cost:" in module_doc


def test_extract_session_key() -> None:
    assert extract_session_key({"x-session-id": "h"}, {"user": "u"}) == "h"
    assert extract_session_key({}, {"user": "u", "session_id": "s"}) == "u"
    assert extract_session_key({}, {"session_id": 42}) == "42"
    assert extract_session_key({"x-session-id": ""}, {"user": True}) is None
    assert extract_session_key({}, {"user": ["a"]}) is None
    assert extract_session_key({"x-conv": "c"}, {}, header_names=("x-conv",), body_fields=()) == "c"


def test_session_headers_are_tried_in_the_order_given_then_the_body() -> None:
    headers = CIMultiDict({"X-User-Id": "alice", "X-Session-Id": "s1"})  # as the router's server gives them
    names = ("x-user-id", "x-session-id")
    assert extract_session_key(headers, {"user": "u"}, names) == "alice"
    assert extract_session_key(headers, {"user": "u"}, names[::-1]) == "s1"
    assert extract_session_key(CIMultiDict({"x-user-id": ""}), {"user": "u"}, names) == "u"  # empty: skipped
    assert extract_session_key(CIMultiDict(), {"user": "u"}, names) == "u"
    assert extract_session_key(CIMultiDict(), {}, names) is None
    # Headers not named are not keys: the default names x-session-id only.
    assert extract_session_key(CIMultiDict({"x-user-id": "alice"}), {"user": "u"}) == "u"
    assert extract_session_key(CIMultiDict({"x-user-id": "alice"}), {}) is None


# --- filters --------------------------------------------------------------------------------------------


def test_model_filter_prefers_known_servers_and_falls_back_to_unknown_lists() -> None:
    a, b, unknown = engine("a", models=("m",)), engine("b", models=("other",)), engine("u", models=())
    f = ModelFilter()
    assert urls(f.filter(REQ, cycle(), [a, b, unknown])) == ["a"]
    assert urls(f.filter(REQ, cycle(), [b, unknown])) == ["u"]
    assert f.filter(REQ, cycle(), [b]) == []


def test_health_filter_keeps_routable_only() -> None:
    engines = [
        engine("ok"),
        engine("sick", healthy=False),
        engine("drain", draining=True),
        engine("open", circuit=CircuitState.OPEN),
        engine("half", circuit=CircuitState.HALF_OPEN),
    ]
    assert urls(HealthFilter().filter(REQ, cycle(), engines)) == ["ok", "half"]


def test_saturation_filter_thresholds() -> None:
    f = SaturationFilter()
    engines = [
        engine("q5", queue=5, kv=0.8),  # at the thresholds: not saturated
        engine("q6", queue=6),
        engine("kv", kv=0.81),
    ]
    assert urls(f.filter(REQ, cycle(), engines)) == ["q5"]
    strict = SaturationFilter(queue_threshold=0, kv_usage_threshold=0.5)
    assert urls(strict.filter(REQ, cycle(), [engine("a", queue=1), engine("b", kv=0.4)])) == ["b"]


@pytest.mark.parametrize(
    "unknown",
    [
        engine("x", stale=True),
        engine("x", scraped=False),
        engine("x", queue=None),
        engine("x", kv=None),
    ],
    ids=["stale", "never-scraped", "queue-not-exported", "kv-not-exported"],
)
def test_saturation_filter_counts_unknown_as_saturated(unknown: EngineState) -> None:
    idle = engine("idle")
    assert urls(SaturationFilter().filter(REQ, cycle(), [unknown, idle])) == ["idle"]


def test_saturation_filter_fails_open() -> None:
    everyone_busy = [engine("a", queue=50), engine("b", stale=True), engine("c", kv=0.99)]
    assert SaturationFilter().filter(REQ, cycle(), everyone_busy) == everyone_busy


# --- scorers --------------------------------------------------------------------------------------------


def test_queue_scorer_formula() -> None:
    s = QueueScorer().score(REQ, cycle(), [engine("a", queue=0), engine("b", queue=5), engine("c", queue=20)])
    assert s == {"a": 1.0, "b": 0.75, "c": 0.0}
    assert QueueScorer().score(REQ, cycle(), [engine("a", queue=3), engine("b", queue=3)]) == {
        "a": 1.0,
        "b": 1.0,
    }


def test_queue_scorer_unknown_is_worst_even_when_known_are_equal() -> None:
    s = QueueScorer().score(
        REQ, cycle(), [engine("a", queue=7), engine("b", stale=True), engine("c", queue=None)]
    )
    assert s == {"a": 1.0, "b": 0.0, "c": 0.0}
    everyone_unknown = [engine("a", stale=True), engine("b", scraped=False)]
    assert QueueScorer().score(REQ, cycle(), everyone_unknown) == {"a": 0.0, "b": 0.0}


def test_running_scorer_formula() -> None:
    engines = [
        engine("a", running=2),
        engine("b", running=4),
        engine("c", running=10),
        engine("d", running=None),
    ]
    assert RunningRequestsScorer().score(REQ, cycle(), engines) == {"a": 1.0, "b": 0.75, "c": 0.0, "d": 0.0}


def test_kv_utilization_scorer_formula() -> None:
    engines = [engine("a", kv=0.0), engine("b", kv=0.25), engine("c", kv=1.2), engine("d", stale=True)]
    assert KVCacheUtilizationScorer().score(REQ, cycle(), engines) == {
        "a": 1.0,
        "b": 0.75,
        "c": 0.0,
        "d": 0.0,
    }


def test_load_aware_scorer_formula() -> None:
    engines = [engine("a", queue=0), engine("b", queue=64), engine("c", queue=500), engine("d", stale=True)]
    assert LoadAwareScorer().score(REQ, cycle(), engines) == {"a": 0.5, "b": 0.25, "c": 0.0, "d": 0.0}
    assert LoadAwareScorer(limit=10).score(REQ, cycle(), [engine("a", queue=5)]) == {"a": 0.25}


def test_active_requests_scorer_formula() -> None:
    engines = [engine("a", in_flight=2), engine("b", in_flight=6), engine("c", in_flight=10)]
    assert ActiveRequestsScorer().score(REQ, cycle(), engines) == {"a": 1.0, "b": 0.5, "c": 0.0}
    tied = [engine("a", in_flight=4), engine("b", in_flight=4)]
    assert ActiveRequestsScorer().score(REQ, cycle(), tied) == {"a": 1.0, "b": 1.0}


def test_least_qps_scorer_counts_the_window_only() -> None:
    now = 100.0
    engines = [
        engine("a", recent=[10.0, 20.0, 95.0]),  # 1 send in the last 10 s
        engine("b", recent=[91.0, 92.0, 93.0, 99.0, 99.5]),  # 5 sends
        engine("c", recent=[92.0, 93.0, 94.0]),  # 3 sends
    ]
    scorer = LeastQPSScorer()
    assert scorer.qps(engines[1], now) == pytest.approx(0.5)
    assert scorer.score(REQ, cycle(now=now), engines) == {"a": 1.0, "b": 0.0, "c": 0.5}
    wide = LeastQPSScorer(window_seconds=100.0)  # a: 3, b: 5, c: 3
    assert wide.score(REQ, cycle(now=now), engines) == {"a": 1.0, "b": 0.0, "c": 1.0}


@pytest.mark.parametrize(
    "scorer",
    [QueueScorer(), RunningRequestsScorer(), KVCacheUtilizationScorer(), LoadAwareScorer()],
    ids=lambda s: s.type_name,
)
@pytest.mark.parametrize(
    "unknown",
    [engine("x", stale=True), engine("x", scraped=False), engine("x", queue=None, running=None, kv=None)],
    ids=["stale", "never-scraped", "not-exported"],
)
def test_unknown_metrics_never_score_as_idle(scorer: Scorer, unknown: EngineState) -> None:
    idle = engine("idle")
    busy = engine("busy", queue=40, running=40, kv=0.95)
    scores = scorer.score(REQ, cycle(), [unknown, idle, busy])
    assert scores["x"] < scores["idle"]
    assert scores["x"] <= scores["busy"]
    assert scores["x"] == 0.0


# --- session affinity -----------------------------------------------------------------------------------


def _owners(scorer: SessionAffinityScorer, engines: list[EngineState], keys: list[str]) -> dict[str, str]:
    out = {}
    for key in keys:
        (url,) = scorer.score(SchedulingRequest("m", key, session_key=key), cycle(engines), engines)
        out[key] = url
    return out


KEYS = [f"session-{i}" for i in range(10_000)]


def test_session_affinity_sticks_and_spreads() -> None:
    engines = [engine(f"http://10.0.0.{i}:8000") for i in range(4)]
    scorer = SessionAffinityScorer()
    owners = _owners(scorer, engines, KEYS)
    assert owners == _owners(SessionAffinityScorer(), list(reversed(engines)), KEYS)  # order-independent
    shares = Counter(owners.values())
    assert len(shares) == 4
    assert all(0.15 < n / len(KEYS) < 0.35 for n in shares.values()), shares
    assert scorer.score(REQ, cycle(engines), engines) == {}  # no session key: no opinion


def test_session_affinity_adding_an_engine_remaps_about_its_share() -> None:
    four = [engine(f"http://10.0.0.{i}:8000") for i in range(4)]
    five = [*four, engine("http://10.0.0.9:8000")]
    before = _owners(SessionAffinityScorer(), four, KEYS)
    after = _owners(SessionAffinityScorer(), five, KEYS)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert 0.12 < len(moved) / len(KEYS) < 0.28, len(moved) / len(KEYS)  # ideal 1/5, not all
    assert all(after[k] == "http://10.0.0.9:8000" for k in moved)  # keys only move to the newcomer


def test_session_affinity_removing_an_engine_moves_only_its_keys() -> None:
    four = [engine(f"http://10.0.0.{i}:8000") for i in range(4)]
    gone = four[2].url
    before = _owners(SessionAffinityScorer(), four, KEYS)
    after = _owners(SessionAffinityScorer(), [e for e in four if e.url != gone], KEYS)
    for key in KEYS:
        if before[key] != gone:
            assert after[key] == before[key]
        else:
            assert after[key] != gone


def test_session_affinity_skips_a_filtered_engine_and_returns_to_it() -> None:
    pool = [engine(f"http://10.0.0.{i}:8000") for i in range(4)]
    scorer = SessionAffinityScorer()
    home = _owners(scorer, pool, ["conv-7"])["conv-7"]
    others = [e for e in pool if e.url != home]
    request = SchedulingRequest("m", "r", session_key="conv-7")
    ring = scorer.ring(frozenset(urls(pool)))
    # The home engine is filtered out (unhealthy, saturated): the session goes to the next engine on the ring,
    # the same one a ring without the home engine would pick, and the ring is not rebuilt for it.
    (away,) = scorer.score(request, cycle(pool), others)
    assert away != home
    assert _owners(SessionAffinityScorer(), others, ["conv-7"])["conv-7"] == away
    assert scorer.ring(frozenset(urls(pool))) is ring
    assert scorer.score(request, cycle(pool), pool) == {home: 1.0}


# --- pickers --------------------------------------------------------------------------------------------


def test_max_score_orders_all_candidates() -> None:
    order = MaxScorePicker().pick(REQ, cycle(), scored(("a", 1.0), ("b", 3.5), ("c", 2.0)))
    assert urls(order) == ["b", "c", "a"]


def test_max_score_breaks_ties_at_random_fairly() -> None:
    picker = MaxScorePicker(rng=random.Random(7))
    candidates = scored(("a", 2.0), ("b", 2.0), ("c", 2.0), ("d", 2.0), ("low", 1.0))
    firsts = Counter(picker.pick(REQ, cycle(), candidates)[0].url for _ in range(1000))
    assert set(firsts) == {"a", "b", "c", "d"}
    assert all(200 <= n <= 300 for n in firsts.values()), firsts  # fair share 250 each
    assert all(picker.pick(REQ, cycle(), candidates)[-1].url == "low" for _ in range(50))


def test_random_picker_covers_everyone_and_ignores_scores() -> None:
    picker = RandomPicker(rng=random.Random(3))
    candidates = scored(("a", 0.0), ("b", 9.0), ("c", 0.0))
    firsts = Counter(picker.pick(REQ, cycle(), candidates)[0].url for _ in range(900))
    assert all(250 <= n <= 350 for n in firsts.values()), firsts
    assert sorted(urls(picker.pick(REQ, cycle(), candidates))) == ["a", "b", "c"]


def test_weighted_random_follows_scores() -> None:
    picker = WeightedRandomPicker(rng=random.Random(11))
    candidates = scored(("a", 1.0), ("b", 2.0), ("c", 3.0), ("zero", 0.0))
    firsts = Counter(picker.pick(REQ, cycle(), candidates)[0].url for _ in range(6000))
    assert firsts["zero"] == 0
    for url, share in (("a", 1 / 6), ("b", 2 / 6), ("c", 3 / 6)):
        assert abs(firsts[url] / 6000 - share) < 0.03, firsts
    assert picker.pick(REQ, cycle(), candidates)[-1].url == "zero"
    all_zero = scored(("a", 0.0), ("b", 0.0))
    assert Counter(picker.pick(REQ, cycle(), all_zero)[0].url for _ in range(400))["a"] in range(150, 251)


def test_round_robin_rotates_in_url_order() -> None:
    picker = RoundRobinPicker()
    candidates = scored(("c", 9.0), ("a", 0.0), ("b", 1.0))
    orders = [urls(picker.pick(REQ, cycle(), candidates)) for _ in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_power_of_two_never_picks_the_worst_of_three() -> None:
    picker = PowerOfTwoPicker(rng=random.Random(5))
    candidates = scored(("heavy", 0.5), ("light", 2.5), ("medium", 1.5))
    firsts = Counter(picker.pick(REQ, cycle(), candidates)[0].url for _ in range(1000))
    assert firsts["heavy"] == 0
    # The middle one wins whenever the pair is (medium, heavy): a third of the draws.
    assert 270 <= firsts["medium"] <= 400, firsts
    order = picker.pick(REQ, cycle(), candidates)
    assert sorted(urls(order)) == ["heavy", "light", "medium"]
    assert urls(picker.pick(REQ, cycle(), scored(("x", 1.0), ("y", 2.0)))) == ["y", "x"]


def test_power_of_two_ties_are_random() -> None:
    picker = PowerOfTwoPicker(rng=random.Random(9))
    candidates = scored(("a", 1.0), ("b", 1.0), ("c", 1.0))
    firsts = Counter(picker.pick(REQ, cycle(), candidates)[0].url for _ in range(900))
    assert all(math.isclose(n, 300, abs_tol=60) for n in firsts.values()), firsts
