"""Scheduling: which engine serves a request. Pure decisions over `EngineState`s, no I/O.

Build a `Scheduler` with ``build_scheduler(load_routing("default"))`` (or a YAML path), then call
``scheduler.schedule(request, engines)``. Interfaces are in `interfaces`, each plugin in its own module
under filters/, scorers/, pickers/ and profile_handlers/, with its formula in the module docstring.
"""

from kvstack.scheduling.config import (
    ConfigError,
    PluginRef,
    PluginSpec,
    ProfileSpec,
    SchedulerConfig,
    build_scheduler,
    load_config,
    parse_config,
)
from kvstack.scheduling.interfaces import (
    SESSION_BODY_FIELDS,
    SESSION_HEADERS,
    CycleState,
    Filter,
    NoEndpointError,
    NoEndpointReason,
    Picker,
    Plugin,
    ProfileHandler,
    ProfileResult,
    SchedulingRequest,
    SchedulingResult,
    ScoredEngine,
    Scorer,
    StateKey,
    extract_session_key,
)
from kvstack.scheduling.params import Param, PluginConfigError
from kvstack.scheduling.presets import DEFAULT_PRESET, PRESETS, load_routing, preset_config
from kvstack.scheduling.registry import BUILTIN_PLUGINS, PluginRegistry, default_registry
from kvstack.scheduling.scheduler import Scheduler, SchedulerProfile

__all__ = [
    "BUILTIN_PLUGINS",
    "DEFAULT_PRESET",
    "PRESETS",
    "SESSION_BODY_FIELDS",
    "SESSION_HEADERS",
    "ConfigError",
    "CycleState",
    "Filter",
    "NoEndpointError",
    "NoEndpointReason",
    "Param",
    "Picker",
    "Plugin",
    "PluginConfigError",
    "PluginRef",
    "PluginRegistry",
    "PluginSpec",
    "ProfileHandler",
    "ProfileResult",
    "ProfileSpec",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerProfile",
    "SchedulingRequest",
    "SchedulingResult",
    "ScoredEngine",
    "Scorer",
    "StateKey",
    "build_scheduler",
    "default_registry",
    "extract_session_key",
    "load_config",
    "load_routing",
    "parse_config",
    "preset_config",
]
