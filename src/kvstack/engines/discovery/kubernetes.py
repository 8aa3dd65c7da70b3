"""Kubernetes discovery: the Ready pods matching a label selector, by list + watch.

``pod_endpoint`` reads a pod's IP, labels and annotations (``PodKeys``) into fields checked by
``kvstack.engines.specs``; a bad label or annotation is logged and replaced by its default. Every end of a
watch leads to a fresh list that replaces the whole view, so missed events leave no stale engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstack.backoff import Backoff
from kvstack.engines.discovery.base import RETRY_BACKOFF, Discovery, ModelFetcher
from kvstack.engines.specs import (
    DEFAULT_ENGINE_TYPE,
    EngineSpecError,
    build_endpoint,
    check_engine_type,
    check_kv_events,
    check_role,
)
from kvstack.engines.state import Endpoint, EngineRole

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient, CoreV1Api, V1Pod

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PodKeys:
    """Pod label and annotation keys that describe an engine.

    ``kv_events_annotation`` holds a ZMQ endpoint; a bare port means ``tcp://POD_IP:PORT`` and a ``*``
    host (the engine's bind address) is replaced by the pod IP. ``models_annotation`` is a comma-separated
    list that spares the /v1/models fetch.
    """

    engine_type_label: str = "kvstack.io/engine-type"
    role_label: str = "kvstack.io/role"
    models_annotation: str = "kvstack.io/models"
    kv_events_annotation: str = "kvstack.io/kv-events"


def _pod_ready(pod: V1Pod) -> bool:
    status = pod.status
    if status is None or status.phase != "Running" or not status.pod_ip:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())


def pod_endpoint(
    pod: V1Pod,
    port: int,
    keys: PodKeys = PodKeys(),
    *,
    default_engine_type: str = DEFAULT_ENGINE_TYPE,
    warn: Callable[[str], None] | None = None,
) -> Endpoint | None:
    """The endpoint a pod serves, or None when it must get no traffic: not Running, not Ready, no pod IP,
    being deleted, or an address that is no engine URL. A bad engine type or role label or KV-event
    annotation goes to ``warn`` and is replaced by its default.
    """
    meta = pod.metadata
    if meta is None or meta.deletion_timestamp is not None or not _pod_ready(pod):
        return None
    ip: str = pod.status.pod_ip
    host = f"[{ip}]" if ":" in ip else ip  # IPv6 pod IPs need brackets in URLs
    labels: dict[str, str] = meta.labels or {}
    annotations: dict[str, str] = meta.annotations or {}
    where = f"pod {meta.namespace}/{meta.name}"

    def told(error: EngineSpecError, source: str, instead: str) -> None:
        if warn:
            warn(f"{error} ({source}); {instead}")

    engine_type = default_engine_type
    if keys.engine_type_label in labels:
        try:
            engine_type = check_engine_type(labels[keys.engine_type_label], where)
        except EngineSpecError as e:
            told(e, f"label {keys.engine_type_label}", f"treating it as {default_engine_type}")
    role = EngineRole.BOTH
    if keys.role_label in labels:
        try:
            role = check_role(labels[keys.role_label], where)
        except EngineSpecError as e:
            told(e, f"label {keys.role_label}", f"treating it as {EngineRole.BOTH.value}")
    kv_events = annotations.get(keys.kv_events_annotation, "").strip() or None
    if kv_events is not None:
        if kv_events.isdigit():
            kv_events = f"tcp://{host}:{kv_events}"
        elif "*" in kv_events:
            kv_events = kv_events.replace("*", host)
        try:
            kv_events = check_kv_events(kv_events, where)
        except EngineSpecError as e:
            told(e, f"annotation {keys.kv_events_annotation}", "ignoring it")
            kv_events = None
    models = [m.strip() for m in annotations.get(keys.models_annotation, "").split(",") if m.strip()]
    try:
        return build_endpoint(
            where,
            f"http://{host}:{port}",
            engine_type=engine_type,
            role=role.value,
            models=models,
            node=pod.spec.node_name if pod.spec is not None else None,
            kv_events=kv_events,
            labels=labels,
        )
    except EngineSpecError as e:
        if warn:
            warn(f"{e}; sending it no traffic")
        return None


class KubernetesDiscovery(Discovery):
    """Engines from the pods matching ``label_selector`` in ``namespace``; each serves HTTP on ``port``.

    Lists the pods, then watches from the list's resourceVersion. Whenever a watch ends, for any reason
    (server timeout after ``watch_timeout_s``, 410 Gone / ERROR event, dropped connection, API error), the
    next step is a fresh list that replaces the whole pod view and publishes the differences: events missed
    while the watch was down cannot leave a stale engine behind. Errors and short-lived watches back off
    (``backoff``); after a watch that ran for a while it re-lists at once. ``api_client`` belongs to the
    caller (built from in-cluster or kubeconfig configuration) and is not closed here.
    """

    # A watch that lasted this long counts as healthy, so the next re-list does not back off.
    HEALTHY_WATCH_S = 10.0

    def __init__(
        self,
        namespace: str,
        label_selector: str,
        port: int,
        *,
        api_client: ApiClient,
        keys: PodKeys = PodKeys(),
        default_engine_type: str = DEFAULT_ENGINE_TYPE,
        fetch_models: ModelFetcher | None = None,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 30.0,
        backoff: Backoff = RETRY_BACKOFF,
        model_backoff: Backoff = RETRY_BACKOFF,
    ) -> None:
        super().__init__(fetch_models=fetch_models, model_backoff=model_backoff)
        self._namespace = namespace
        self._selector = label_selector
        self._port = port
        self._api_client = api_client
        self._keys = keys
        self._default_engine_type = check_engine_type(default_engine_type, "default_engine_type")
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._backoff = backoff
        self._pods: dict[str, tuple[str, Endpoint | None]] = {}  # pod name -> (uid, endpoint or None)
        self._warned: set[str] = set()
        self.resyncs = 0  # completed lists, for /engines and tests

    def describe(self) -> str:
        return f"kubernetes {self._namespace}/{self._selector or '<all pods>'}:{self._port}"

    async def _run(self) -> None:
        # Imported here: kubernetes_asyncio takes about a second to import, which only this source should pay.
        from kubernetes_asyncio.client import CoreV1Api
        from kubernetes_asyncio.client.exceptions import ApiException

        api = CoreV1Api(self._api_client)
        loop = asyncio.get_running_loop()
        retry = self._backoff.sequence(self._rng)
        while True:
            started = loop.time()
            level = logging.WARNING
            try:
                version = await self._resync(api)
                started = loop.time()
                await self._watch(api, version)
                level, why = logging.DEBUG, "watch ended"
            except ApiException as e:
                if e.status == 410:
                    level, why = logging.INFO, "watch expired (410 Gone)"
                else:
                    why = f"API error {e.status} {e.reason}"
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
            if loop.time() - started >= self.HEALTHY_WATCH_S:
                retry.reset()
                delay = 0.0
            else:
                delay = retry.next()
            log.log(level, "discovery %s: %s; re-listing pods in %.2f s", self.describe(), why, delay)
            await asyncio.sleep(delay)

    async def _resync(self, api: CoreV1Api) -> str:
        """List the pods, replace the whole view, publish; return the list's resourceVersion."""
        pod_list = await api.list_namespaced_pod(
            self._namespace, label_selector=self._selector, _request_timeout=self._request_timeout_s
        )
        self._pods = {}
        for pod in pod_list.items:
            self._pods[pod.metadata.name] = self._evaluate(pod)
        self.resyncs += 1
        self._publish_pods()
        version: str = pod_list.metadata.resource_version
        return version

    async def _watch(self, api: CoreV1Api, version: str) -> None:
        from kubernetes_asyncio.watch import Watch

        async with Watch() as watch:
            # timeout_seconds also turns off the library's own silent reconnect, so every end of the watch
            # surfaces here and leads to a re-list; the socket read timeout catches a quietly dead connection.
            stream = watch.stream(
                api.list_namespaced_pod,
                self._namespace,
                label_selector=self._selector,
                resource_version=version,
                timeout_seconds=self._watch_timeout_s,
                _request_timeout=(self._request_timeout_s, self._watch_timeout_s + self._request_timeout_s),
            )
            async for event in stream:
                if not isinstance(event, dict):
                    raise ValueError(f"watch sent a line that is not an event: {str(event)[:200]!r}")
                kind: str = event["type"]
                pod: Any = event["object"]
                if kind in ("ADDED", "MODIFIED"):
                    self._pods[pod.metadata.name] = self._evaluate(pod)
                elif kind == "DELETED":
                    self._pods.pop(pod.metadata.name, None)
                else:
                    continue  # BOOKMARK carries no pod change
                self._publish_pods()

    def _evaluate(self, pod: V1Pod) -> tuple[str, Endpoint | None]:
        endpoint = pod_endpoint(
            pod, self._port, self._keys, default_engine_type=self._default_engine_type, warn=self._warn_once
        )
        return pod.metadata.uid or pod.metadata.name, endpoint

    def _publish_pods(self) -> None:
        declared: dict[str, Endpoint] = {}
        instances: dict[str, str] = {}
        owners: dict[str, str] = {}
        for name in sorted(self._pods):
            uid, endpoint = self._pods[name]
            if endpoint is None:
                continue
            if endpoint.url in declared:
                self._warn_once(
                    f"pods {owners[endpoint.url]} and {name} both serve {endpoint.url}; "
                    f"using {owners[endpoint.url]}"
                )
                continue
            declared[endpoint.url], instances[endpoint.url], owners[endpoint.url] = endpoint, uid, name
        self._publish(declared, instances)

    def _warn_once(self, message: str) -> None:
        if message in self._warned:
            return
        if len(self._warned) >= 1024:  # bounded under pod churn; a repeat after a clear is harmless
            self._warned.clear()
        self._warned.add(message)
        log.warning("discovery %s: %s", self.describe(), message)
