"""A minimal fake Kubernetes API server for discovery tests, on aiohttp at 127.0.0.1 (free port).

It serves what kubernetes_asyncio's ``CoreV1Api.list_namespaced_pod`` and ``Watch`` use:
``GET /api/v1/namespaces/{ns}/pods`` returns a PodList (``labelSelector`` filtering, list resourceVersion);
with ``watch=true`` it streams JSON lines (ADDED / MODIFIED / DELETED) after ``resourceVersion``, as seen
through the selector (a pod that stops matching is DELETED for that watch), and ends after
``timeoutSeconds``. A resourceVersion older than the last ``expire_watches()`` gets an ERROR 410 event.

Tests change pods (``add_pod``, ``set_ready``, ``mark_terminating``, ``delete_pod``, ``update_pod``) and break
watches: ``expire_watches()`` (ERROR 410 "Expired", then close), ``drop_watches()`` (closed without
a word, cleanly or by cutting the connection), ``pause_watches()`` (events stop reaching open watches, as
with a stalled watch), ``set_available(False)`` (every request 503; open watches cut).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

Pod = dict[str, Any]


def make_pod(
    name: str,
    ip: str | None,
    *,
    ready: bool = True,
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    node: str = "node-a",
    namespace: str = "default",
) -> Pod:
    """A Pod object as the API server would return it (the fields discovery reads, plus required ones)."""
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "labels": dict(labels or {}),
            "annotations": dict(annotations or {}),
        },
        "spec": {"nodeName": node, "containers": [{"name": "engine", "image": "vllm"}]},
        "status": status,
    }


_REQUIREMENT = re.compile(
    r"^\s*(!?)\s*([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$"
)


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``."""
    for requirement in re.split(r",(?![^()]*\))", selector or ""):
        if not requirement.strip():
            continue
        m = _REQUIREMENT.match(requirement)
        if m is None:
            raise ValueError(f"unparsable label selector {selector!r}")
        negate, key, op, value, set_op, values = m.groups()
        present = key in labels
        if negate:
            ok = not present
        elif op in ("=", "=="):
            ok = labels.get(key) == value
        elif op == "!=":
            ok = labels.get(key) != value
        elif set_op:
            members = {v.strip() for v in values.split(",")}
            ok = (labels.get(key) in members) if set_op == "in" else (labels.get(key) not in members)
        else:
            ok = present
        if not ok:
            return False
    return True


def _labels(pod: Pod | None) -> dict[str, str]:
    return {} if pod is None else pod["metadata"].get("labels") or {}


@dataclass
class _Change:
    version: int
    namespace: str
    old: Pod | None  # the pod before the change (None when added)
    new: Pod | None  # the pod after the change (None when deleted)


