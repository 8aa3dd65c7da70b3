"""The scheduling contract: the request as scheduling sees it, the plugin kinds, and what a decision returns.

A decision runs, per scheduling profile: filters in order (stop when none is left), then the weighted sum of
the scorers' scores, then the picker. A profile handler chooses which profiles run and turns their results
into one `SchedulingResult` (one profile normally; decode then prefill for P/D).

Scheduling is pure: no network I/O and no knowledge of whether the router proxies the bytes itself or
answers Envoy's ext_proc. Everything it reads is in `SchedulingRequest`, the `EngineState` list and
`CycleState`; the only state kept between decisions is a plugin's own (a round-robin counter, a cached
hash ring).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, NamedTuple, Self, TypeVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.params import Param, check_params

# Where the router looks for a session key, in order: headers (lower-cased names), then body fields.
SESSION_HEADERS: tuple[str, ...] = ("x-session-id",)
SESSION_BODY_FIELDS: tuple[str, ...] = ("user", "session_id")


# Tiers of cached KV, best first; index t of PrefixView.precise tuples.
TIERS: tuple[str, ...] = ("gpu", "cpu", "disk", "remote")


@dataclass(frozen=True, slots=True)
class PrefixView:
    """How much of the request's prompt each engine can serve from cache, as the router found it.

    ``precise``: engine URL -> cumulative tokens per tier in TIERS order (entry t = the longest consecutive
    prompt prefix available at tier t or better), from KV events (the engine's own blocks) and cache-tier
    events credited to engines on the cache's node. ``approximate``: engine URL -> prompt prefix tokens
    the router itself sent there recently (for engines that publish no events). Engines absent hold
    nothing known. ``prompt_tokens`` is the prompt's length.
    """

    prompt_tokens: int
    precise: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    approximate: Mapping[str, int] = field(default_factory=dict)

    def any_hit(self) -> bool:
        return any(t and t[-1] > 0 for t in self.precise.values()) or any(self.approximate.values())

    def cached_tokens(self, engine: EngineState, use_approximate: bool = True) -> int:
        """Prompt tokens ``engine`` need not compute: its longest prefix at any tier, or, for an engine
        without KV events and with ``use_approximate``, the router's history guess when that is longer."""
        tiers = self.precise.get(engine.url)
        cached = tiers[-1] if tiers else 0
        if use_approximate and engine.knowledge != "kv-events":
            cached = max(cached, self.approximate.get(engine.url, 0))
        return cached


# Made for every decision: not frozen, whose __init__ costs a Python-level object.__setattr__ per field
# (as kvstack.frontend.routing's RouteRequest and Decision). Read-only all the same: no plugin writes one.
@dataclass(slots=True)
class SchedulingRequest:
    """One request as scheduling sees it; the router (proxy or ext_proc) builds it from the parsed body."""

    model: str
    request_id: str
    prompt_token_ids: Sequence[int] | None = None  # None when the router did not tokenize
    prefix: PrefixView | None = None  # None when no plugin asked for prefix knowledge, or it is unknown
    session_key: str | None = None  # see extract_session_key
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-cased names; only what scheduling reads
    body_fields: Mapping[str, object] = field(
        default_factory=dict
    )  # e.g. {"user": ...}; never the whole body


def extract_session_key(
    headers: Mapping[str, str],
    body: Mapping[str, object],
    header_names: Sequence[str] = SESSION_HEADERS,
    body_fields: Sequence[str] = SESSION_BODY_FIELDS,
) -> str | None:
    """The request's session key: the first non-empty session header, else the first non-empty body field.

    ``headers`` must be case-insensitive or have lower-cased names. Both modes (proxy and ext_proc) call
    this, so a session lands on the same engine whichever mode routes it.
    """
    for name in header_names:
        value = headers.get(name)
        if value:
            return value
    for name in body_fields:
        field_value = body.get(name)
        if isinstance(field_value, str) and field_value:
            return field_value
        # bool is an int, but a session id of `true` is a client bug, not a key.
        if isinstance(field_value, int) and not isinstance(field_value, bool):
            return str(field_value)
    return None


T = TypeVar("T")


class StateKey(Generic[T]):
    """A typed slot in `CycleState`; plugins that share data import the same key object."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


class CycleState:
    """Scratch space of one decision, shared by its plugins and dropped afterwards.

    ``now`` is the decision's clock (monotonic seconds), read once so every plugin sees the same time.
    ``pool`` is every engine the caller passed in, before any filtering: plugins that keep structures
    across decisions (the session ring) key them on the pool, which changes far less often than the
    per-request candidate set.
    """

    __slots__ = ("_data", "now", "pool")

    def __init__(self, now: float, pool: Sequence[EngineState] = ()) -> None:
        self.now = now
        self.pool = pool
        self._data: dict[StateKey[Any], Any] | None = None  # most decisions never write, so allocate lazily

    def get(self, key: StateKey[T]) -> T | None:
        return None if self._data is None else self._data.get(key)

    def set(self, key: StateKey[T], value: T) -> None:
        if self._data is None:
            self._data = {}
        self._data[key] = value


# Prompt tokens each engine a prefix scorer scored holds in cache, by URL, as that scorer credited them:
# what a P/D profile handler subtracts from the prompt to decide whether to prefill elsewhere.
CACHED_PROMPT_TOKENS: StateKey[dict[str, int]] = StateKey("cached-prompt-tokens")


def record_cached(state: CycleState, credited: Mapping[str, int]) -> None:
    """Add a prefix scorer's credits to CACHED_PROMPT_TOKENS; when two scorers credit one engine, the
    longer credit stands."""
    cached = state.get(CACHED_PROMPT_TOKENS)
    if cached is None:
        state.set(CACHED_PROMPT_TOKENS, dict(credited))
        return
    for url, tokens in credited.items():
        if tokens > cached.get(url, -1):
            cached[url] = tokens


class Plugin(ABC):
    """Base of every plugin: a registered type name, an instance name, and declared parameters.

    ``needs_prefix``: the plugin reads ``SchedulingRequest.prefix``, so the router must tokenize the prompt
    and look it up before scheduling (work it skips when no plugin of the config needs it).
    """

    type_name: ClassVar[str]
    kind: ClassVar[str]
    params: ClassVar[tuple[Param, ...]] = ()
    needs_prefix: ClassVar[bool] = False

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.type_name

    @classmethod
    def from_params(cls, name: str | None = None, raw: Mapping[str, object] | None = None) -> Self:
        """Build from a config entry's ``parameters``; raises PluginConfigError naming the bad parameter."""
        kwargs = check_params(cls.type_name, name or cls.type_name, cls.params, raw)
        return cls(name=name, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class Filter(Plugin):
    kind: ClassVar[str] = "filter"

    @abstractmethod
    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: list[EngineState]
    ) -> list[EngineState]:
        """The candidates that may serve the request, in input order (may return the input list itself)."""


class Scorer(Plugin):
    kind: ClassVar[str] = "scorer"

    @abstractmethod
    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        """Score per endpoint URL, higher is better, in [0, 1]: a missing URL scores 0, others are clamped."""


class ScoredEngine(NamedTuple):
    engine: EngineState
    score: float  # weighted sum over the profile's scorers


class Picker(Plugin):
    kind: ClassVar[str] = "picker"

    @abstractmethod
    def pick(
        self, request: SchedulingRequest, state: CycleState, scored: Sequence[ScoredEngine]
    ) -> list[EngineState]:
        """Every candidate in preference order: the first is the target, the rest are retry fallbacks."""


# Not frozen, as SchedulingRequest (made for every decision).
@dataclass(slots=True)
class ProfileResult:
    """What one profile chose."""

    profile: str
    targets: tuple[EngineState, ...]  # preference order; empty when a filter left no candidate
    scores: Mapping[str, float]  # weighted total per URL of the candidates that reached scoring
    emptied_by: str | None = None  # the filter that left no candidate


# Not frozen, as SchedulingRequest (made for every decision).
@dataclass(slots=True)
class SchedulingResult:
    """The decision: per profile that ran, its result; which one carries the request; which prefills it.

    Single-profile scheduling has one result and no prefill. A P/D handler returns the decode profile as
    primary and names the prefill profile when the prompt should be prefilled elsewhere first.
    """

    primary_profile: str
    profiles: Mapping[str, ProfileResult]
    prefill_profile: str | None = None

    @property
    def primary(self) -> ProfileResult:
        return self.profiles[self.primary_profile]

    @property
    def target(self) -> EngineState:
        return self.primary.targets[0]

    @property
    def fallbacks(self) -> tuple[EngineState, ...]:
        """Engines to retry on, in order, when the target fails before the first byte."""
        return self.primary.targets[1:]

    @property
    def prefill(self) -> ProfileResult | None:
        return None if self.prefill_profile is None else self.profiles[self.prefill_profile]


class ProfileHandler(Plugin):
    """Chooses which profiles run, and in which rounds, and combines their results.

    The scheduler loop: ``names = pick(profiles, results)``; run those profiles; repeat until ``pick``
    returns nothing; then ``process_results``. pd-profile-handler returns ["decode"] first, then, when the
    prompt's tokens uncached on the decode choice (read from CycleState) reach a threshold, ["prefill"],
    and finally a result with primary "decode" and prefill "prefill".
    """

    kind: ClassVar[str] = "profile-handler"

    def check_profiles(self, names: Sequence[str]) -> str | None:
        """At build time: why this handler cannot run these profiles, or None when it can."""
        return None

    @abstractmethod
    def pick(
        self,
        request: SchedulingRequest,
        state: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> list[str]:
        """Profiles to run next (none that already ran); an empty list ends the decision."""

    @abstractmethod
    def process_results(
        self, request: SchedulingRequest, state: CycleState, results: Mapping[str, ProfileResult]
    ) -> SchedulingResult:
        """The final result; raises NoEndpointError when a profile the request needs chose nothing."""


class NoEndpointReason(enum.Enum):
    """Why nothing can serve a request; the router maps MODEL_NOT_SERVED to 404, the others to 503."""

    NO_ENGINES = "no_engines"  # the pool is empty
    MODEL_NOT_SERVED = "model_not_served"  # no engine serves the model, nor might (unknown model list)
    NO_ROUTABLE_ENGINE = "no_routable_engine"  # engines serve it, none is routable right now
    FILTERED_OUT = "filtered_out"  # a profile's filters left no candidate


class NoEndpointError(Exception):
    def __init__(self, reason: NoEndpointReason, model: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.model = model
        self.detail = detail
