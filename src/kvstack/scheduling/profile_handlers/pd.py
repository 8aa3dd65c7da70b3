"""pd-profile-handler: decode-first prefill/decode disaggregation.

Rule: run the decode profile; its choice D carries the request. Then, with P the prompt's tokens and C the
tokens D holds in cache, prefill elsewhere when ``P - C >= threshold``: run the prefill profile and return
it as the result's prefill. C is what the decode profile's prefix scorer credited D in CycleState
(``CACHED_PROMPT_TOKENS``); when no scorer did (a one-candidate profile skips scoring) it is read from the
request's ``PrefixView``; without prefix knowledge C = 0. A request without prompt token ids is never
prefilled elsewhere. A prefill profile that finds no engine leaves the request to D alone (not an error);
a decode profile that finds none raises NoEndpointError(FILTERED_OUT) naming the filter.

Parameters:
  threshold      (integer >= 1, default 256)  uncached prompt tokens from which prefill moves off D
  decodeProfile  (default "decode")           the profile choosing the engine that serves the request
  prefillProfile (default "prefill")          the profile choosing the engine that prefills it

Cost: one or two profile runs. When to use: a fleet with prefill and decode engines (preset ``pd``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import (
    CACHED_PROMPT_TOKENS,
    CycleState,
    NoEndpointError,
    NoEndpointReason,
    ProfileHandler,
    ProfileResult,
    SchedulingRequest,
    SchedulingResult,
)
from kvstack.scheduling.params import Param


def _name_ok(value: str) -> bool:
    return bool(value)


class PDProfileHandler(ProfileHandler):
    type_name: ClassVar[str] = "pd-profile-handler"
    params: ClassVar[tuple[Param, ...]] = (
        Param("threshold", "threshold", int, 256, "an integer >= 1", lambda v: v >= 1),
        Param("decodeProfile", "decode_profile", str, "decode", "a profile name", _name_ok),
        Param("prefillProfile", "prefill_profile", str, "prefill", "a profile name", _name_ok),
    )

    def __init__(
        self,
        name: str | None = None,
        *,
        threshold: int = 256,
        decode_profile: str = "decode",
        prefill_profile: str = "prefill",
    ) -> None:
        super().__init__(name)
        self.threshold = threshold
        self.decode_profile = decode_profile
        self.prefill_profile = prefill_profile

    def check_profiles(self, names: Sequence[str]) -> str | None:
        decode, prefill = self.decode_profile, self.prefill_profile
        if decode == prefill:
            return f"{self.type_name}: decodeProfile and prefillProfile are both {decode!r}; name two"
        if sorted(names) != sorted((decode, prefill)):
            return (
                f"{self.type_name} runs exactly the profiles {decode!r} (decodeProfile) and {prefill!r} "
                f"(prefillProfile), got: {', '.join(names)}"
            )
        return None

    def pick(
        self,
        request: SchedulingRequest,
        state: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> list[str]:
        decode = results.get(self.decode_profile)
        if decode is None:
            return [self.decode_profile]
        if self.prefill_profile in results or not decode.targets:
            return []
        uncached = uncached_tokens(request, state, decode.targets[0])
        return [self.prefill_profile] if uncached is not None and uncached >= self.threshold else []

    def process_results(
        self, request: SchedulingRequest, state: CycleState, results: Mapping[str, ProfileResult]
    ) -> SchedulingResult:
        decode = results[self.decode_profile]
        if not decode.targets:
            raise NoEndpointError(
                NoEndpointReason.FILTERED_OUT,
                request.model,
                f"no engine for model {request.model!r}: filter {decode.emptied_by!r} of profile "
                f"{decode.profile!r} left no candidate",
            )
        prefill = results.get(self.prefill_profile)
        return SchedulingResult(
            primary_profile=self.decode_profile,
            profiles=results,
            prefill_profile=self.prefill_profile if prefill is not None and prefill.targets else None,
        )


def uncached_tokens(request: SchedulingRequest, state: CycleState, engine: EngineState) -> int | None:
    """Prompt tokens ``engine`` would have to compute; None when the prompt's tokens are unknown."""
    if request.prompt_token_ids is None:
        return None
    credited = state.get(CACHED_PROMPT_TOKENS)
    if credited is not None and engine.url in credited:
        cached = credited[engine.url]
    elif request.prefix is not None:
        cached = request.prefix.cached_tokens(engine)
    else:
        cached = 0
    return max(0, len(request.prompt_token_ids) - cached)
