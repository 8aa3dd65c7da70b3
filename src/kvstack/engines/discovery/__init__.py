"""Engine discovery: which engines exist, as a stream of per-endpoint updates (see ``base``).

Sources: ``StaticDiscovery`` (``--engine`` strings), ``FileDiscovery`` (a polled YAML file),
``KubernetesDiscovery`` (pods, list + watch). Engine fields are checked by ``kvstack.engines.specs``.
"""

from kvstack.engines.discovery.base import (
    RETRY_BACKOFF,
    Discovery,
    DiscoveryConfigError,
    DiscoveryUpdate,
    ModelFetcher,
    UpdateCallback,
    UpdateKind,
)
from kvstack.engines.discovery.file import FileDiscovery, parse_engines_file
from kvstack.engines.discovery.kubernetes import KubernetesDiscovery, PodKeys, pod_endpoint
from kvstack.engines.discovery.static import StaticDiscovery, parse_engine_spec

__all__ = [
    "RETRY_BACKOFF",
    "Discovery",
    "DiscoveryConfigError",
    "DiscoveryUpdate",
    "FileDiscovery",
    "KubernetesDiscovery",
    "ModelFetcher",
    "PodKeys",
    "StaticDiscovery",
    "UpdateCallback",
    "UpdateKind",
    "parse_engine_spec",
    "parse_engines_file",
    "pod_endpoint",
]
