"""The scheduler end to end: eligibility and its errors, profiles, the YAML config, the presets, bursts."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from kvstack.engines.state import CircuitState, Endpoint, EngineState, LoadSignals, MetricsReading
from kvstack.scheduling import (
    PRESETS,
    ConfigError,
    CycleState,
    Filter,
    NoEndpointError,
    NoEndpointReason,
    ProfileHandler,
    ProfileResult,
    Scheduler,
    SchedulerProfile,
    SchedulingRequest,
    SchedulingResult,
    Scorer,
    build_scheduler,
    default_registry,
    load_config,
    load_routing,
    parse_config,
    preset_config,
)
from kvstack.scheduling.filters.saturation import SaturationFilter
from kvstack.scheduling.pickers.max_score import MaxScorePicker
from kvstack.scheduling.scorers.load_aware import LoadAwareScorer
from kvstack.scheduling.scorers.queue import QueueScorer


def engine(
    url: str,
    *,
    queue: float | None = 0.0,
    kv: float | None = 0.0,
    stale: bool = False,
    models: Sequence[str] = ("m",),
    in_flight: int = 0,
    healthy: bool = True,
    draining: bool = False,
    circuit: CircuitState = CircuitState.CLOSED,
) -> EngineState:
    return EngineState(
        Endpoint(url, models=frozenset(models)),
        metrics=MetricsReading(LoadSignals(queue=queue, running=0.0, kv_usage=kv), scraped_at=0.0),
        metrics_stale=stale,
        healthy=healthy,
        draining=draining,
        circuit=circuit,
        in_flight=in_flight,
        # The scrape already counts these requests (no sends since it).
        in_flight_at_scrape=in_flight,
    )


def request(session: str | None = None, model: str = "m") -> SchedulingRequest:
    return SchedulingRequest(model=model, request_id="r", session_key=session)


def preset(name: str) -> Scheduler:
    return build_scheduler(preset_config(name))


# --- eligibility and NoEndpointError --------------------------------------------------------------------


def test_no_engines() -> None:
    with pytest.raises(NoEndpointError) as info:
        preset("default").schedule(request(), [])
    assert info.value.reason is NoEndpointReason.NO_ENGINES


def test_model_not_served_lists_served_models() -> None:
    with pytest.raises(NoEndpointError) as info:
        preset("default").schedule(
            request(model="gpt-x"), [engine("a", models=("m",)), engine("b", models=("n",))]
        )
    assert info.value.reason is NoEndpointReason.MODEL_NOT_SERVED
    assert info.value.model == "gpt-x"
    assert str(info.value) == "no engine serves model 'gpt-x'; models served: m, n"


def test_all_unroutable_says_why_for_each_engine() -> None:
    engines = [
        engine("http://a", healthy=False),
        engine("http://b", draining=True),
        engine("http://c", circuit=CircuitState.OPEN),
        engine("http://other", models=("n",)),  # serves another model: not part of the explanation
    ]
    with pytest.raises(NoEndpointError) as info:
        preset("round-robin").schedule(request(), engines)
    assert info.value.reason is NoEndpointReason.NO_ROUTABLE_ENGINE
    assert str(info.value) == (
        "no routable engine for model 'm': http://a (unhealthy); http://b (draining); http://c (circuit open)"
    )


def test_every_preset_skips_unroutable_engines() -> None:
    engines = [
        engine("sick", healthy=False),
        engine("ok", queue=50, kv=0.99),
        engine("open", circuit=CircuitState.OPEN),
    ]
    for name in PRESETS:
        scheduler = preset(name)
        for i in range(20):
            result = scheduler.schedule(request(session=f"s{i}"), engines)
            assert [e.url for e in result.primary.targets] == ["ok"], name


def test_engines_with_unknown_models_serve_until_a_known_server_exists() -> None:
    scheduler = preset("least-load")
    fresh = engine("fresh", models=())
    assert scheduler.schedule(request(), [fresh, engine("n", models=("n",))]).target.url == "fresh"
    known = engine("known", queue=9, kv=0.9, in_flight=9)
    assert scheduler.schedule(request(), [fresh, known]).target.url == "known"


class _NothingFilter(Filter):
    type_name: ClassVar[str] = "nothing-filter"

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: list[EngineState]
    ) -> list[EngineState]:
        return []


def test_profile_filtered_empty_names_the_filter() -> None:
    scheduler = Scheduler([SchedulerProfile("p", filters=[_NothingFilter("nope")])])
    with pytest.raises(NoEndpointError) as info:
        scheduler.schedule(request(), [engine("a")])
    assert info.value.reason is NoEndpointReason.FILTERED_OUT
    assert "filter 'nope' of profile 'p' left no candidate" in str(info.value)


# --- profile runs ---------------------------------------------------------------------------------------


class _Fixed(Scorer):
    type_name: ClassVar[str] = "fixed-scorer"

    def __init__(self, name: str | None = None, *, scores: Mapping[str, float] | None = None) -> None:
        super().__init__(name)
        self.scores = dict(scores or {})

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        return {e.url: self.scores[e.url] for e in candidates if e.url in self.scores}


def test_totals_are_weighted_sums_of_clamped_scores() -> None:
    one = _Fixed("one", scores={"a": 0.5, "b": 7.0, "c": -3.0, "d": math.nan})
    two = _Fixed("two", scores={"a": 0.25, "b": 1.0})
    scheduler = Scheduler([SchedulerProfile("p", scorers=[(one, 2.0), (two, 3.0)])])
    result = scheduler.schedule(request(), [engine(u) for u in "abcd"])
    assert dict(result.primary.scores) == {"a": 1.75, "b": 5.0, "c": 0.0, "d": 0.0}
    assert result.target.url == "b"
    assert result.fallbacks[0].url == "a"
    assert result.prefill is None


def test_default_preset_scores() -> None:
    engines = [engine("a", queue=0, kv=0.5, in_flight=1), engine("b", queue=4, kv=0.1, in_flight=3)]
    result = preset("default").schedule(request(), engines)
    # a: 2*1 + 2*0.5 + 1*1 = 4; b: 2*0 + 2*0.9 + 1*0 = 1.8
    assert result.primary.scores == pytest.approx({"a": 4.0, "b": 1.8})
    assert [e.url for e in result.primary.targets] == ["a", "b"]


def test_now_reaches_the_plugins() -> None:
    seen: list[float] = []

    class Clock(Scorer):
        type_name: ClassVar[str] = "clock"

        def score(
            self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
        ) -> dict[str, float]:
            seen.append(state.now)
            return {}

    Scheduler([SchedulerProfile("p", scorers=[(Clock(), 1.0)])]).schedule(
        request(), [engine("a"), engine("b")], now=42.0
    )
    assert seen == [42.0]


class _DecodeFirst(ProfileHandler):
    """A P/D-shaped handler through the extension point: decode first, prefill only for long prompts."""

    type_name: ClassVar[str] = "decode-first-test"

    def check_profiles(self, names: Sequence[str]) -> str | None:
        return None if set(names) == {"decode", "prefill"} else "needs profiles decode and prefill"

    def pick(
        self,
        request: SchedulingRequest,
        state: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> list[str]:
        if "decode" not in results:
            return ["decode"]
        long_prompt = len(request.prompt_token_ids or ()) >= 100
        return ["prefill"] if long_prompt and "prefill" not in results else []

    def process_results(
        self, request: SchedulingRequest, state: CycleState, results: Mapping[str, ProfileResult]
    ) -> SchedulingResult:
        return SchedulingResult("decode", results, "prefill" if "prefill" in results else None)


def test_profile_handler_extension_point_runs_rounds() -> None:
    class RoleFilter(Filter):
        type_name: ClassVar[str] = "role"

        def __init__(self, name: str, url: str) -> None:
            super().__init__(name)
            self.url = url

        def filter(
            self, request: SchedulingRequest, state: CycleState, candidates: list[EngineState]
        ) -> list[EngineState]:
            return [e for e in candidates if e.url == self.url]

    profiles = [
        SchedulerProfile("decode", filters=[RoleFilter("d", "dec")]),
        SchedulerProfile("prefill", filters=[RoleFilter("p", "pre")]),
    ]
    scheduler = Scheduler(profiles, _DecodeFirst())
    engines = [engine("dec"), engine("pre")]
    short = scheduler.schedule(SchedulingRequest("m", "r", prompt_token_ids=[1] * 10), engines)
    assert (short.target.url, short.prefill) == ("dec", None)
    long = scheduler.schedule(SchedulingRequest("m", "r", prompt_token_ids=[1] * 200), engines)
    assert long.target.url == "dec"
    assert long.prefill is not None and long.prefill.targets[0].url == "pre"
    with pytest.raises(ValueError, match="needs profiles decode and prefill"):
        Scheduler(profiles[:1], _DecodeFirst())


# --- presets --------------------------------------------------------------------------------------------


def test_least_load_sends_to_the_emptiest() -> None:
    engines = [
        engine("busy", queue=8, kv=0.7, in_flight=12),
        engine("empty", queue=0, kv=0.05, in_flight=1),
        engine("middling", queue=3, kv=0.4, in_flight=5),
    ]
    scheduler = preset("least-load")
    assert {scheduler.schedule(request(), engines).target.url for _ in range(50)} == {"empty"}
    assert [e.url for e in scheduler.schedule(request(), engines).primary.targets] == [
        "empty",
        "middling",
        "busy",
    ]


def test_power_of_two_never_picks_the_most_loaded_of_three() -> None:
    engines = [
        engine("heavy", queue=10, kv=0.9, in_flight=20),
        engine("a", queue=1, kv=0.2, in_flight=2),
        engine("b", queue=2, kv=0.3, in_flight=3),
    ]
    scheduler = preset("power-of-two")
    firsts = Counter(scheduler.schedule(request(), engines).target.url for _ in range(600))
    assert firsts["heavy"] == 0
    assert firsts["a"] > firsts["b"] > 0  # b wins the (b, heavy) draws: it is sampled, not always the best


def test_round_robin_preset_rotates_over_routable_engines() -> None:
    engines = [engine("c"), engine("a"), engine("x", draining=True), engine("b", queue=99)]
    scheduler = preset("round-robin")
    assert [scheduler.schedule(request(), engines).target.url for _ in range(6)] == [
        "a",
        "b",
        "c",
        "a",
        "b",
        "c",
    ]


def test_session_preset_sticks_spills_and_falls_back_to_load() -> None:
    engines = [engine(f"http://e{i}") for i in range(4)]
    scheduler = preset("session")
    home = scheduler.schedule(request("conv-1"), engines).target.url
    # Load changes do not move a session while its engine has room.
    for e in engines:
        e.in_flight = e.in_flight_at_scrape = 10 if e.url == home else 0
        assert e.metrics is not None
        e.metrics.signals.queue = 3 if e.url == home else 0
    assert {scheduler.schedule(request("conv-1"), engines).target.url for _ in range(20)} == {home}
    # A saturated home engine hands the session to its next engine on the ring, the same every time.
    home_metrics = next(e for e in engines if e.url == home).metrics
    assert home_metrics is not None
    home_metrics.signals.queue = 50
    spilled = {scheduler.schedule(request("conv-1"), engines).target.url for _ in range(20)}
    assert len(spilled) == 1 and home not in spilled
    # Sessions spread over engines; requests without a key go to the least loaded.
    homes = {
        preset("session")
        .schedule(request(f"user-{i}"), [engine(f"http://e{j}") for j in range(4)])
        .target.url
        for i in range(200)
    }
    assert len(homes) == 4
    loads = [
        engine("http://e0", in_flight=5),
        engine("http://e1", in_flight=0),
        engine("http://e2", in_flight=5),
    ]
    assert scheduler.schedule(request(None), loads).target.url == "http://e1"


def test_default_preset_skips_saturated_and_fails_open() -> None:
    scheduler = preset("default")
    engines = [
        engine("full", queue=9, in_flight=0),
        engine("stale", stale=True),
        engine("ok", queue=2, in_flight=30),
    ]
    assert {scheduler.schedule(request(), engines).target.url for _ in range(30)} == {"ok"}
    all_saturated = [engine("full", queue=9, kv=0.95), engine("stale", stale=True)]
    assert scheduler.schedule(request(), all_saturated).target.url == "full"  # known load beats unknown


@pytest.mark.parametrize("name", ["default", "least-load", "power-of-two"])
def test_burst_with_stale_tied_scores_spreads_by_in_flight(name: str) -> None:
    engines = [engine(f"http://e{i}", stale=True) for i in range(4)]
    scheduler = preset(name)
    counts: Counter[str] = Counter()
    for _ in range(100):
        target = scheduler.schedule(request(), engines).target
        target.in_flight += 1  # what the proxy does when it sends the request
        counts[target.url] += 1
    assert len(counts) == 4
    if name == "power-of-two":
        assert max(counts.values()) <= 30, counts  # sampled pairs: close to even, not exact
    else:
        assert set(counts.values()) == {25}, counts


def test_burst_without_in_flight_scorer_would_still_not_herd() -> None:
    # Even a load-blind profile breaks stale ties at random instead of always taking the first engine.
    engines = [engine(f"http://e{i}", stale=True) for i in range(4)]
    scheduler = Scheduler(
        [SchedulerProfile("p", scorers=[(QueueScorer(), 1.0)], picker=MaxScorePicker(rng=random.Random(1)))]
    )
    counts = Counter(scheduler.schedule(request(), engines).target.url for _ in range(100))
    assert len(counts) == 4 and max(counts.values()) < 45, counts


# --- config files ---------------------------------------------------------------------------------------

GOOD = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: saturation-filter
  name: strict-saturation
  parameters:
    queueThreshold: 2
- type: queue-scorer
- type: load-aware-scorer
  parameters: {limit: 16}
- type: least-qps-scorer
- type: weighted-random-picker
schedulingProfiles:
- name: main
  plugins:
  - pluginRef: strict-saturation
  - pluginRef: queue-scorer
    weight: 3
  - pluginRef: load-aware-scorer
  - pluginRef: least-qps-scorer
    weight: 0.5
  - pluginRef: weighted-random-picker
"""


