"""Named scheduling configs for ``--routing``, written in the same YAML a user would write.

- round-robin: rotate over the routable engines in URL order, ignoring load.
- session: session-affinity-scorer weighted 4, above the load scorers' sum (3), so a session key (header or
  body ``user``) decides whenever present and load decides otherwise; saturation-filter moves a session off
  an overloaded engine to its next one on the ring.
- least-load: queue + kv-cache-utilization + active-requests scorers, equal weights, highest total wins.
- power-of-two: least-load's scorers with power-of-two-picker, so a burst scored on one stale scrape spreads.
- default: saturation-filter (queue above 5 or KV usage above 0.8), then queue and KV usage weighted 2 and
  in-flight (active-requests) 1.
- kv-aware: saturation-filter, precise-prefix-scorer weighted 3 (KV events; routing history for engines
  without events), then no-hit-lru, the three load scorers and least-qps (10 s window) weighted 1 each.
- prefix: kv-aware with approximate-prefix-scorer (the router's own history) instead of KV events, for
  engines that publish none.
- kv-aware-replicas: kv-aware without what reads one replica's own send history (no-hit-lru, least-qps,
  the prefix scorer's routing-history guess): total = 3 * prefix (KV and cache events only) + queue +
  kv-utilization + active-requests; max-score-picker with ``tieBreak: hash`` and ``tieTolerance: 0.05``
  (totals closer than that are ties: a scrape that caught one running request does not decide). For
  several endpoint-picker replicas fed the same events and metrics: they decide alike, and a cold prompt goes
  where its hash sends it. ``kvstack epp``'s "auto" choice once some engine publishes KV events.
- default-replicas: default with the same hash tie-break; ``kvstack epp``'s "auto" choice while no engine
  publishes KV events.
- pd: prefill/decode disaggregation by pd-profile-handler (threshold 256). Profile decode: role-filter
  [decode, both], saturation-filter, total = 3 * precise-prefix + queue + kv-utilization + active-requests.
  Profile prefill, run only when the decode choice lacks >= 256 of the prompt's tokens in cache: role-filter
  [prefill], total = precise-prefix + queue + kv-utilization + active-requests. Max-score pickers.

Why these weights: docs/design/scheduling.md; kv-aware against other routers: docs/benchmarks/kv-routing.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from kvstack.scheduling.config import ConfigError, SchedulerConfig, load_config, parse_config

_ROUND_ROBIN = """\
plugins:
- type: round-robin-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: round-robin-picker
"""

_SESSION = """\
plugins:
- type: saturation-filter
- type: session-affinity-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-requests-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: saturation-filter
  - pluginRef: session-affinity-scorer
    weight: 4
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: active-requests-scorer
    weight: 1
  - pluginRef: max-score-picker
"""

_LEAST_LOAD = """\
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-requests-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: active-requests-scorer
    weight: 1
  - pluginRef: max-score-picker
"""

_POWER_OF_TWO = """\
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-requests-scorer
- type: power-of-two-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: active-requests-scorer
    weight: 1
  - pluginRef: power-of-two-picker
"""

_DEFAULT_TEMPLATE = """\
plugins:
- type: saturation-filter
  parameters:
    queueThreshold: 5
    kvUsageThreshold: 0.8
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-requests-scorer
- type: max-score-picker{picker_parameters}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: saturation-filter
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: active-requests-scorer
    weight: 1
  - pluginRef: max-score-picker
"""

_KV_AWARE_REPLICAS_TEMPLATE = """\
plugins:
- type: saturation-filter
  parameters:
    queueThreshold: 5
    kvUsageThreshold: 0.8
- type: precise-prefix-scorer
  parameters:
    useApproximate: false
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-requests-scorer
- type: max-score-picker{picker_parameters}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: saturation-filter
  - pluginRef: precise-prefix-scorer
    weight: 3
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: active-requests-scorer
    weight: 1
  - pluginRef: max-score-picker
"""

_PREFIX_TEMPLATE = """\
plugins:
- type: saturation-filter
  parameters:
    queueThreshold: 5
    kvUsageThreshold: 0.8
- type: {prefix_scorer}
- type: no-hit-lru-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-requests-scorer
- type: least-qps-scorer
  parameters:
    windowSeconds: 10
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: saturation-filter
  - pluginRef: {prefix_scorer}
    weight: 3
  - pluginRef: no-hit-lru-scorer
    weight: 1
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: active-requests-scorer
    weight: 1
  - pluginRef: least-qps-scorer
    weight: 1
  - pluginRef: max-score-picker
"""

_PD = """\
plugins:
- type: pd-profile-handler
  parameters:
    threshold: 256
- name: decode-filter
  type: role-filter
  parameters:
    roles: [decode, both]
- name: prefill-filter
  type: role-filter
  parameters:
    roles: [prefill]
- type: saturation-filter
  parameters:
    queueThreshold: 5
    kvUsageThreshold: 0.8
- type: precise-prefix-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-requests-scorer
- type: max-score-picker
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: saturation-filter
  - pluginRef: precise-prefix-scorer
    weight: 3
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: active-requests-scorer
    weight: 1
  - pluginRef: max-score-picker
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: precise-prefix-scorer
    weight: 1
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: active-requests-scorer
    weight: 1
  - pluginRef: max-score-picker
"""

_HASH_TIE_BREAK = """
  parameters:
    tieBreak: hash
    tieTolerance: 0.05"""

DEFAULT_PRESET = "default"

PRESETS: Mapping[str, str] = MappingProxyType(
    {
        "default": _DEFAULT_TEMPLATE.format(picker_parameters=""),
        "round-robin": _ROUND_ROBIN,
        "session": _SESSION,
        "least-load": _LEAST_LOAD,
        "power-of-two": _POWER_OF_TWO,
        "kv-aware": _PREFIX_TEMPLATE.format(prefix_scorer="precise-prefix-scorer"),
        "prefix": _PREFIX_TEMPLATE.format(prefix_scorer="approximate-prefix-scorer"),
        "kv-aware-replicas": _KV_AWARE_REPLICAS_TEMPLATE.format(picker_parameters=_HASH_TIE_BREAK),
        "default-replicas": _DEFAULT_TEMPLATE.format(picker_parameters=_HASH_TIE_BREAK),
        "pd": _PD,
    }
)


def preset_config(name: str) -> SchedulerConfig:
    text = PRESETS.get(name)
    if text is None:
        raise ConfigError(f"<preset {name}>", None, f"no such preset; presets: {', '.join(PRESETS)}")
    return parse_config(text, f"<preset {name}>")


def load_routing(value: str | os.PathLike[str]) -> SchedulerConfig:
    """The config a ``--routing`` value names: a preset name, or the path of a YAML config file."""
    if isinstance(value, str) and value in PRESETS:
        return preset_config(value)
    if not Path(value).exists():
        raise ConfigError(
            os.fspath(value), None, f"neither a preset ({', '.join(PRESETS)}) nor an existing config file"
        )
    return load_config(value)
