"""single-profile-handler: run the one configured profile; its choice is the decision.

Rule: exactly one profile; run it once; its targets are the result. When its filters left no candidate,
NoEndpointError(FILTERED_OUT) names the filter.

Parameters: none. Cost: one profile run.
When to use: every configuration without prefill/decode disaggregation (the default when a config names
no handler).

For P/D disaggregation, see pd-profile-handler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvstack.scheduling.interfaces import (
    CycleState,
    NoEndpointError,
    NoEndpointReason,
    ProfileHandler,
    ProfileResult,
    SchedulingRequest,
    SchedulingResult,
)


class SingleProfileHandler(ProfileHandler):
    type_name: ClassVar[str] = "single-profile-handler"

    def check_profiles(self, names: Sequence[str]) -> str | None:
        if len(names) != 1:
            return (
                f"{self.type_name} runs exactly one scheduling profile, got {len(names)}: {', '.join(names)}"
            )
        return None

    def pick(
        self,
        request: SchedulingRequest,
        state: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> list[str]:
        return [] if results else [profiles[0]]

    def process_results(
        self, request: SchedulingRequest, state: CycleState, results: Mapping[str, ProfileResult]
    ) -> SchedulingResult:
        (result,) = results.values()
        if not result.targets:
            raise NoEndpointError(
                NoEndpointReason.FILTERED_OUT,
                request.model,
                f"no engine for model {request.model!r}: filter {result.emptied_by!r} of profile "
                f"{result.profile!r} left no candidate",
            )
        return SchedulingResult(primary_profile=result.profile, profiles=results)