def test_load_config_file_and_build(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text(GOOD)
    config = load_config(path)
    assert config.source == str(path)
    assert (config.plugins[0].type, config.plugins[0].name) == ("saturation-filter", "strict-saturation")
    scheduler = build_scheduler(config)
    (profile,) = scheduler.profiles.values()
    assert [f.name for f in profile.filters] == ["strict-saturation"]
    saturation = profile.filters[0]
    assert isinstance(saturation, SaturationFilter) and saturation.queue_threshold == 2.0
    assert [(s.name, w) for s, w in profile.scorers] == [
        ("queue-scorer", 3.0),
        ("load-aware-scorer", 1.0),
        ("least-qps-scorer", 0.5),
    ]
    load_aware = profile.scorers[1][0]
    assert isinstance(load_aware, LoadAwareScorer) and load_aware.limit == 16
    assert profile.picker.type_name == "weighted-random-picker"
    result = scheduler.schedule(request(), [engine("a", queue=5), engine("b", queue=1)])
    assert result.target.url == "b"  # a is saturated at queueThreshold 2
    assert load_routing(path).plugins == config.plugins


def test_profile_without_picker_uses_max_score() -> None:
    config = parse_config(
        "plugins: [{type: queue-scorer}]\n"
        "schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer}]}]"
    )
    (profile,) = build_scheduler(config).profiles.values()
    assert profile.picker.type_name == "max-score-picker"


def _ref(*refs: str) -> str:
    return "schedulingProfiles:\n- name: p\n  plugins:\n" + "".join(f"  - {r}\n" for r in refs)


BAD_CONFIGS = [
    ("plugins: [\n", "invalid YAML"),
    ("", "expected a mapping with 'plugins' and 'schedulingProfiles', got nothing"),
    ("plugins: []\n" + _ref("pluginRef: x"), "plugins: must be a non-empty list"),
    ("plugin: []\n", "unknown key 'plugin'; expected apiVersion, kind, plugins, schedulingProfiles"),
    (
        "plugins: [{type: queue-scorer}]\n",
        "schedulingProfiles: must be a non-empty list of profiles, got nothing",
    ),
    (
        "plugins: [{name: q}]\n" + _ref("pluginRef: q"),
        "plugins[0]: 'type' must be a non-empty string, got None",
    ),
    (
        "plugins: [{type: queue-scorer}, {type: qeue-scorer}]\n" + _ref("pluginRef: queue-scorer"),
        "plugins[1] ('qeue-scorer'): unknown plugin type 'qeue-scorer'; known types:",
    ),
    (
        "plugins: [{type: queue-scorer}, {type: queue-scorer}]\n" + _ref("pluginRef: queue-scorer"),
        "plugins[1] ('queue-scorer'): duplicate plugin name 'queue-scorer' "
        "(also plugins[0] ('queue-scorer'))",
    ),
    (
        "plugins: [{type: queue-scorer, params: {}}]\n" + _ref("pluginRef: queue-scorer"),
        "plugins[0]: unknown key 'params'; expected name, parameters, type",
    ),
    (
        "plugins: [{type: load-aware-scorer, name: la, parameters: {limit: -3}}]\n" + _ref("pluginRef: la"),
        "plugins[0] ('la'): plugin 'la' (type load-aware-scorer): parameter 'limit' must be "
        "an integer >= 1, got -3",
    ),
    (
        "plugins: [{type: queue-scorer}]\n" + _ref("pluginRef: qeue-scorer"),
        "schedulingProfiles[0] ('p').plugins[0] ('qeue-scorer'): no plugin named 'qeue-scorer'; "
        "declared: queue-scorer",
    ),
    (
        "plugins: [{type: queue-scorer}]\n" + _ref("{pluginRef: queue-scorer, weight: -1}"),
        "schedulingProfiles[0] ('p').plugins[0] ('queue-scorer'): "
        "'weight' must be a finite number >= 0, got -1",
    ),
    (
        "plugins: [{type: queue-scorer}]\n" + _ref("{pluginRef: queue-scorer, weight: heavy}"),
        "'weight' must be a finite number >= 0, got 'heavy'",
    ),
    (  # inf * a score of 0 is NaN: totals would stop ordering the engines
        "plugins: [{type: queue-scorer}]\n" + _ref("{pluginRef: queue-scorer, weight: .inf}"),
        "'weight' must be a finite number >= 0, got inf",
    ),
    (
        "plugins: [{type: max-score-picker}]\n" + _ref("{pluginRef: max-score-picker, weight: 2}"),
        "'weight' applies to scorers only; 'max-score-picker' is a picker",
    ),
    (
        "plugins: [{type: max-score-picker}, {type: random-picker}]\n"
        + _ref("pluginRef: max-score-picker", "pluginRef: random-picker"),
        "plugins[1] ('random-picker'): a profile has one picker; "
        "'max-score-picker' is already this profile's",
    ),
    (
        "plugins: [{type: queue-scorer}]\n" + _ref("pluginRef: queue-scorer", "pluginRef: queue-scorer"),
        "plugins[1] ('queue-scorer'): plugin 'queue-scorer' is listed twice in this profile",
    ),
    (
        "plugins: [{type: queue-scorer}, {type: running-requests-scorer}]\n"
        + _ref("pluginRef: queue-scorer"),
        "plugins[1] ('running-requests-scorer'): plugin 'running-requests-scorer' is declared but no profile "
        "references it",
    ),
    (
        "plugins: [{type: queue-scorer}, {type: single-profile-handler}]\n"
        + _ref("pluginRef: queue-scorer", "pluginRef: single-profile-handler"),
        "'single-profile-handler' is a profile-handler: declare it under 'plugins' only",
    ),
    (
        "plugins: [{type: queue-scorer}]\n"
        "schedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer}]}, "
        "{name: b, plugins: [{pluginRef: queue-scorer}]}]\n",
        "schedulingProfiles: single-profile-handler runs exactly one scheduling profile, got 2: a, b",
    ),
    (
        "plugins: [{type: queue-scorer}]\n"
        "schedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer}]}, {name: a, plugins: []}]\n",
        "schedulingProfiles[1] ('a'): duplicate profile name 'a'",
    ),
    (
        "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: []}]\n",
        "schedulingProfiles[0] ('a'): 'plugins' must be a non-empty list of pluginRef entries, got list",
    ),
]


@pytest.mark.parametrize(("text", "expected"), BAD_CONFIGS, ids=[e[:40] for _, e in BAD_CONFIGS])
def test_config_errors_name_the_file_and_the_entry(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad-routing.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        build_scheduler(load_config(path))
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert expected in message, message


def test_load_routing_rejects_unknown_names() -> None:
    with pytest.raises(
        ConfigError, match=r"nosuch: neither a preset .*round-robin.* nor an existing config file"
    ):
        load_routing("nosuch")
    with pytest.raises(ConfigError, match="no such preset"):
        preset_config("nosuch")
    with pytest.raises(ConfigError, match="cannot read the scheduling config"):
        load_config("/nonexistent/routing.yaml")


def test_custom_plugins_register_in_a_registry() -> None:
    registry = default_registry()
    registry.register(_Fixed)
    config = parse_config(
        "plugins: [{type: fixed-scorer}]\n"
        "schedulingProfiles: [{name: p, plugins: [{pluginRef: fixed-scorer}]}]"
    )
    assert build_scheduler(config, registry).profiles["p"].scorers[0][0].type_name == "fixed-scorer"
    with pytest.raises(ConfigError, match="unknown plugin type 'fixed-scorer'"):
        build_scheduler(config)  # the default registry is fresh each time: nothing leaked into it
    with pytest.raises(ValueError, match="already registered"):
        registry.register(type("Other", (_Fixed,), {}))


def test_queue_estimate_adds_requests_sent_since_the_scrape() -> None:
    """A burst sees one scrape; counting its own sends keeps it from piling onto one engine."""
    a, b = engine("a", queue=1, kv=0.1), engine("b", queue=0, kv=0.1)
    scheduler = build_scheduler(preset_config("default"))
    picks = []
    for _ in range(40):
        target = scheduler.schedule(request(), [a, b]).target
        target.in_flight += 1  # what the proxy does before its first await
        picks.append(target.url)
    assert abs(picks.count("a") - picks.count("b")) <= 2, picks
    assert a.queue_estimate() == 1 + a.in_flight
