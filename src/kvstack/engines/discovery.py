"""Engine discovery: which engines exist, as a stream of per-endpoint updates.

A ``Discovery`` calls the ``on_update`` callback given to ``start()`` with ``DiscoveryUpdate`` events
(ADDED, UPDATED, REMOVED; one endpoint each, keyed by URL). Applying them in order keeps a registry equal
to ``endpoints()``: ADDED/UPDATED -> upsert the endpoint, REMOVED -> drop that URL. Within one change
removals come first. A different instance at a known URL (a new pod that got an old pod's IP) is REMOVED
then ADDED, so the old engine's runtime state is not carried over.

Models: an endpoint whose source names no models is published with none, and ``fetch_models(url)`` (injected;
the router's /v1/models client) is asked in the background; its answer arrives as UPDATED. Failed fetches are
retried with backoff while the endpoint exists.

Sources: ``StaticDiscovery`` (``--engine`` specs), ``FileDiscovery`` (a polled YAML file),
``KubernetesDiscovery`` (pods, list + watch). No threads; each runs as one asyncio task plus model fetches.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import hashlib
import logging
import os
import random
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import yaml

from kvstack.engines.catalog import CATALOGS
from kvstack.engines.state import Endpoint, EngineRole
from kvstack.http.client import Origin

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient, CoreV1Api, V1Pod

log = logging.getLogger(__name__)

# Engine types with a metric catalog; any other type in a spec is a typo, caught at load.
ENGINE_TYPES = frozenset(c.engine_type for c in CATALOGS)
DEFAULT_ENGINE_TYPE = "vllm"

# A fetcher that never answers must not pin an endpoint at "no models" forever; it is retried instead.
MODEL_FETCH_TIMEOUT_S = 10.0


class UpdateKind(enum.Enum):
    ADDED = "added"
    UPDATED = "updated"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class DiscoveryUpdate:
    """One change to the set of endpoints; for REMOVED, ``endpoint`` is the one last published."""

    kind: UpdateKind
    endpoint: Endpoint


UpdateCallback = Callable[[DiscoveryUpdate], None]
ModelFetcher = Callable[[str], Awaitable[Collection[str]]]


class DiscoveryConfigError(ValueError):
    """An engine spec or engines file that cannot be used; the message says where and what is wrong."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Retry delay for attempt n (from 0): ``uniform(0.5, 1) * min(max_s, initial_s * 2**n)``."""

    initial_s: float = 0.5
    max_s: float = 30.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        # Jitter keeps many routers from re-listing or re-fetching in lockstep after a shared outage.
        return rng.uniform(0.5, 1.0) * min(self.max_s, self.initial_s * 2 ** min(attempt, 30))


