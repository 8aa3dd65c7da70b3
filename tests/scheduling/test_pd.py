"""Prefill/decode disaggregation: role-filter, pd-profile-handler, and the ``pd`` preset down to the front
end's Decision."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from kvstack.engines.prompt_tokens import PromptTokenizer
from kvstack.engines.state import Endpoint, EngineRole, EngineState, LoadSignals, MetricsReading
from kvstack.frontend.prefix import PrefixLookup
from kvstack.frontend.routing import Decision, RouteRequest, SchedulerPicker
from kvstack.openai.errors import OpenAIError
from kvstack.scheduling import (
    CycleState,
    NoEndpointError,
    NoEndpointReason,
    PluginConfigError,
    Scheduler,
    SchedulerProfile,
    SchedulingRequest,
    build_scheduler,
    default_registry,
    load_routing,
    parse_config,
)
from kvstack.scheduling.filters.role import RoleFilter
from kvstack.scheduling.interfaces import CACHED_PROMPT_TOKENS, PrefixView
from kvstack.scheduling.profile_handlers.pd import PDProfileHandler
from kvstack.scheduling.scorers.active_requests import ActiveRequestsScorer
from kvstack.scheduling.scorers.approximate_prefix import ApproximatePrefixScorer
from kvstack.scheduling.scorers.precise_prefix import PrecisePrefixScorer

DECODE, BOTH, PREFILL = EngineRole.DECODE, EngineRole.BOTH, EngineRole.PREFILL


def engine(
    url: str,
    role: EngineRole = BOTH,
    *,
    queue: float = 0.0,
    in_flight: int = 0,
    healthy: bool = True,
    knowledge: str = "kv-events",
) -> EngineState:
    return EngineState(
        Endpoint(url, role=role, models=frozenset({"m"})),
        metrics=MetricsReading(LoadSignals(queue=queue, running=0.0, kv_usage=0.1), scraped_at=0.0),
        metrics_stale=False,
        healthy=healthy,
        in_flight=in_flight,
        in_flight_at_scrape=in_flight,
        knowledge=knowledge,
    )


def request(tokens: int | None, prefix: PrefixView | None = None) -> SchedulingRequest:
    ids = None if tokens is None else list(range(tokens))
    return SchedulingRequest("m", "r", prompt_token_ids=ids, prefix=prefix)


def pd(threshold: int = 256) -> Scheduler:
    """The pd preset with another threshold."""
    text = load_routing("pd").text
    assert text is not None and "threshold: 256" in text
    return build_scheduler(parse_config(text.replace("threshold: 256", f"threshold: {threshold}")))


def held(url: str, tokens: int) -> Mapping[str, tuple[int, ...]]:
    return {url: (tokens, tokens, tokens, tokens)}


# --- role-filter ------------------------------------------------------------------------------------------


def test_role_filter_keeps_the_listed_roles_in_order() -> None:
    engines = [engine("p", PREFILL), engine("b", BOTH), engine("d", DECODE)]
    state = CycleState(0.0, engines)

    def kept(f: RoleFilter) -> list[str]:
        return [e.url for e in f.filter(request(1), state, list(engines))]

    assert kept(RoleFilter()) == ["b", "d"]
    assert kept(RoleFilter(roles=["prefill"])) == ["p"]
    registry = default_registry()
    built = registry.create("role-filter", "f", {"roles": [" Decode", "PREFILL"]})
    assert isinstance(built, RoleFilter) and kept(built) == ["p", "d"]


@pytest.mark.parametrize(
    "roles",
    [[], ["prefil"], "prefill", [1], None],
)
def test_role_filter_rejects_bad_roles(roles: object) -> None:
    with pytest.raises(PluginConfigError, match=r"parameter 'roles' must be a non-empty list of roles"):
        default_registry().create("role-filter", "f", {"roles": roles})


# --- pd-profile-handler ------------------------------------------------------------------------------------


def test_no_token_ids_never_prefills_elsewhere() -> None:
    result = pd(threshold=1).schedule(request(None), [engine("d", DECODE), engine("p", PREFILL)])
    assert (result.target.url, result.prefill_profile) == ("d", None)
    assert set(result.profiles) == {"decode"}


@pytest.mark.parametrize(("tokens", "prefills"), [(255, False), (256, True), (5000, True)])
def test_without_prefix_knowledge_the_whole_prompt_is_uncached(tokens: int, prefills: bool) -> None:
    engines = [engine("d", DECODE), engine("p", PREFILL)]
    result = pd().schedule(request(tokens), engines)
    assert result.target.url == "d"
    if prefills:
        assert result.prefill_profile == "prefill" and result.prefill is not None
        assert [e.url for e in result.prefill.targets] == ["p"]
    else:
        assert result.prefill_profile is None and "prefill" not in result.profiles


@pytest.mark.parametrize(("cached", "prefills"), [(0, True), (200, True), (201, False), (300, False)])
def test_threshold_counts_only_what_the_chosen_decode_engine_lacks(cached: int, prefills: bool) -> None:
    # Two decode candidates, so the decode profile scores and its prefix scorer leaves its state.
    engines = [engine("d1", DECODE), engine("d2", DECODE, in_flight=3), engine("p", PREFILL)]
    view = PrefixView(300, precise=held("d1", cached))
    result = pd(threshold=100).schedule(request(300, view), engines)
    assert result.target.url == "d1"
    assert (result.prefill_profile == "prefill") is prefills


def test_uncached_is_measured_on_the_engine_decode_chose() -> None:
    view = PrefixView(1000, precise=held("d1", 1000))
    engines = [engine("d1", DECODE), engine("d2", DECODE), engine("p", PREFILL)]
    warm = pd().schedule(request(1000, view), engines)
    assert (warm.target.url, warm.prefill_profile) == ("d1", None)
    engines[0] = engine("d1", DECODE, healthy=False)
    cold = pd().schedule(request(1000, view), engines)
    assert (cold.target.url, cold.prefill_profile) == ("d2", "prefill")


def test_the_prefix_scorers_credit_in_cycle_state_is_what_decides() -> None:
    # d1 publishes no events and the router sent it the prompt: the view's history says it holds it all.
    view = PrefixView(1000, approximate={"d1": 1000})
    engines = [
        engine("d1", DECODE, knowledge="approximate"),
        engine("d2", DECODE, in_flight=3),
        engine("p", PREFILL),
    ]
    state = CycleState(0.0, engines)
    PrecisePrefixScorer(use_approximate=False).score(request(1000, view), state, engines[:2])
    assert state.get(CACHED_PROMPT_TOKENS) == {"d1": 0, "d2": 0}
    ApproximatePrefixScorer().score(request(1000, view), state, engines[:2])
    assert state.get(CACHED_PROMPT_TOKENS) == {"d1": 1000, "d2": 0}

    def scheduler(scorer: PrecisePrefixScorer) -> Scheduler:
        # Two candidates, so the decode profile scores; the less busy d1 wins either way.
        decode = SchedulerProfile("decode", [RoleFilter()], [(scorer, 1.0), (ActiveRequestsScorer(), 1.0)])
        prefill = SchedulerProfile("prefill", [RoleFilter(roles=["prefill"])])
        return Scheduler([decode, prefill], PDProfileHandler())

    trusting = scheduler(PrecisePrefixScorer()).schedule(request(1000, view), engines)
    assert (trusting.target.url, trusting.prefill_profile) == ("d1", None)
    # A scorer told not to trust history credits d1 with nothing: the handler goes by it, not by the view.
    events_only = scheduler(PrecisePrefixScorer(use_approximate=False)).schedule(request(1000, view), engines)
    assert (events_only.target.url, events_only.prefill_profile) == ("d1", "prefill")


def test_a_lone_decode_candidate_is_credited_from_the_prefix_view() -> None:
    # One candidate skips scoring, so no scorer state: the handler reads the request's view instead.
    engines = [engine("d", DECODE), engine("p", PREFILL)]
    warm = pd().schedule(request(1000, PrefixView(1000, precise=held("d", 900))), engines)
    assert (warm.target.url, warm.prefill_profile) == ("d", None)
    cold = pd().schedule(request(1000, PrefixView(1000, precise=held("d", 700))), engines)
    assert (cold.target.url, cold.prefill_profile) == ("d", "prefill")


def test_no_prefill_engine_leaves_the_request_to_decode() -> None:
    result = pd().schedule(request(5000), [engine("d", DECODE), engine("b", BOTH)])
    assert result.prefill_profile is None and result.prefill is None
    assert result.profiles["prefill"].emptied_by == "prefill-filter"
    unhealthy = pd().schedule(request(5000), [engine("d", DECODE), engine("p", PREFILL, healthy=False)])
    assert (unhealthy.target.url, unhealthy.prefill_profile) == ("d", None)


def test_no_decode_engine_is_filtered_out_naming_the_filter() -> None:
    with pytest.raises(NoEndpointError) as info:
        pd().schedule(request(5000), [engine("p", PREFILL)])
    assert info.value.reason is NoEndpointReason.FILTERED_OUT
    assert "filter 'decode-filter' of profile 'decode' left no candidate" in str(info.value)


def test_check_profiles_requires_both_named_profiles() -> None:
    def build(handler: PDProfileHandler, names: Sequence[str]) -> Scheduler:
        return Scheduler([SchedulerProfile(n) for n in names], handler)

    with pytest.raises(ValueError, match=r"exactly the profiles 'decode' \(decodeProfile\) and 'prefill'"):
        build(PDProfileHandler(), ["decode"])
    with pytest.raises(ValueError, match="got: decode, prefill, extra"):
        build(PDProfileHandler(), ["decode", "prefill", "extra"])
    with pytest.raises(ValueError, match="got: default"):
        build(PDProfileHandler(), ["default"])
    with pytest.raises(ValueError, match="decodeProfile and prefillProfile are both 'x'"):
        build(PDProfileHandler(decode_profile="x", prefill_profile="x"), ["x"])
    names = {"decodeProfile": "d", "prefillProfile": "p"}
    handler = default_registry().create("pd-profile-handler", None, names)
    assert isinstance(handler, PDProfileHandler)
    profiles = [SchedulerProfile("d", [RoleFilter()]), SchedulerProfile("p", [RoleFilter(roles=["prefill"])])]
    scheduler = Scheduler(profiles, handler)
    result = scheduler.schedule(request(300), [engine("dec", DECODE), engine("pre", PREFILL)])
    assert (result.primary_profile, result.target.url, result.prefill_profile) == ("d", "dec", "p")


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"threshold": 0}, "'threshold' must be an integer >= 1, got 0"),
        ({"threshold": 1.5}, "'threshold' must be an integer >= 1"),
        ({"decodeProfile": ""}, "'decodeProfile' must be a profile name"),
        ({"prefill": "p"}, "unknown parameter 'prefill'"),
    ],
)
def test_handler_parameter_errors(params: Mapping[str, object], expected: str) -> None:
    with pytest.raises(PluginConfigError, match=expected):
        default_registry().create("pd-profile-handler", None, params)


def test_config_with_pd_handler_and_missing_profile_is_a_config_error() -> None:
    text = """\
