"""Plugin types by name: the table config files refer to with ``type:``.

`default_registry()` returns a fresh registry holding the built-in plugins; the composition root may
`register` more before building a scheduler. There is no global registry to mutate at import time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvstack.scheduling.filters.health import HealthFilter
from kvstack.scheduling.filters.model import ModelFilter
from kvstack.scheduling.filters.role import RoleFilter
from kvstack.scheduling.filters.saturation import SaturationFilter
from kvstack.scheduling.interfaces import Plugin
from kvstack.scheduling.params import PluginConfigError
from kvstack.scheduling.pickers.max_score import MaxScorePicker
from kvstack.scheduling.pickers.power_of_two import PowerOfTwoPicker
from kvstack.scheduling.pickers.random_picker import RandomPicker
from kvstack.scheduling.pickers.round_robin import RoundRobinPicker
from kvstack.scheduling.pickers.weighted_random import WeightedRandomPicker
from kvstack.scheduling.profile_handlers.pd import PDProfileHandler
from kvstack.scheduling.profile_handlers.single import SingleProfileHandler
from kvstack.scheduling.scorers.active_requests import ActiveRequestsScorer
from kvstack.scheduling.scorers.approximate_prefix import ApproximatePrefixScorer
from kvstack.scheduling.scorers.kv_utilization import KVCacheUtilizationScorer
from kvstack.scheduling.scorers.least_qps import LeastQPSScorer
from kvstack.scheduling.scorers.load_aware import LoadAwareScorer
from kvstack.scheduling.scorers.no_hit_lru import NoHitLRUScorer
from kvstack.scheduling.scorers.precise_prefix import PrecisePrefixScorer
from kvstack.scheduling.scorers.queue import QueueScorer
from kvstack.scheduling.scorers.running import RunningRequestsScorer
from kvstack.scheduling.scorers.session_affinity import SessionAffinityScorer

BUILTIN_PLUGINS: tuple[type[Plugin], ...] = (
    ModelFilter,
    HealthFilter,
    SaturationFilter,
    RoleFilter,
    QueueScorer,
    RunningRequestsScorer,
    KVCacheUtilizationScorer,
    LoadAwareScorer,
    ActiveRequestsScorer,
    SessionAffinityScorer,
    LeastQPSScorer,
    PrecisePrefixScorer,
    ApproximatePrefixScorer,
    NoHitLRUScorer,
    MaxScorePicker,
    RandomPicker,
    WeightedRandomPicker,
    RoundRobinPicker,
    PowerOfTwoPicker,
    SingleProfileHandler,
    PDProfileHandler,
)


class PluginRegistry:
    """Plugin classes by type name."""

    def __init__(self, plugin_types: Iterable[type[Plugin]] = ()) -> None:
        self._types: dict[str, type[Plugin]] = {}
        for plugin_type in plugin_types:
            self.register(plugin_type)

    def register(self, plugin_type: type[Plugin]) -> None:
        name = plugin_type.type_name
        existing = self._types.get(name)
        if existing is not None and existing is not plugin_type:
            raise ValueError(f"plugin type {name!r} is already registered to {existing.__qualname__}")
        self._types[name] = plugin_type

    @property
    def types(self) -> Mapping[str, type[Plugin]]:
        return self._types

    def create(
        self, type_name: str, name: str | None = None, params: Mapping[str, object] | None = None
    ) -> Plugin:
        """A plugin instance from a config entry; PluginConfigError names an unknown type or bad parameter."""
        plugin_type = self._types.get(type_name)
        if plugin_type is None:
            raise PluginConfigError(
                f"unknown plugin type {type_name!r}; known types: {', '.join(sorted(self._types))}"
            )
        return plugin_type.from_params(name, params)


def default_registry() -> PluginRegistry:
    return PluginRegistry(BUILTIN_PLUGINS)
