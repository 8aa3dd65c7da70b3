"""role-filter: keep the engines whose disaggregation role is one of ``roles``.

Rule: keep the candidates whose ``Endpoint.role`` (from discovery: ``--engine URL#role=prefill``, the engines
file, the ``kvstack.io/role`` pod label; ``both`` when not given) is listed. An empty result ends the profile
like any filter's.

Parameters:
  roles (list of both | prefill | decode, any case; default [decode, both])   the roles to keep

Cost: O(candidates), one set lookup each.
When to use: to split a P/D fleet between profiles (preset ``pd``): the decode profile keeps
[decode, both], the prefill profile [prefill].
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from kvstack.engines.state import EngineRole, EngineState
from kvstack.scheduling.interfaces import CycleState, Filter, SchedulingRequest
from kvstack.scheduling.params import Param

_ROLE_NAMES = frozenset(r.value for r in EngineRole)


def _roles_ok(value: list[object]) -> bool:
    return bool(value) and all(isinstance(r, str) and r.strip().lower() in _ROLE_NAMES for r in value)


class RoleFilter(Filter):
    type_name: ClassVar[str] = "role-filter"
    params: ClassVar[tuple[Param, ...]] = (
        Param(
            "roles",
            "roles",
            list,
            ("decode", "both"),
            f"a non-empty list of roles ({', '.join(r.value for r in EngineRole)})",
            _roles_ok,
        ),
    )

    def __init__(self, name: str | None = None, *, roles: Iterable[str] = ("decode", "both")) -> None:
        super().__init__(name)
        self.roles = frozenset(EngineRole(r.strip().lower()) for r in roles)

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: list[EngineState]
    ) -> list[EngineState]:
        roles = self.roles
        return [e for e in candidates if e.endpoint.role in roles]
