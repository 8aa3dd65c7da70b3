"""Flags both front ends take (``kvstack router`` and ``kvstack epp``): engines and discovery, routing,
circuit breakers and admission; and the `FrontEndOptions` fields they give.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


class UsageError(ValueError):
    """A flag value that cannot work; the command prints it and exits with status 2."""


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` (no upper bound when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def positive(text: str) -> float:
    """An argparse type: a finite number above 0 (seconds, sizes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be positive and finite, got {text}")
    return value


def header_name(text: str) -> str:
    """An argparse type: an HTTP header name (an RFC 9110 token), lower-cased."""
    if not text or not all(c.isascii() and (c.isalnum() or c in "!#$%&'*+-.^_`|~") for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an HTTP header name")
    return text.lower()


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engines (discovery)")
    g.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL[#type=..,role=..,model=..]",
        help="a static engine; repeat for several",
    )
    # One discovery source at a time; --engine can be added to either.
    source = g.add_mutually_exclusive_group()
    source.add_argument("--engines-file", help="YAML file listing engines, reloaded when it changes")
    source.add_argument("--k8s-namespace", help="discover engine pods in this namespace")
    g.add_argument(
        "--k8s-selector", help="label selector of engine pods (with --k8s-namespace; default: all)"
    )
    g.add_argument(
        "--k8s-port",
        type=int_in(1, 65535),
        help="engine port on the pods (with --k8s-namespace; default 8000)",
    )
    g.add_argument("--model", action="append", default=[], help="models /ready requires (default: all seen)")
    g.add_argument(
        "--scrape-interval",
        type=positive,
        default=1.0,
        help="seconds between scrapes of each engine's /metrics (readings older than 3 intervals are stale)",
    )
    g.add_argument(
        "--scrape-timeout", type=positive, default=0.5, help="seconds a scrape of /metrics may take"
    )


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing")
    g.add_argument(
        "--routing",
        default="auto",
        help="auto (kv-aware while some engine publishes KV events, else default; in kvstack epp their "
        "-replicas variants), a preset (default, kv-aware, prefix, round-robin, session, least-load, "
        "power-of-two, kv-aware-replicas, default-replicas, pd) or a YAML config file",
    )
    g.add_argument(
        "--session-header",
        action="append",
        default=[],
        type=header_name,
        metavar="NAME",
        help="request header holding a session key (repeat for several, tried in the order given; "
        "default x-session-id); without one, the body's user (or session_id) is the key; production-stack "
        "clients send x-user-id",
    )
    g.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="[MODEL=]DIR",
        help="local tokenizer directory for prefix routing (for MODEL, or every model); models without "
        "one are tokenized by an engine's /tokenize",
    )
    g.add_argument(
        "--no-remote-tokenize",
        dest="remote_tokenize",
        action="store_false",
        help="never ask engines to tokenize (prompts of models without --tokenizer route without prefix)",
    )
    g.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="do not subscribe to engines' KV events (prefix routing then uses the router's history)",
    )
    g.add_argument(
        "--cache-events",
        action="append",
        default=[],
        metavar="ENDPOINT[#node=N,replay=EP]",
        help="a kvstack cache-server's chunk events: engines on its node get credit for the prefixes it has",
    )
    g.add_argument(
        "--index-max-entries",
        type=int_in(1),
        default=4_000_000,
        help="bound of the prefix index in (engine, block) entries; LRU beyond it",
    )


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("circuit breaker and admission")
    g.add_argument(
        "--circuit-failures", type=int_in(1), default=5, help="consecutive failures that open a circuit"
    )
    g.add_argument("--circuit-open-seconds", type=positive, default=5.0)
    g.add_argument(
        "--max-in-flight", type=int_in(0), default=0, help="requests routed at once (0 = unlimited)"
    )
    g.add_argument("--max-queue", type=int_in(0), default=1024, help="requests waiting for a slot before 429")
    g.add_argument("--queue-timeout", type=positive, default=10.0)
    g.add_argument("--max-body-mb", type=positive, default=32.0)


def front_end_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `FrontEndOptions` fields the flags give; UsageError says what is wrong."""
    from kvstack.engines.discovery import FileDiscovery, parse_engine_spec
    from kvstack.frontend.circuit import CircuitConfig
    from kvstack.frontend.kv_feeds import CacheEvents
    from kvstack.scheduling import ConfigError
    from kvstack.scheduling.presets import load_routing

    try:
        engines = [parse_engine_spec(spec) for spec in args.engine]
        if args.routing != "auto":
            load_routing(args.routing)  # fail fast on a bad preset or config file
        tokenizers = _tokenizer_dirs(args.tokenizer)
        cache_events = [CacheEvents.parse(spec) for spec in args.cache_events]
        if args.k8s_namespace is None and (args.k8s_selector is not None or args.k8s_port is not None):
            raise ValueError("--k8s-selector and --k8s-port apply only with --k8s-namespace")
    except (ValueError, ConfigError) as exc:
        raise UsageError(str(exc)) from None
    discovery = None
    if args.engines_file:
        discovery = FileDiscovery(args.engines_file)
    elif args.k8s_namespace:
        discovery = kubernetes_discovery(args)
    if not engines and discovery is None:
        raise UsageError("give engines with --engine, --engines-file or --k8s-namespace")
    return {
        "engines": engines,
        "discovery": discovery,
        "routing": args.routing,
        "circuit": CircuitConfig(
            failure_threshold=args.circuit_failures, open_seconds=args.circuit_open_seconds
        ),
        "max_in_flight": args.max_in_flight,
        "max_queue": args.max_queue,
        "queue_timeout": args.queue_timeout,
        "expected_models": frozenset(args.model),
        "scrape_interval": args.scrape_interval,
        "scrape_timeout": args.scrape_timeout,
        "tokenizers": tokenizers,
        "remote_tokenize": args.remote_tokenize,
        "kv_events": args.kv_events,
        "index_max_entries": args.index_max_entries,
        "cache_events": cache_events,
    }


def _tokenizer_dirs(values: list[str]) -> dict[str, str]:
    """``--tokenizer`` values as {model: dir}; a bare DIR is for every model ("*")."""
    out: dict[str, str] = {}
    for value in values:
        model, sep, directory = value.partition("=")
        if not sep:
            model, directory = "*", value
        if not (Path(directory) / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {value}: {directory} has no tokenizer.json")
        out[model] = directory
    return out


def kubernetes_discovery(args: argparse.Namespace) -> Any:
    from kubernetes_asyncio import client, config

    from kvstack.engines.discovery import KubernetesDiscovery

    try:
        config.load_incluster_config()
    except config.ConfigException:
        import asyncio as _asyncio

        _asyncio.run(config.load_kube_config())
    return KubernetesDiscovery(
        args.k8s_namespace, args.k8s_selector or "", args.k8s_port or 8000, api_client=client.ApiClient()
    )
