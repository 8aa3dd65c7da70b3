"""The rendered manifests fit together and fit kvstack: selectors select, named ports exist, RBAC binds,
every kvstack container's args parse with kvstack's own CLI parser, the front end's discovery finds the engine
pods and reads their labels and annotations as intended, the engines' KV connector and KV-event configs
parse, the scrape configs give the agreed job names, and the Envoy bootstrap is what
``kvstack envoy-config`` renders today and what Envoy accepts (``--mode validate``). No cluster is needed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import (
    V1Container,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)

from kvstack.cli import build_parser, envoy_config, front_end
from kvstack.connector.config import parse_config
from kvstack.engines.discovery.kubernetes import PodKeys, pod_endpoint
from kvstack.engines.state import EngineRole
from support import envoy
from support.manifests import (
    DEPLOY,
    container_ports,
    containers,
    expanded_args,
    flag,
    named,
    of_kind,
    pod_templates,
    render,
    selects,
    template_ports,
)

FRONT_ENDS = ["base", "overlays/example", "overlays/envoy", "overlays/pd", "overlays/envoy-pd"]
JOBS = {"kvstack-router", "kvstack-epp", "kvstack-sidecar", "kvstack-cache-server", "vllm"}
KEYS = PodKeys()
POD_IP = "10.1.2.3"

Obj = dict[str, Any]


@functools.cache
def rendered(path: str) -> list[Obj]:
    return render(DEPLOY / path)


def kvstack_containers(objects: list[Obj], command: str) -> list[Obj]:
    return [
        c
        for _, template in pod_templates(objects)
        for c in containers(template)
        if c.get("args", [None])[0] == command and "command" not in c
    ]


def engine_templates(objects: list[Obj]) -> list[Obj]:
    return [t for _, t in pod_templates(objects) if t["metadata"]["labels"].get(KEYS.role_label)]


def vllm_container(template: Obj) -> Obj:
    (container,) = [c for c in containers(template) if c.get("command") == ["vllm", "serve"]]
    return container


@pytest.mark.parametrize("path", FRONT_ENDS)
def test_every_service_selects_a_pod_template_with_its_target_ports(path: str) -> None:
    objects = rendered(path)
    for service in of_kind(objects, "Service"):
        chosen = [
            t
            for _, t in pod_templates(objects)
            if selects(service["spec"]["selector"], t["metadata"]["labels"])
        ]
        assert chosen, f"Service {service['metadata']['name']} selects no pod"
        for template in chosen:
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in template_ports(template), (service["metadata"]["name"], port)


@pytest.mark.parametrize("path", FRONT_ENDS)
def test_service_monitors_name_ports_of_the_services_they_select_and_give_the_agreed_jobs(path: str) -> None:
    objects = rendered(path)
    jobs = set()
    for monitor in of_kind(objects, "ServiceMonitor"):
        spec = monitor["spec"]
        chosen = [
            s
            for s in of_kind(objects, "Service")
            if selects(spec["selector"]["matchLabels"], s["metadata"].get("labels", {}))
        ]
        assert chosen, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for service in chosen:
            names = {p["name"] for p in service["spec"]["ports"]}
            assert {e["port"] for e in spec["endpoints"]} <= names
            jobs.add(service["metadata"]["labels"][spec["jobLabel"]])
    targets = pod_monitor_targets(objects)
    jobs |= {job for _, _, job in targets}
    # Each engine's vLLM is scraped once, as vllm, on its own port; each P/D sidecar once, as kvstack-sidecar.
    expected = []
    for workload, template in pod_templates(objects):
        for container in containers(template):
            if container.get("command") == ["vllm", "serve"]:
                port = int(flag(expanded_args(container), "--port"))
                expected.append((workload["metadata"]["name"], container["name"], "vllm"))
                assert port in container_ports(container).values()
            elif container.get("args", [None])[0] == "sidecar":
                expected.append((workload["metadata"]["name"], container["name"], "kvstack-sidecar"))
    assert sorted(targets) == sorted(expected)
    front = "kvstack-epp" if "envoy" in path else "kvstack-router"
    assert {front, "kvstack-cache-server", "vllm"} <= jobs <= JOBS


def pod_monitor_targets(objects: list[Obj]) -> list[tuple[str, str, str]]:
    """(workload, container, job) of every target the PodMonitors make, as the Prometheus Operator would:
    one per container port named by an endpoint, through the relabelings the manifests use (keep by container
    name, set job); any other relabeling fails here until this learns it."""
    targets = []
    for monitor in of_kind(objects, "PodMonitor"):
        spec = monitor["spec"]
        chosen = [
            (w, t)
            for w, t in pod_templates(objects)
            if selects(spec["selector"]["matchLabels"], t["metadata"]["labels"])
        ]
        assert chosen, f"PodMonitor {monitor['metadata']['name']} selects no pod"
        for endpoint in spec["podMetricsEndpoints"]:
            found = []
            for workload, template in chosen:
                for container in containers(template):
                    if endpoint["port"] not in container_ports(container):
                        continue
                    job: str | None = template["metadata"]["labels"].get(spec.get("jobLabel", ""))
                    kept = True
                    for rule in endpoint.get("relabelings", []):
                        if rule == {
                            "sourceLabels": ["__meta_kubernetes_pod_container_name"],
                            "regex": rule.get("regex"),
                            "action": "keep",
                        }:
                            kept = kept and re.fullmatch(rule["regex"], container["name"]) is not None
                        elif rule == {"targetLabel": "job", "replacement": rule.get("replacement")}:
                            job = rule["replacement"]
                        else:
                            raise AssertionError(f"the test cannot follow relabeling {rule}")
                    if kept:
                        assert job is not None, f"PodMonitor {monitor['metadata']['name']} gives no job"
                        found.append((workload["metadata"]["name"], container["name"], job))
            assert found, f"PodMonitor {monitor['metadata']['name']} port {endpoint['port']} scrapes nothing"
            targets += found
    return targets


@pytest.mark.parametrize("path", FRONT_ENDS)
def test_every_container_has_liveness_and_readiness_probes_on_its_own_ports(path: str) -> None:
    for _, template in pod_templates(rendered(path)):
        for container in containers(template):
            assert {"livenessProbe", "readinessProbe"} <= set(container), container["name"]
            ports = container_ports(container)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe not in container:
                    continue
                (action,) = [
                    container[probe][k] for k in ("httpGet", "tcpSocket", "grpc") if k in container[probe]
                ]
                assert action["port"] in ports or action["port"] in ports.values(), (container["name"], probe)


@pytest.mark.parametrize("path", FRONT_ENDS)
def test_discovering_workloads_run_as_an_account_bound_to_a_role_that_lists_and_watches_pods(
    path: str,
) -> None:
    objects = rendered(path)
    (binding,) = of_kind(objects, "RoleBinding")
    role = named(objects, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    (subject,) = binding["subjects"]
    account = named(objects, "ServiceAccount", subject["name"])
    assert (
        subject.get("namespace")
        == account["metadata"].get("namespace")
        == binding["metadata"].get("namespace")
    )
    discovering = [
        t
        for _, t in pod_templates(objects)
        if any("--k8s-namespace" in " ".join(c.get("args", [])) for c in containers(t))
    ]
    assert discovering
    for template in discovering:
        assert template["spec"]["serviceAccountName"] == account["metadata"]["name"]


@pytest.mark.parametrize("path", FRONT_ENDS)
def test_kvstack_args_parse_with_kvstack_parsers_and_name_the_container_ports(path: str) -> None:
    objects = rendered(path)
    parser = build_parser()
    fronts = kvstack_containers(objects, "router") + kvstack_containers(objects, "epp")
    assert len(fronts) == 1
    for container in fronts:
        args = parser.parse_args(expanded_args(container))
        front_end.front_end_options(without_discovery(args))
        ports = container_ports(container)
        if args.command == "router":
            assert ports == {"http": args.port}
        else:
            assert ports == {"grpc": args.grpc_port, "metrics": args.http_port}
        assert args.host == "0.0.0.0"
        if "pd" in path:
            assert args.routing == "pd"
    (cache,) = kvstack_containers(objects, "cache-server")
    args = parser.parse_args(expanded_args(cache))
    assert container_ports(cache) == {"cache": int(args.bind.rsplit(":", 1)[1]), "metrics": args.http_port}
    assert args.http_host == "0.0.0.0"


def without_discovery(args: argparse.Namespace) -> argparse.Namespace:
    """The flags with Kubernetes discovery swapped for one static engine: `front_end_options` then checks
    everything else (routing, limits) without reaching for a cluster."""
    return argparse.Namespace(
        **{
            **vars(args),
            "k8s_namespace": None,
            "k8s_selector": None,
            "k8s_port": None,
            "engine": ["http://e:8000"],
        }
    )


def discovery_of(objects: list[Obj]) -> tuple[dict[str, str], int]:
    """The front end's --k8s-selector (as labels) and --k8s-port."""
    (container,) = kvstack_containers(objects, "router") + kvstack_containers(objects, "epp")
    args = expanded_args(container)
    assert flag(args, "--k8s-namespace") == "llm"  # the pod's own namespace, through the downward API
    selector = dict(term.split("=", 1) for term in flag(args, "--k8s-selector").split(","))
    return selector, int(flag(args, "--k8s-port"))


