"""``kvstack router``: the OpenAI-compatible router, built from flags (kvstack.router.server serves it).

``--workers N`` (N > 1) runs N copies of this command on one port (SO_REUSEPORT) and stops them together;
kvstack.router.workers is how they share state.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstack.cli.signals import serve_until_signal


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
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


def _positive(text: str) -> float:
    """An argparse type: a finite number above 0 (seconds, sizes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be positive and finite, got {text}")
    return value


def _header_name(text: str) -> str:
    """An argparse type: an HTTP header name (an RFC 9110 token), lower-cased."""
    if not text or not all(c.isascii() and (c.isalnum() or c in "!#$%&'*+-.^_`|~") for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an HTTP header name")
    return text.lower()


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "router", help="run the OpenAI-compatible router", description="Run the kvstack router."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_int_in(0, 65535), default=8080, help="0 = a free port")
    p.add_argument(
        "--workers",
        type=_int_in(1),
        default=1,
        help="router processes sharing the port (SO_REUSEPORT); they share admin changes, circuit "
        "breaker trips, in-flight counts and /metrics; admission limits are divided between them",
    )
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
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
        type=_int_in(1, 65535),
        help="engine port on the pods (with --k8s-namespace; default 8000)",
    )
    g.add_argument("--model", action="append", default=[], help="models /ready requires (default: all seen)")
    g.add_argument(
        "--scrape-interval",
        type=_positive,
        default=1.0,
        help="seconds between scrapes of each engine's /metrics (readings older than 3 intervals are stale)",
    )
    g.add_argument(
        "--scrape-timeout", type=_positive, default=0.5, help="seconds a scrape of /metrics may take"
    )
    g = p.add_argument_group("routing")
    g.add_argument(
        "--routing",
        default="auto",
        help="auto (kv-aware while some engine publishes KV events, else default), a preset (default, "
        "kv-aware, prefix, round-robin, session, least-load, power-of-two) or a YAML config file",
    )
    g.add_argument(
        "--session-header",
        action="append",
        default=[],
        type=_header_name,
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
        type=_int_in(1),
        default=4_000_000,
        help="bound of the prefix index in (engine, block) entries; LRU beyond it",
    )
    g = p.add_argument_group("timeouts, retries, circuit breaker, admission")
    g.add_argument("--timeout-connect", type=_positive, default=5.0)
    g.add_argument("--timeout-first-byte", type=_positive, default=120.0)
    g.add_argument("--timeout-idle", type=_positive, default=60.0)
    g.add_argument("--timeout-total", type=_positive, default=1800.0)
    g.add_argument(
        "--max-attempts", type=_int_in(1), default=3, help="engines tried per request before giving up"
    )
    g.add_argument(
        "--circuit-failures", type=_int_in(1), default=5, help="consecutive failures that open a circuit"
    )
    g.add_argument("--circuit-open-seconds", type=_positive, default=5.0)
    g.add_argument(
        "--max-in-flight", type=_int_in(0), default=0, help="proxied requests at once (0 = unlimited)"
    )
    g.add_argument(
        "--max-queue", type=_int_in(0), default=1024, help="requests waiting for a slot before 429"
    )
    g.add_argument("--queue-timeout", type=_positive, default=10.0)
    g.add_argument("--max-body-mb", type=_positive, default=32.0)
    g = p.add_argument_group("access")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="client API key (also KVSTACK_API_KEYS, comma-separated)",
    )
    g.add_argument("--admin-key", default=None, help="key for /admin endpoints (also KVSTACK_ADMIN_KEY)")
    p.add_argument("--log-level", default="info")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from kvstack.engines.discovery import FileDiscovery, parse_engine_spec
    from kvstack.frontend.circuit import CircuitConfig
    from kvstack.frontend.kv_feeds import CacheEvents
    from kvstack.router.app import RouterConfig
    from kvstack.router.proxy import RetryPolicy, Timeouts
    from kvstack.router.server import RouterOptions, serve_forever
    from kvstack.scheduling import ConfigError
    from kvstack.scheduling.interfaces import SESSION_HEADERS
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
        print(f"kvstack router: {exc}", file=sys.stderr)
        return 2
    discovery = None
    if args.engines_file:
        discovery = FileDiscovery(args.engines_file)
    elif args.k8s_namespace:
        discovery = _kubernetes_discovery(args)
    if not engines and discovery is None:
        print(
            "kvstack router: give engines with --engine, --engines-file or --k8s-namespace", file=sys.stderr
        )
        return 2
    api_keys = set(args.api_key) | {k for k in os.environ.get("KVSTACK_API_KEYS", "").split(",") if k}
    opts = RouterOptions(
        host=args.host,
        port=args.port,
        engines=engines,
        discovery=discovery,
        routing=args.routing,
        app=RouterConfig(
            max_body_bytes=int(args.max_body_mb * 1024 * 1024),
            api_keys=frozenset(api_keys),
            admin_key=args.admin_key or os.environ.get("KVSTACK_ADMIN_KEY") or None,
            timeouts=Timeouts(
                args.timeout_connect, args.timeout_first_byte, args.timeout_idle, args.timeout_total
            ),
            session_headers=tuple(args.session_header) or SESSION_HEADERS,
        ),
        retry=RetryPolicy(max_attempts=args.max_attempts),
        circuit=CircuitConfig(
            failure_threshold=args.circuit_failures, open_seconds=args.circuit_open_seconds
        ),
        max_in_flight=args.max_in_flight,
        max_queue=args.max_queue,
        queue_timeout=args.queue_timeout,
        expected_models=frozenset(args.model),
        scrape_interval=args.scrape_interval,
        scrape_timeout=args.scrape_timeout,
        reuse_port=args.reuse_port or args.workers > 1,
        tokenizers=tokenizers,
        remote_tokenize=args.remote_tokenize,
        kv_events=args.kv_events,
        index_max_entries=args.index_max_entries,
        cache_events=cache_events,
    )
    if args.workers > 1:
        return _supervise(argv, args.workers)
    from kvstack.router.workers import WorkerGroupConfig

    opts.group = WorkerGroupConfig.from_env()
    return serve_until_signal(serve_forever(opts))


def _supervise(argv: list[str], workers: int) -> int:
    """Run ``workers`` router processes on one port and stop them together (kvstack.router.workers)."""
    import shutil
    import tempfile

    from kvstack.router import workers as group

    directory = Path(tempfile.mkdtemp(prefix="kvstack-router-"))
    group.prepare_group_directory(directory, workers)
    env = dict(os.environ)
    env.update(
        {
            "PROMETHEUS_MULTIPROC_DIR": str(directory / group.METRICS_SUBDIR),
            group.ENV_DIR: str(directory),
            group.ENV_COUNT: str(workers),
        }
    )
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    # Each worker is this command again with one worker; the last --workers/--reuse-port wins.
    command = [sys.executable, "-m", "kvstack.cli", *argv, "--workers", "1", "--reuse-port"]
    children = [subprocess.Popen(command, env={**env, group.ENV_INDEX: str(i)}) for i in range(workers)]
    code = 0
    try:
        while not stopping:
            exited = [c for c in children if c.poll() is not None]
            if exited:
                code = exited[0].returncode or 1
                print(f"kvstack router: worker {exited[0].pid} exited ({code}); stopping", file=sys.stderr)
                break
            time.sleep(0.2)
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(directory, ignore_errors=True)
    return code


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


def _kubernetes_discovery(args: argparse.Namespace) -> Any:
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