plugins:
- type: pd-profile-handler
- type: role-filter
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: role-filter
"""
    with pytest.raises(ValueError, match=r"<string>: schedulingProfiles: pd-profile-handler runs exactly"):
        build_scheduler(parse_config(text))


# --- the pd preset through the front end's SchedulerPicker ------------------------------------------------


class FixedPrefix:
    """A PrefixSource that knows, for every prompt, what ``precise`` says."""

    def __init__(self, precise: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self.precise = dict(precise or {})
        self.recorded: list[str] = []

    async def find(
        self,
        token_ids: Sequence[int],
        candidates: Sequence[EngineState],
        now: float,
        *,
        model: str = "",
        cache_salt: str | None = None,
    ) -> PrefixLookup:
        return PrefixLookup(PrefixView(len(token_ids), self.precise), [])

    def record(self, engine: str, lookup: PrefixLookup, now: float | None = None) -> None:
        self.recorded.append(engine)


async def decide(
    states: list[EngineState], tokens: int, locator: FixedPrefix | None = None, *, tokenize: bool = True
) -> Decision:
    picker = SchedulerPicker(
        build_scheduler(load_routing("pd")),
        prompts=PromptTokenizer() if tokenize else None,
        locator=locator or FixedPrefix(),
    )
    body = {"model": "m", "prompt": list(range(tokens))}
    return await picker.pick(RouteRequest("/v1/completions", "m", False, None, "r", body), states)


def fleet() -> list[EngineState]:
    return [
        engine("http://dec", DECODE),
        engine("http://both", BOTH, queue=3, in_flight=3),
        engine("http://pre1", PREFILL, queue=2, in_flight=2),
        engine("http://pre2", PREFILL),
    ]


async def test_pd_preset_long_cold_prompt_is_prefilled_on_a_prefill_engine() -> None:
    locator = FixedPrefix()
    decision = await decide(fleet(), 1000, locator)
    assert decision == Decision("decode", ["http://dec", "http://both"], ["http://pre2", "http://pre1"])
    assert locator.recorded == ["http://dec", "http://pre2"]  # both compute the prompt


async def test_pd_preset_short_prompt_is_decoded_alone() -> None:
    assert await decide(fleet(), 100) == Decision("decode", ["http://dec", "http://both"], [])


async def test_pd_preset_prompt_cached_on_decode_needs_no_prefill() -> None:
    # The both-engine is busier but holds the prompt: the prefix (weight 3) wins; nothing is left to prefill.
    locator = FixedPrefix(held("http://both", 1000))
    assert await decide(fleet(), 1000, locator) == Decision("decode", ["http://both", "http://dec"], [])


async def test_pd_preset_prefill_prefers_the_engine_holding_part_of_the_prompt() -> None:
    states = [engine("http://dec", DECODE), engine("http://pre1", PREFILL), engine("http://pre2", PREFILL)]
    locator = FixedPrefix(held("http://pre2", 600))
    decision = await decide(states, 1000, locator)
    assert decision == Decision("decode", ["http://dec"], ["http://pre2", "http://pre1"])


async def test_pd_preset_without_tokens_never_prefills() -> None:
    assert (await decide(fleet(), 1000, tokenize=False)).prefill == []


async def test_pd_preset_fleet_without_prefill_engines_routes_whole_requests() -> None:
    states = [engine("http://a", BOTH), engine("http://b", BOTH, in_flight=4)]
    assert await decide(states, 5000) == Decision("decode", ["http://a", "http://b"], [])


async def test_pd_preset_only_prefill_engines_is_unavailable() -> None:
    with pytest.raises(OpenAIError) as info:
        await decide([engine("http://pre", PREFILL)], 1000)
    assert info.value.status == 503