def pod_of(template: Obj) -> V1Pod:
    """A Running, Ready pod made from the template, at POD_IP."""
    meta = template["metadata"]
    return V1Pod(
        metadata=V1ObjectMeta(
            name="engine-0", namespace="llm", labels=meta["labels"], annotations=meta.get("annotations")
        ),
        spec=V1PodSpec(
            containers=[V1Container(name=c["name"]) for c in containers(template)], node_name="node-a"
        ),
        status=V1PodStatus(
            phase="Running", pod_ip=POD_IP, conditions=[V1PodCondition(type="Ready", status="True")]
        ),
    )


@pytest.mark.parametrize("path", FRONT_ENDS)
def test_discovery_selects_exactly_the_engine_pods_and_reads_them_as_meant(path: str) -> None:
    objects = rendered(path)
    selector, port = discovery_of(objects)
    engines = engine_templates(objects)
    chosen = [t for _, t in pod_templates(objects) if selects(selector, t["metadata"]["labels"])]
    assert chosen == engines
    roles = set()
    for template in engines:
        engine = vllm_container(template)
        assert template_ports(template)["http"] == port  # vLLM's, or its P/D sidecar's
        warnings: list[str] = []
        endpoint = pod_endpoint(pod_of(template), port, KEYS, warn=warnings.append)
        assert endpoint is not None and warnings == []
        model = {e["name"]: e["value"] for e in engine["env"]}["MODEL"]
        events = container_ports(engine)["kv-events"]
        assert endpoint.url == f"http://{POD_IP}:{port}"
        assert endpoint.engine_type == "vllm"
        assert endpoint.models == frozenset({model})
        assert endpoint.kv_events_endpoint == f"tcp://{POD_IP}:{events}"
        roles.add(endpoint.role)
    expected = {EngineRole.PREFILL, EngineRole.DECODE} if "pd" in path else {EngineRole.BOTH}
    assert roles == expected


