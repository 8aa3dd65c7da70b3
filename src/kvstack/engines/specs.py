"""Engine specs: the one set of checks for every way an engine is described.

Fields: ``url`` (http(s)://HOST[:PORT][/PATH], no query or fragment), ``type`` (an engine type with a metric
catalog, any case; default vllm), ``role`` (both|prefill|decode, any case; default both), ``models`` (a list
of names; default none, learned from /v1/models), ``node`` (a non-empty name), ``kv_events`` (the engine's
ZMQ endpoint, tcp://host:port or ipc://path) and ``labels`` (name -> text). ``None`` means "not given".

``build_endpoint`` checks already-split fields and returns the `Endpoint`; the entry points (``--engine``
strings, the engines file, Kubernetes pods, ``POST /admin/engines``) only turn their own syntax into fields.
A bad field raises `EngineSpecError`, whose message says where and what is wrong and whose ``field`` names
the field. The ``check_*`` functions are the single-field rules, for a source that falls back per field.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from kvstack.engines.catalog import CATALOGS
from kvstack.engines.state import Endpoint, EngineRole
from kvstack.http.origin import Origin

# Engine types with a metric catalog; any other type is a typo, caught when the engine is described.
ENGINE_TYPES = frozenset(c.engine_type for c in CATALOGS)
DEFAULT_ENGINE_TYPE = "vllm"
FIELDS = ("url", "type", "role", "models", "node", "kv_events", "labels")


class EngineSpecError(ValueError):
    """An engine description that cannot be used; the message says where and what, ``field`` which field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def with_default_scheme(text: str) -> str:
    """``text`` stripped, with ``http://`` in front when it names no scheme (``h:8000`` shorthand)."""
    text = text.strip()
    return text if "://" in text else "http://" + text


def check_url(value: object, where: str) -> str:
    """An engine base URL, without trailing slash."""
    if not isinstance(value, str):
        raise EngineSpecError(f"{where}: 'url' is required and must be a string", "url")
    try:
        # What the proxy will connect with: a bad host, port or IPv6 literal fails here, with the entry
        # named, instead of on every request.
        Origin.parse(value)
        parts = urlsplit(value)
        if parts.query:
            raise ValueError("a base URL has no query string")
        if parts.fragment:
            raise ValueError(
                f"'#{parts.fragment}': options after '#' are read only in the string form of an engine "
                "(--engine, a string entry of an engines file); elsewhere they are the fields "
                f"{', '.join(FIELDS[1:])}"
            )
    except ValueError as exc:
        raise EngineSpecError(
            f"{where}: {value!r} is not an engine base URL ({exc}); expected http(s)://HOST:PORT[/PATH], "
            "e.g. http://10.0.0.5:8000",
            "url",
        ) from None
    return value.rstrip("/")


def check_engine_type(value: object, where: str) -> str:
    """An engine type with a catalog, lower-cased; ``None`` is the default type."""
    if value is None:
        return DEFAULT_ENGINE_TYPE
    engine_type = _text(value, "type", where).strip().lower()
    if engine_type not in ENGINE_TYPES:
        raise EngineSpecError(
            f"{where}: engine type {value!r} is not one of {', '.join(sorted(ENGINE_TYPES))}", "type"
        )
    return engine_type


def check_role(value: object, where: str) -> EngineRole:
    """A disaggregation role, any case; ``None`` is both."""
    if value is None:
        return EngineRole.BOTH
    try:
        return EngineRole(_text(value, "role", where).strip().lower())
    except ValueError:
        roles = ", ".join(r.value for r in EngineRole)
        raise EngineSpecError(f"{where}: role {value!r} is not one of {roles}", "role") from None


def check_models(value: object, where: str) -> frozenset[str]:
    """A list of non-empty model names; ``None`` is none."""
    if value is None:
        return frozenset()
    if not isinstance(value, list | tuple) or not all(isinstance(m, str) and m for m in value):
        raise EngineSpecError(f"{where}: 'models' must be a list of model names", "models")
    return frozenset(value)


def check_node(value: object, where: str) -> str | None:
    """A non-empty node name, or ``None``."""
    if value is not None and (not isinstance(value, str) or not value):
        raise EngineSpecError(f"{where}: 'node' must be a non-empty string", "node")
    return value


def check_kv_events(value: object, where: str) -> str | None:
    """A ZMQ endpoint the router can connect to (tcp://host:port or ipc://path), or ``None``."""
    if value is not None and (not isinstance(value, str) or not value.startswith(("tcp://", "ipc://"))):
        raise EngineSpecError(
            f"{where}: KV-event endpoint {value!r} must be tcp://host:port or ipc://path", "kv_events"
        )
    return value


def check_labels(value: object, where: str) -> tuple[tuple[str, str], ...]:
    """Labels as sorted (name, text) pairs; ``None`` is none."""
    if value is None:
        return ()
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()
    ):
        raise EngineSpecError(f"{where}: 'labels' must map names to string values", "labels")
    return tuple(sorted(value.items()))


def build_endpoint(
    where: str,
    url: object,
    *,
    engine_type: object = None,
    role: object = None,
    models: object = None,
    node: object = None,
    kv_events: object = None,
    labels: object = None,
) -> Endpoint:
    """The engine these fields describe; ``EngineSpecError`` for the first bad one.

    ``where`` names the entry for messages; errors after the URL also name the URL.
    """
    checked_url = check_url(url, where)
    where = f"{where} ({checked_url})"
    return Endpoint(
        url=checked_url,
        engine_type=check_engine_type(engine_type, where),
        role=check_role(role, where),
        models=check_models(models, where),
        labels=check_labels(labels, where),
        node=check_node(node, where),
        kv_events_endpoint=check_kv_events(kv_events, where),
    )


def _text(value: object, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise EngineSpecError(f"{where}: '{field}' must be a string, not {type(value).__name__}", field)
    return value