@dataclass(eq=False)  # hashed by identity: kept in a set
class _Watcher:
    namespace: str
    selector: str
    queue: asyncio.Queue[_Change | str] = field(default_factory=asyncio.Queue)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKubeApi:
    """The fake API server; ``await start()``, point a kubernetes_asyncio Configuration at ``url``."""

    def __init__(self) -> None:
        self._pods: dict[tuple[str, str], Pod] = {}
        self._history: list[_Change] = []
        self._version = 100
        self._oldest_watchable = 0  # watches from a version below this get 410 Gone
        self._watchers: set[_Watcher] = set()
        self._paused = False
        self._available = True
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.list_calls = 0
        self.watch_calls = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._handle_pods)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        self.drop_watches(abrupt=True)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- pods ------------------------------------------------------------------------------------------------

    def add_pod(self, pod: Pod) -> Pod:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        assert key not in self._pods, f"pod {key} exists"
        return self._change(key, pod)

    def update_pod(self, name: str, edit: Any, namespace: str = "default") -> Pod:
        """Apply ``edit(pod)`` (mutating a copy) and record a MODIFIED change."""
        pod = copy.deepcopy(self._pods[(namespace, name)])
        edit(pod)
        return self._change((namespace, name), pod)

    def set_ready(self, name: str, ready: bool, namespace: str = "default") -> Pod:
        def edit(pod: Pod) -> None:
            pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]

        return self.update_pod(name, edit, namespace)

    def mark_terminating(self, name: str, namespace: str = "default") -> Pod:
        """What a delete with a grace period does first: set deletionTimestamp."""

        def edit(pod: Pod) -> None:
            pod["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"

        return self.update_pod(name, edit, namespace)

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        self._change((namespace, name), None)

    def pod(self, name: str, namespace: str = "default") -> Pod:
        return copy.deepcopy(self._pods[(namespace, name)])

    def _change(self, key: tuple[str, str], new: Pod | None) -> Pod:
        self._version += 1
        old = self._pods.get(key)
        if new is None:
            assert old is not None, f"no pod {key}"
            del self._pods[key]
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._version)
            change = _Change(self._version, key[0], gone, None)
            result = gone
        else:
            new = copy.deepcopy(new)
            new["metadata"]["resourceVersion"] = str(self._version)
            self._pods[key] = new
            change = _Change(self._version, key[0], old, new)
            result = new
        self._history.append(change)
        if not self._paused:
            for watcher in self._watchers:
                watcher.queue.put_nowait(change)
        return copy.deepcopy(result)

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    # -- breaking watches ------------------------------------------------------------------------------------

    def expire_watches(self) -> None:
        """Send ERROR 410 to open watches and make every version before the current one too old."""
        self._oldest_watchable = self._version
        self._history.clear()
        for watcher in self._watchers:
            watcher.queue.put_nowait("expire")

    def drop_watches(self, *, abrupt: bool = False) -> None:
        """End open watches: cleanly (end of stream) or by cutting the connection."""
        for watcher in self._watchers:
            watcher.queue.put_nowait("cut" if abrupt else "end")

    def pause_watches(self, paused: bool = True) -> None:
        """Stop (or resume) delivering changes to open watches; changes are still recorded."""
        self._paused = paused

    def set_available(self, available: bool) -> None:
        """When unavailable, every request gets 503 and open watches are cut."""
        self._available = available
        if not available:
            self.drop_watches(abrupt=True)

    # -- HTTP ------------------------------------------------------------------------------------------------

    async def _handle_pods(self, request: web.Request) -> web.StreamResponse:
        if not self._available:
            return web.json_response(
                _status(503, "ServiceUnavailable", "fake API server is down"), status=503
            )
        namespace = request.match_info["namespace"]
        selector = request.query.get("labelSelector", "")
        # Booleans as Go's strconv.ParseBool reads them; kubernetes_asyncio sends "True".
        if request.query.get("watch", "") in ("1", "t", "T", "true", "TRUE", "True"):
            return await self._watch(request, namespace, selector)
        self.list_calls += 1
        items = [
            copy.deepcopy(pod)
            for (ns, _), pod in sorted(self._pods.items())
            if ns == namespace and selector_matches(selector, _labels(pod))
        ]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._version)},
                "items": items,
            }
        )

    @staticmethod
    def _event_for(change: _Change, selector: str) -> dict[str, Any] | None:
        """The event a watch with this selector sees for a change (None: the change is invisible to it)."""
        was = change.old is not None and selector_matches(selector, _labels(change.old))
        now = change.new is not None and selector_matches(selector, _labels(change.new))
        if was and now:
            return {"type": "MODIFIED", "object": change.new}
        if now:
            return {"type": "ADDED", "object": change.new}
        if was:
            gone = copy.deepcopy(change.new if change.new is not None else change.old)
            assert gone is not None
            gone["metadata"]["resourceVersion"] = str(change.version)
            return {"type": "DELETED", "object": gone}
        return None

    async def _watch(self, request: web.Request, namespace: str, selector: str) -> web.StreamResponse:
        self.watch_calls += 1
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        since = request.query.get("resourceVersion", "")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        watcher = _Watcher(namespace, selector)
        if since in ("", "0"):
            # No version: start with the current state as synthetic ADDED events, as the API server does.
            backlog = [_Change(self._version, ns, None, pod) for (ns, _), pod in sorted(self._pods.items())]
        elif int(since) < self._oldest_watchable:
            await send(
                {"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {since}")}
            )
            await response.write_eof()
            return response
        else:
            backlog = [c for c in self._history if c.version > int(since)]
        self._watchers.add(watcher)
        try:
            for change in backlog:
                watcher.queue.put_nowait(change)
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    break
                if item == "expire":
                    await send({"type": "ERROR", "object": _status(410, "Expired", "watch expired")})
                    break
                if item == "end":
                    break
                if item == "cut":
                    if request.transport is not None:  # None when the client left first
                        request.transport.close()
                    return response
                assert isinstance(item, _Change)
                event = self._event_for(item, selector) if item.namespace == namespace else None
                if event is not None:
                    await send(event)
        finally:
            self._watchers.discard(watcher)
        await response.write_eof()
        return response