@pytest.mark.parametrize("path", FRONT_ENDS)
def test_engines_publish_kv_events_where_the_annotation_says_and_load_through_kvstack_connector(
    path: str,
) -> None:
    objects = rendered(path)
    cache = named(objects, "Service", "kvstack-cache-server")
    cache_port = {p["name"]: p["port"] for p in cache["spec"]["ports"]}["cache"]
    for template in engine_templates(objects):
        engine = vllm_container(template)
        args = expanded_args(engine)
        events = json.loads(flag(args, "--kv-events-config"))
        assert events == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{container_ports(engine)['kv-events']}",
        }
        assert template["metadata"]["annotations"][KEYS.kv_events_annotation] == str(
            container_ports(engine)["kv-events"]
        )
        transfer = json.loads(flag(args, "--kv-transfer-config"))
        assert transfer["kv_connector"] == "KVStackConnector"
        assert importlib.util.find_spec(transfer["kv_connector_module_path"]) is not None
        assert (transfer["kv_role"], transfer["kv_load_failure_policy"]) == ("kv_both", "recompute")
        config = parse_config(transfer["kv_connector_extra_config"])
        assert config.server == f"tcp://{cache['metadata']['name']}:{cache_port}"
        assert args[0] == {e["name"]: e["value"] for e in engine["env"]}["MODEL"]
        assert int(flag(args, "--port")) in container_ports(engine).values()


