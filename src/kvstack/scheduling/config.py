"""The scheduling config file (YAML, in llm-d's shape) and building a Scheduler from it.

    plugins:                      # every plugin instance, by type; name defaults to the type
    - type: saturation-filter
      parameters: {queueThreshold: 5}
    - type: queue-scorer
    - type: max-score-picker
    schedulingProfiles:           # per profile: filters in listed order, weighted scorers, one picker
    - name: default
      plugins:
      - pluginRef: saturation-filter
      - pluginRef: queue-scorer
        weight: 2                 # scorers only; default 1; totals are not normalised
      - pluginRef: max-score-picker

A profile without a picker uses max-score. A profile handler is declared in ``plugins`` and not referenced
by a profile; without one, single-profile-handler is used. llm-d's ``apiVersion`` and ``kind`` keys are
accepted and ignored. `load_config`/`parse_config` check the shape; `build_scheduler` checks types, kinds
and parameters against the plugin registry. Every error is a ConfigError naming the file and the entry.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvstack.scheduling.interfaces import Filter, Picker, Plugin, ProfileHandler, Scorer
from kvstack.scheduling.params import PluginConfigError
from kvstack.scheduling.registry import PluginRegistry, default_registry
from kvstack.scheduling.scheduler import Scheduler, SchedulerProfile

_TOP_KEYS = frozenset({"plugins", "schedulingProfiles", "apiVersion", "kind"})
_PLUGIN_KEYS = frozenset({"type", "name", "parameters"})
_PROFILE_KEYS = frozenset({"name", "plugins"})
_REF_KEYS = frozenset({"pluginRef", "weight"})


class ConfigError(ValueError):
    """An invalid scheduling config; the message is "<source>: <entry>: <what is wrong>"."""

    def __init__(self, source: str, where: str | None, message: str) -> None:
        super().__init__(f"{source}: {where}: {message}" if where else f"{source}: {message}")
        self.source = source
        self.where = where


@dataclass(frozen=True, slots=True)
class PluginSpec:
    type: str
    name: str
    parameters: Mapping[str, object]
    where: str  # the entry's location in the file, for errors


@dataclass(frozen=True, slots=True)
class PluginRef:
    ref: str
    weight: float | None
    where: str


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    name: str
    plugins: tuple[PluginRef, ...]
    where: str


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    source: str  # file path, or "<preset NAME>", or "<string>"
    plugins: tuple[PluginSpec, ...]
    profiles: tuple[ProfileSpec, ...]
    text: str | None = field(default=None, compare=False)  # the YAML it came from, when there was one


def load_config(path: str | os.PathLike[str]) -> SchedulerConfig:
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, None, f"cannot read the scheduling config: {exc}") from None
    return parse_config(text, source)


def parse_config(text: str, source: str = "<string>") -> SchedulerConfig:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, None, f"invalid YAML: {exc}") from None
    return _parse_document(doc, source, text)


def _parse_document(doc: object, source: str, text: str | None) -> SchedulerConfig:
    def fail(where: str | None, message: str) -> ConfigError:
        return ConfigError(source, where, message)

    if not isinstance(doc, Mapping):
        raise fail(None, f"expected a mapping with 'plugins' and 'schedulingProfiles', got {_kind(doc)}")
    _no_unknown_keys(doc, _TOP_KEYS, None, fail)
    raw_plugins = doc.get("plugins")
    if not isinstance(raw_plugins, list) or not raw_plugins:
        raise fail("plugins", f"must be a non-empty list of plugin entries, got {_kind(raw_plugins)}")
    plugins: list[PluginSpec] = []
    seen: dict[str, str] = {}
    for i, entry in enumerate(raw_plugins):
        where = f"plugins[{i}]"
        if not isinstance(entry, Mapping):
            raise fail(where, f"must be a mapping with 'type', got {_kind(entry)}")
        _no_unknown_keys(entry, _PLUGIN_KEYS, where, fail)
        type_name = entry.get("type")
        if not isinstance(type_name, str) or not type_name:
            raise fail(where, f"'type' must be a non-empty string, got {type_name!r}")
        name = entry.get("name", type_name)
        if not isinstance(name, str) or not name:
            raise fail(where, f"'name' must be a non-empty string, got {name!r}")
        where = f"plugins[{i}] ({name!r})"
        if name in seen:
            raise fail(
                where, f"duplicate plugin name {name!r} (also {seen[name]}); give one a distinct 'name'"
            )
        seen[name] = where
        params = entry.get("parameters")
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            raise fail(where, f"'parameters' must be a mapping, got {_kind(params)}")
        plugins.append(PluginSpec(type_name, name, dict(params), where))

    raw_profiles = doc.get("schedulingProfiles")
    if not isinstance(raw_profiles, list) or not raw_profiles:
        raise fail("schedulingProfiles", f"must be a non-empty list of profiles, got {_kind(raw_profiles)}")
    profiles: list[ProfileSpec] = []
    profile_names: set[str] = set()
    for i, entry in enumerate(raw_profiles):
        where = f"schedulingProfiles[{i}]"
        if not isinstance(entry, Mapping):
            raise fail(where, f"must be a mapping with 'name' and 'plugins', got {_kind(entry)}")
        _no_unknown_keys(entry, _PROFILE_KEYS, where, fail)
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise fail(where, f"'name' must be a non-empty string, got {name!r}")
        where = f"schedulingProfiles[{i}] ({name!r})"
        if name in profile_names:
            raise fail(where, f"duplicate profile name {name!r}")
        profile_names.add(name)
        raw_refs = entry.get("plugins")
        if not isinstance(raw_refs, list) or not raw_refs:
            raise fail(
                where, f"'plugins' must be a non-empty list of pluginRef entries, got {_kind(raw_refs)}"
            )
        refs: list[PluginRef] = []
        for j, ref in enumerate(raw_refs):
            ref_where = f"{where}.plugins[{j}]"
            if not isinstance(ref, Mapping):
                raise fail(ref_where, f"must be a mapping with 'pluginRef', got {_kind(ref)}")
            _no_unknown_keys(ref, _REF_KEYS, ref_where, fail)
            target = ref.get("pluginRef")
            if not isinstance(target, str) or not target:
                raise fail(ref_where, f"'pluginRef' must be a plugin name, got {target!r}")
            ref_where = f"{ref_where} ({target!r})"
            weight = ref.get("weight")
            if weight is not None and (
                isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < math.inf
            ):
                raise fail(ref_where, f"'weight' must be a finite number >= 0, got {weight!r}")
            refs.append(PluginRef(target, None if weight is None else float(weight), ref_where))
        profiles.append(ProfileSpec(name, tuple(refs), where))
    return SchedulerConfig(source, tuple(plugins), tuple(profiles), text)


def build_scheduler(config: SchedulerConfig, registry: PluginRegistry | None = None) -> Scheduler:
    """Instantiate the config's plugins and profiles; ConfigError names the offending entry."""
    registry = registry or default_registry()
    source = config.source
    instances: dict[str, Plugin] = {}
    where_of: dict[str, str] = {}
    handlers: list[ProfileHandler] = []
    for spec in config.plugins:
        try:
            plugin = registry.create(spec.type, spec.name, spec.parameters)
        except PluginConfigError as exc:
            raise ConfigError(source, spec.where, str(exc)) from None
        instances[spec.name] = plugin
        where_of[spec.name] = spec.where
        if isinstance(plugin, ProfileHandler):
            if handlers:
                raise ConfigError(
                    source,
                    spec.where,
                    f"a second profile handler; {where_of[handlers[0].name]} is one already",
                )
            handlers.append(plugin)

    used: set[str] = set()
    profiles: list[SchedulerProfile] = []
    for profile in config.profiles:
        filters: list[Filter] = []
        scorers: list[tuple[Scorer, float]] = []
        picker: Picker | None = None
        in_profile: set[str] = set()
        for ref in profile.plugins:
            found = instances.get(ref.ref)
            if found is None:
                raise ConfigError(
                    source, ref.where, f"no plugin named {ref.ref!r}; declared: {', '.join(instances)}"
                )
            if ref.ref in in_profile:
                raise ConfigError(source, ref.where, f"plugin {ref.ref!r} is listed twice in this profile")
            in_profile.add(ref.ref)
            used.add(ref.ref)
            plugin = found
            if ref.weight is not None and not isinstance(plugin, Scorer):
                raise ConfigError(
                    source, ref.where, f"'weight' applies to scorers only; {ref.ref!r} is a {plugin.kind}"
                )
            if isinstance(plugin, Filter):
                filters.append(plugin)
            elif isinstance(plugin, Scorer):
                scorers.append((plugin, 1.0 if ref.weight is None else ref.weight))
            elif isinstance(plugin, Picker):
                if picker is not None:
                    raise ConfigError(
                        source,
                        ref.where,
                        f"a profile has one picker; {picker.name!r} is already this profile's",
                    )
                picker = plugin
            else:
                raise ConfigError(
                    source,
                    ref.where,
                    f"{ref.ref!r} is a {plugin.kind}: declare it under 'plugins' only, not in a profile",
                )
        profiles.append(SchedulerProfile(profile.name, filters, scorers, picker))

    unused = [
        name
        for name, plugin in instances.items()
        if name not in used and not isinstance(plugin, ProfileHandler)
    ]
    if unused:
        raise ConfigError(
            source,
            where_of[unused[0]],
            f"plugin {unused[0]!r} is declared but no profile references it (a misspelt pluginRef?)",
        )
    handler = handlers[0] if handlers else None
    try:
        return Scheduler(profiles, handler)
    except ValueError as exc:
        raise ConfigError(source, "schedulingProfiles", str(exc)) from None


def _no_unknown_keys(
    entry: Mapping[object, object],
    allowed: frozenset[str],
    where: str | None,
    fail: Callable[[str | None, str], ConfigError],
) -> None:
    for key in entry:
        if key not in allowed:
            raise fail(where, f"unknown key {key!r}; expected {', '.join(sorted(allowed))}")


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__