class Discovery(abc.ABC):
    """A source of engine endpoints. Call ``start(on_update)`` once and ``await stop()`` once."""

    def __init__(
        self, *, fetch_models: ModelFetcher | None = None, model_backoff: Backoff = Backoff()
    ) -> None:
        self._fetch_models = fetch_models
        self._model_backoff = model_backoff
        self._rng = random.Random()
        self._on_update: UpdateCallback | None = None
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._declared: dict[str, Endpoint] = {}  # what the source says now, by URL
        self._instances: dict[str, str] = {}  # URL -> instance id of the declared endpoint
        self._published: dict[str, Endpoint] = {}  # what on_update has been told
        self._published_instances: dict[str, str] = {}
        self._fetched: dict[str, frozenset[str]] = {}  # URL -> /v1/models answer for the current instance
        self._fetching: dict[str, asyncio.Task[None]] = {}

    def start(self, on_update: UpdateCallback) -> None:
        """Begin reading the source in a background task; ``on_update`` is called from that task."""
        if self._task is not None:
            raise RuntimeError(f"{self.describe()} was already started")
        self._on_update = on_update
        self._task = asyncio.create_task(self._main(), name=f"discovery {self.describe()}")

    async def stop(self) -> None:
        """Cancel the source task and model fetches; no updates are sent afterwards."""
        tasks = [t for t in (self._task, *self._fetching.values()) if t is not None]
        self._on_update = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fetching.clear()

    def endpoints(self) -> dict[str, Endpoint]:
        """The endpoints published so far, by URL."""
        return dict(self._published)

    async def wait_synced(self) -> None:
        """Return once the source has been read once (file: first attempt; Kubernetes: first list)."""
        await self._synced.wait()

    @abc.abstractmethod
    def describe(self) -> str:
        """A short human name of the source for logs."""

    @abc.abstractmethod
    async def _run(self) -> None:
        """Read the source and call ``_publish`` on every change; runs until cancelled."""

    async def _main(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug in a source must be loud: a silently frozen registry keeps routing to dead engines.
            log.exception("discovery %s stopped on an unexpected error", self.describe())
            raise

    def _publish(self, declared: Mapping[str, Endpoint], instances: Mapping[str, str] | None = None) -> None:
        """Make ``declared`` (by URL; instance id per URL, default the URL) current and emit the diff."""
        self._declared = dict(declared)
        self._instances = dict(instances) if instances is not None else {url: url for url in declared}
        self._reconcile()
        self._synced.set()

    def _reconcile(self) -> None:
        for url in sorted(self._published):
            if url not in self._declared or self._instances[url] != self._published_instances[url]:
                self._fetched.pop(url, None)
                fetch = self._fetching.pop(url, None)
                if fetch is not None:
                    fetch.cancel()
                del self._published_instances[url]
                self._emit(DiscoveryUpdate(UpdateKind.REMOVED, self._published.pop(url)))
        for url in sorted(self._declared):
            endpoint = self._declared[url]
            if not endpoint.models:
                if url in self._fetched:
                    endpoint = replace(endpoint, models=self._fetched[url])
                elif self._fetch_models is not None and url not in self._fetching:
                    self._fetching[url] = asyncio.create_task(
                        self._resolve_models(url, self._instances[url]), name=f"models of {url}"
                    )
            old = self._published.get(url)
            self._published[url] = endpoint
            self._published_instances[url] = self._instances[url]
            if old is None:
                self._emit(DiscoveryUpdate(UpdateKind.ADDED, endpoint))
            elif old != endpoint:
                self._emit(DiscoveryUpdate(UpdateKind.UPDATED, endpoint))

    def _emit(self, update: DiscoveryUpdate) -> None:
        if self._on_update is None:
            return
        try:
            self._on_update(update)
        except Exception:
            # The consumer's bug must not stop discovery; the next update may still apply.
            log.exception("discovery %s: on_update failed for %s", self.describe(), update)

    async def _resolve_models(self, url: str, instance: str) -> None:
        assert self._fetch_models is not None
        attempt = 0
        while True:
            try:
                async with asyncio.timeout(MODEL_FETCH_TIMEOUT_S):
                    models = frozenset(await self._fetch_models(url))
                break
            except Exception as e:
                delay = self._model_backoff.delay(attempt, self._rng)
                # First failure is a warning; repeats of a down engine would otherwise flood the log.
                level = logging.WARNING if attempt == 0 else logging.DEBUG
                log.log(
                    level,
                    "engine %s: /v1/models failed (%r); published without models, retrying in %.1f s",
                    url,
                    e,
                    delay,
                )
                attempt += 1
                await asyncio.sleep(delay)
        if attempt:
            log.info("engine %s: /v1/models answered after %d failures: %s", url, attempt, sorted(models))
        if self._fetching.get(url) is asyncio.current_task():
            del self._fetching[url]
        if url in self._declared and self._instances[url] == instance:
            self._fetched[url] = models
            self._reconcile()


# ------------------------------------------------------------------------------------------------------------
# Static: --engine URL[#key=value,...]


def _engine_url(raw: str, where: str) -> str:
    text = raw.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        _check_base_url(text)
    except ValueError as exc:
        raise DiscoveryConfigError(
            f"{where}: {raw!r} is not an engine base URL ({exc}); expected http(s)://HOST:PORT[/PATH], "
            "e.g. http://10.0.0.5:8000"
        ) from None
    return text.rstrip("/")


def _check_base_url(url: str) -> None:
    """Raise ``ValueError`` saying what is wrong with ``url`` as an engine base URL."""
    # What the proxy will connect with: whitespace, a bad IPv6 literal or port fail here, at load, with the
    # entry named, instead of on every request.
    Origin.parse(url)
    parts = urlsplit(url)
    if parts.query:
        raise ValueError("a base URL has no query string")
    if parts.fragment:
        raise ValueError(
            f"'#{parts.fragment}': options after '#' are read only in the string form of an entry; "
            "a mapping entry has the keys type, role, models, node, kv_events"
        )


def _kv_events_endpoint(value: str | None, where: str) -> str | None:
    """A ZMQ endpoint the router can connect to: tcp://host:port or ipc://path."""
    if value is not None and not value.startswith(("tcp://", "ipc://")):
        raise DiscoveryConfigError(f"{where}: kv-events {value!r} must be tcp://host:port or ipc://path")
    return value


def _engine_type(value: str, where: str) -> str:
    engine_type = value.strip().lower()
    if engine_type not in ENGINE_TYPES:
        raise DiscoveryConfigError(
            f"{where}: engine type {value!r} is not one of {', '.join(sorted(ENGINE_TYPES))}"
        )
    return engine_type


def _role(value: str, where: str) -> EngineRole:
    try:
        return EngineRole(value.strip().lower())
    except ValueError:
        roles = ", ".join(r.value for r in EngineRole)
        raise DiscoveryConfigError(f"{where}: role {value!r} is not one of {roles}") from None


def parse_engine_spec(spec: str, where: str = "--engine") -> Endpoint:
    """Parse ``URL[#key=value,...]``, the ``--engine`` syntax.

    Keys: ``type`` (an engine type with a catalog: vllm, sglang, trtllm, triton; default vllm), ``role``
    (both|prefill|decode, default both), ``model`` (repeat for several), ``node``, ``kv-events`` (the
    engine's ZMQ endpoint). A URL without a scheme gets ``http://``. Example::

        http://10.0.0.5:8000#type=sglang,role=prefill,model=qwen,kv-events=tcp://10.0.0.5:5557
    """
    url_part, _, options = spec.partition("#")
    where = f"{where} {spec!r}"
    url = _engine_url(url_part, where)
    engine_type, role = DEFAULT_ENGINE_TYPE, EngineRole.BOTH
    models: set[str] = set()
    node: str | None = None
    kv_events: str | None = None
    for item in filter(None, (i.strip() for i in options.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            raise DiscoveryConfigError(f"{where}: option {item!r} should be key=value")
        if key == "type":
            engine_type = _engine_type(value, where)
        elif key == "role":
            role = _role(value, where)
        elif key == "model":
            models.add(value)
        elif key == "node":
            node = value
        elif key == "kv-events":
            kv_events = _kv_events_endpoint(value, where)
        else:
            raise DiscoveryConfigError(
                f"{where}: unknown option {key!r}; known: type, role, model, node, kv-events"
            )
    return Endpoint(url, engine_type, role, frozenset(models), (), node, kv_events)


def _by_url(endpoints: list[Endpoint], where: str) -> dict[str, Endpoint]:
    out: dict[str, Endpoint] = {}
    for endpoint in endpoints:
        if endpoint.url in out:
            raise DiscoveryConfigError(f"{where}: engine {endpoint.url} is listed twice")
        out[endpoint.url] = endpoint
    return out


class StaticDiscovery(Discovery):
    """A fixed list of engines given as ``parse_engine_spec`` strings; invalid specs raise at construction."""

    def __init__(
        self,
        specs: list[str],
        *,
        fetch_models: ModelFetcher | None = None,
        model_backoff: Backoff = Backoff(),
    ) -> None:
        super().__init__(fetch_models=fetch_models, model_backoff=model_backoff)
        self._endpoints = _by_url([parse_engine_spec(s) for s in specs], "--engine")

    def describe(self) -> str:
        return f"static ({len(self._endpoints)} engines)"

    async def _run(self) -> None:
        self._publish(self._endpoints)


# ------------------------------------------------------------------------------------------------------------
# File: a YAML list of engines, polled


_FILE_KEYS = ("url", "type", "role", "models", "node", "kv_events", "labels")


def _file_entry(entry: object, where: str) -> Endpoint:
    if isinstance(entry, str):
        return parse_engine_spec(entry, where)
    if not isinstance(entry, dict):
        raise DiscoveryConfigError(f"{where}: expected a mapping with url, type, role, ... or a URL string")
    unknown = sorted(str(k) for k in entry if k not in _FILE_KEYS)
    if unknown:
        known = ", ".join(_FILE_KEYS)
        raise DiscoveryConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {known}")
    if not isinstance(entry.get("url"), str):
        raise DiscoveryConfigError(f"{where}: 'url' is required and must be a string")
    url = _engine_url(entry["url"], where)
    where = f"{where} ({url})"

    def text(key: str) -> str | None:
        value = entry.get(key)
        if value is None:
            return None
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise DiscoveryConfigError(f"{where}: '{key}' must be a string, not {type(value).__name__}")
        return str(value)

    models = entry.get("models") or []
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise DiscoveryConfigError(f"{where}: 'models' must be a list of model names")
    labels = entry.get("labels") or {}
    if not isinstance(labels, dict) or not all(
        isinstance(v, str | int | float) and not isinstance(v, bool) for v in labels.values()
    ):
        raise DiscoveryConfigError(f"{where}: 'labels' must map names to string values")
    return Endpoint(
        url=url,
        engine_type=_engine_type(text("type") or DEFAULT_ENGINE_TYPE, where),
        role=_role(text("role") or EngineRole.BOTH.value, where),
        models=frozenset(models),
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        node=text("node"),
        kv_events_endpoint=_kv_events_endpoint(text("kv_events"), where),
    )


def parse_engines_file(text: str, source: str = "engines file") -> list[Endpoint]:
    """Parse the engines file; raises ``DiscoveryConfigError`` naming the file, entry and problem.

    Format (each entry may also be a ``parse_engine_spec`` string)::

        engines:
          - url: http://10.0.0.5:8000
            type: vllm            # vllm | sglang | trtllm | triton; default vllm
            role: both            # both | prefill | decode; default both
            models: [qwen-0.5b]   # default: ask the engine's /v1/models
            node: node-a
            kv_events: tcp://10.0.0.5:5557
            labels: {zone: a}
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise DiscoveryConfigError(f"{source}: invalid YAML{at}: {problem}") from None
    if doc is None:
        # An empty file is more likely a half-written one than a wish for zero engines.
        raise DiscoveryConfigError(f"{source}: file is empty; write 'engines: []' to mean no engines")
    if not isinstance(doc, dict) or not isinstance(doc.get("engines"), list):
        raise DiscoveryConfigError(f"{source}: expected a mapping with the key 'engines' holding a list")
    if set(doc) != {"engines"}:
        unknown = ", ".join(sorted(str(k) for k in doc if k != "engines"))
        raise DiscoveryConfigError(f"{source}: unknown top-level key(s) {unknown}; only 'engines' is read")
    endpoints = [_file_entry(entry, f"{source}: engines[{i}]") for i, entry in enumerate(doc["engines"])]
    _by_url(endpoints, source)
    return endpoints


class FileDiscovery(Discovery):
    """Engines from a YAML file (``parse_engines_file``), re-read when it changes.

    Every ``poll_interval_s`` the file's (mtime, size, inode) is compared with the last read; on a change
    the content hash decides whether to parse. A valid file publishes only the differences. A missing or
    invalid file keeps the last good engines and logs one error per distinct problem, naming the entry.
    One bad entry rejects the whole edit, not just that entry: applying the rest would remove the engine the
    entry meant (a typo in a URL being edited), and the file would no longer say what the router serves.
    Polling goes on whatever fails, so the next valid edit is applied.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        poll_interval_s: float = 2.0,
        fetch_models: ModelFetcher | None = None,
        model_backoff: Backoff = Backoff(),
    ) -> None:
        super().__init__(fetch_models=fetch_models, model_backoff=model_backoff)
        self._path = Path(path)
        self._poll_interval_s = poll_interval_s
        self._signature: tuple[int, int, int] | None = None
        self._good_digest: bytes | None = None
        self._loaded_once = False
        self._last_error: str | None = None

    def describe(self) -> str:
        return f"file {self._path}"

    async def _run(self) -> None:
        while True:
            try:
                self._poll()
            except Exception as exc:
                # A bug in reading must cost one poll, not reloading for good: nothing else would show that
                # the router stopped following the file.
                self._signature = None  # read it again next time
                self._fail(f"engines file {self._path}: unexpected error {exc!r}", exc_info=True)
            self._synced.set()
            await asyncio.sleep(self._poll_interval_s)

    def _poll(self) -> None:
        # Blocking stat/read on purpose: a small local file costs microseconds, less than a thread hop.
        try:
            st = os.stat(self._path)
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
            if signature == self._signature:
                return
            data = self._path.read_bytes()
        except OSError as e:
            self._signature = None
            self._fail(f"engines file {self._path}: cannot read it ({e.strerror or e})")
            return
        self._signature = signature
        digest = hashlib.sha256(data).digest()
        if digest == self._good_digest:
            self._last_error = None
            return
        try:
            endpoints = parse_engines_file(data.decode("utf-8"), f"engines file {self._path}")
        except UnicodeDecodeError as e:
            self._fail(f"engines file {self._path}: not UTF-8 text (byte {e.start})")
            return
        except DiscoveryConfigError as e:
            self._fail(str(e))
            return
        self._good_digest = digest
        self._loaded_once = True
        self._last_error = None
        self._publish({e.url: e for e in endpoints})
        log.info("engines file %s: loaded %d engines", self._path, len(endpoints))

    def _fail(self, message: str, *, exc_info: bool = False) -> None:
        if message == self._last_error:
            return
        self._last_error = message
        kept = (
            f"keeping the last good list ({len(self._published)} engines)"
            if self._loaded_once
            else ("no engines loaded from it yet")
        )
        log.error("%s; %s", message, kept, exc_info=exc_info)


# ------------------------------------------------------------------------------------------------------------
# Kubernetes: pods, list + watch


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
    or being deleted. An unknown engine type or role label goes to ``warn`` and is replaced by the default.
    """
    meta = pod.metadata
    if meta is None or meta.deletion_timestamp is not None or not _pod_ready(pod):
        return None
    ip: str = pod.status.pod_ip
    host = f"[{ip}]" if ":" in ip else ip  # IPv6 pod IPs need brackets in URLs
    labels: dict[str, str] = meta.labels or {}
    annotations: dict[str, str] = meta.annotations or {}
    name = f"pod {meta.namespace}/{meta.name}"

    engine_type = default_engine_type
    if keys.engine_type_label in labels:
        try:
            engine_type = _engine_type(labels[keys.engine_type_label], name)
        except DiscoveryConfigError as e:
            if warn:
                warn(f"{e} (label {keys.engine_type_label}); treating it as {default_engine_type}")
    role = EngineRole.BOTH
    if keys.role_label in labels:
        try:
            role = _role(labels[keys.role_label], name)
        except DiscoveryConfigError as e:
            if warn:
                warn(f"{e} (label {keys.role_label}); treating it as {EngineRole.BOTH.value}")

    kv_events = annotations.get(keys.kv_events_annotation, "").strip() or None
    if kv_events is not None:
        if kv_events.isdigit():
            kv_events = f"tcp://{host}:{kv_events}"
        elif "*" in kv_events:
            kv_events = kv_events.replace("*", host)
        try:
            kv_events = _kv_events_endpoint(kv_events, name)
        except DiscoveryConfigError as e:
            if warn:
                warn(f"{e} (annotation {keys.kv_events_annotation}); ignoring it")
            kv_events = None
    models = frozenset(m.strip() for m in annotations.get(keys.models_annotation, "").split(",") if m.strip())
    spec = pod.spec
    return Endpoint(
        url=f"http://{host}:{port}",
        engine_type=engine_type,
        role=role,
        models=models,
        labels=tuple(sorted(labels.items())),
        node=spec.node_name if spec is not None else None,
        kv_events_endpoint=kv_events,
    )


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
        backoff: Backoff = Backoff(),
        model_backoff: Backoff = Backoff(),
    ) -> None:
        super().__init__(fetch_models=fetch_models, model_backoff=model_backoff)
        self._namespace = namespace
        self._selector = label_selector
        self._port = port
        self._api_client = api_client
        self._keys = keys
        self._default_engine_type = _engine_type(default_engine_type, "default_engine_type")
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
        attempt = 0
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
                attempt, delay = 0, 0.0
            else:
                delay = self._backoff.delay(attempt, self._rng)
                attempt += 1
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