def test_the_example_overlay_sets_namespace_images_model_and_replicas() -> None:
    objects = rendered("overlays/example")
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"llm"}
    images = {c["image"] for _, t in pod_templates(objects) for c in containers(t)}
    assert images == {"registry.example.com/kvstack:0.1.0", "registry.example.com/kvstack-vllm:0.1.0"}
    (template,) = engine_templates(objects)
    assert template["metadata"]["annotations"][KEYS.models_annotation] == "meta-llama/Llama-3.1-8B-Instruct"
    assert named(objects, "Deployment", "vllm")["spec"]["replicas"] == 4


@pytest.mark.parametrize("path", ["overlays/envoy", "overlays/envoy-pd"])
def test_the_envoy_bootstrap_is_what_kvstack_envoy_config_renders_with_its_recorded_command(
    path: str, tmp_path: Path
) -> None:
    objects = rendered(path)
    (bootstrap,) = [
        m for m in of_kind(objects, "ConfigMap") if m["metadata"]["name"].startswith("kvstack-envoy")
    ]
    text = bootstrap["data"]["envoy.yaml"]
    first, _, body = text.partition("\n")
    prefix = "# Generated by: kvstack "
    assert first.startswith(prefix)
    out = tmp_path / "envoy.yaml"
    args = build_parser().parse_args([*shlex.split(first.removeprefix(prefix)), "--output", str(out)])
    assert envoy_config.run(args) == 0
    assert body == out.read_text(), "deploy/envoy/envoy.yaml is stale: run the command on its first line"
    # The picker and engine addresses it names are the Services', on their ports.
    epp = {p["name"]: p["port"] for p in named(objects, "Service", "kvstack-epp")["spec"]["ports"]}
    engines = {p["name"]: p["port"] for p in named(objects, "Service", "vllm")["spec"]["ports"]}
    assert (args.picker, args.engine) == ([f"kvstack-epp:{epp['grpc']}"], [f"vllm:{engines['http']}"])
    envoy = named(objects, "Deployment", "kvstack-envoy")["spec"]["template"]
    assert template_ports(envoy) == {"http": args.port}


def test_decode_pods_behind_envoy_reach_their_engine_through_a_sidecar_that_parses() -> None:
    objects = rendered("overlays/envoy-pd")
    selector, port = discovery_of(objects)
    decode = [t for t in engine_templates(objects) if t["metadata"]["labels"][KEYS.role_label] == "decode"]
    assert decode
    for template in decode:
        (sidecar,) = [c for c in containers(template) if c.get("args", [None])[0] == "sidecar"]
        args = build_parser().parse_args(expanded_args(sidecar))
        engine_port = int(flag(expanded_args(vllm_container(template)), "--port"))
        assert args.engine == f"http://127.0.0.1:{engine_port}"
        assert container_ports(sidecar) == {"http": args.port} and args.port == port != engine_port
        # Its allowlist of prefill engines comes from the same pods the picker discovers.
        assert args.k8s_namespace == "llm"
        assert dict(t.split("=", 1) for t in args.k8s_selector.split(",")) == selector
        assert args.k8s_port == port


def test_envoy_accepts_the_committed_bootstrap(tmp_path: Path) -> None:
    objects = rendered("overlays/envoy")
    (bootstrap,) = [
        m for m in of_kind(objects, "ConfigMap") if m["metadata"]["name"].startswith("kvstack-envoy")
    ]
    path = tmp_path / "envoy.yaml"
    path.write_text(bootstrap["data"]["envoy.yaml"])
    done = envoy.validate(path)
    assert done.returncode == 0, done.stderr
