"""What Kubernetes manifests say about the target labels Prometheus will attach.

``Manifests`` gathers Services (name, namespace, labels, named ports), ServiceMonitors and PodMonitors
(endpoint ports, ``jobLabel``, selector, relabelings) and workloads (Deployments, StatefulSets,
DaemonSets, Pods: pod labels, container port names) from parsed objects, and answers which values the
``endpoint``, ``service``, ``namespace`` and ``job`` labels can take (prometheus-operator's rules: a
ServiceMonitor's job is the Service's name or the value of its ``jobLabel`` label; a PodMonitor's is
``namespace/name`` or the pod's ``jobLabel`` label; a relabeling that replaces ``job`` with a fixed value
wins). A label whose values cannot be known (a relabeling with ``$1``, a monitor selecting objects these
manifests do not hold, nothing defining it) answers None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Manifests", "Monitor", "Service", "Workload"]

_WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    namespace: str | None
    labels: Mapping[str, str]
    ports: tuple[str, ...]  # port names


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str
    name: str
    namespace: str | None
    pod_labels: Mapping[str, str]
    ports: tuple[str, ...]  # container port names


@dataclass(frozen=True, slots=True)
class Monitor:
    kind: str  # "ServiceMonitor" or "PodMonitor"
    name: str
    namespace: str | None
    ports: tuple[str, ...]
    job_label: str | None
    selector: Mapping[str, str]  # matchLabels (matchExpressions are not evaluated: they match everything)
    job_replacements: tuple[str | None, ...]  # a fixed job per relabeling that sets it; None when dynamic
    target_labels: tuple[str, ...]  # every label a relabeling writes


@dataclass(slots=True)
class Manifests:
    services: list[Service] = field(default_factory=list)
    workloads: list[Workload] = field(default_factory=list)
    monitors: list[Monitor] = field(default_factory=list)
    namespaces: set[str] = field(default_factory=set)

    def add(self, obj: Mapping[str, Any]) -> None:
        """Record the facts of one object (``kind: List``: of its items); other kinds name namespaces."""
        kind = str(obj.get("kind", ""))
        if kind == "List":
            for item in obj.get("items") or []:
                if isinstance(item, Mapping):
                    self.add(item)
            return
        meta = _mapping(obj.get("metadata"))
        name = str(meta.get("name", ""))
        namespace = meta.get("namespace")
        namespace = str(namespace) if namespace else None
        if kind == "Namespace":
            self.namespaces.add(name)
        elif namespace:
            self.namespaces.add(namespace)
        spec = _mapping(obj.get("spec"))
        if kind == "Service":
            ports = tuple(str(p["name"]) for p in _list(spec.get("ports")) if p.get("name"))
            self.services.append(Service(name, namespace, _labels(meta), ports))
        elif kind == "Pod":
            self.workloads.append(Workload(kind, name, namespace, _labels(meta), _container_ports(spec)))
        elif kind in _WORKLOADS:
            template = _mapping(spec.get("template"))
            pod_spec = _mapping(template.get("spec"))
            self.workloads.append(
                Workload(
                    kind,
                    name,
                    namespace,
                    _labels(_mapping(template.get("metadata"))),
                    _container_ports(pod_spec),
                )
            )
        elif kind in ("ServiceMonitor", "PodMonitor"):
            key = "endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"
            endpoints = _list(spec.get(key))
            relabelings = [r for e in endpoints for r in _list(e.get("relabelings"))]
            self.monitors.append(
                Monitor(
                    kind=kind,
                    name=name,
                    namespace=namespace,
                    ports=tuple(str(e.get("port") or e.get("targetPort")) for e in endpoints if _port(e)),
                    job_label=str(spec["jobLabel"]) if spec.get("jobLabel") else None,
                    selector={
                        str(k): str(v)
                        for k, v in _mapping(_mapping(spec.get("selector")).get("matchLabels")).items()
                    },
                    job_replacements=tuple(
                        _fixed_replacement(r) for r in relabelings if r.get("targetLabel") == "job"
                    ),
                    target_labels=tuple(str(r["targetLabel"]) for r in relabelings if r.get("targetLabel")),
                )
            )

    def target_labels(self) -> set[str]:
        """Labels the monitors' relabelings add to every series they scrape."""
        return {label for m in self.monitors for label in m.target_labels}

    def values(self, label: str) -> set[str] | None:
        """The values ``label`` can take on scraped series, or None when the manifests do not tell."""
        if label == "endpoint":
            found = {p for m in self.monitors for p in m.ports} | {p for s in self.services for p in s.ports}
        elif label == "service":
            found = {s.name for s in self.services}
        elif label == "namespace":
            found = set(self.namespaces)
        elif label == "job":
            jobs = self._jobs()
            if jobs is None:
                return None
            found = jobs
        else:
            return None
        return found or None

    def _jobs(self) -> set[str] | None:
        if not self.monitors:
            return None
        jobs: set[str] = set()
        for monitor in self.monitors:
            if monitor.job_replacements:
                if None in monitor.job_replacements:
                    return None
                jobs.update(r for r in monitor.job_replacements if r is not None)
            elif monitor.kind == "ServiceMonitor":
                services = [s for s in self.services if _selects(monitor.selector, s.labels)]
                if not services:
                    return None  # it scrapes Services these manifests do not hold
                jobs.update(s.labels.get(monitor.job_label or "", s.name) for s in services)
            elif monitor.job_label:
                pods = [w.pod_labels for w in self.workloads if _selects(monitor.selector, w.pod_labels)]
                if not pods:
                    return None
                jobs.update(labels.get(monitor.job_label, "") for labels in pods)
            else:
                jobs.add(f"{monitor.namespace or 'default'}/{monitor.name}")
        return jobs


def _port(endpoint: Mapping[str, Any]) -> bool:
    return bool(endpoint.get("port") or endpoint.get("targetPort"))


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _fixed_replacement(relabeling: Mapping[str, Any]) -> str | None:
    replacement = relabeling.get("replacement")
    if relabeling.get("action", "replace") != "replace" or replacement is None or "$" in str(replacement):
        return None
    return str(replacement)


def _container_ports(pod_spec: Mapping[str, Any]) -> tuple[str, ...]:
    containers = _list(pod_spec.get("containers")) + _list(pod_spec.get("initContainers"))
    return tuple(str(p["name"]) for c in containers for p in _list(c.get("ports")) if p.get("name"))


def _labels(meta: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in _mapping(meta.get("labels")).items()}


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []
