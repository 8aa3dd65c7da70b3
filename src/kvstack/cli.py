"""The ``kvstack`` command: the composition root that builds every object from flags.

Subcommands: ``sim`` (simulated vLLM engines), ``router``, ``up`` (a local stack: simulated engines, a KV
cache server and the router), ``cache-server``, ``bench``, ``model make-tiny`` (a dummy-weight model directory
that real vLLM and the simulator both serve), ``version``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack import __version__
from kvstack.bench.cli import add_bench_parser
from kvstack.bench.cli import run_bench as run_bench_command
from kvstack.cache.cli import add_cache_server_parser, run_cache_server
from kvstack.sim.kv_connector import DEFAULT_CHUNK_SIZE


def _add_sim_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sim", help="run simulated vLLM engines", description="Run simulated vLLM engines.")
    g = p.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument(
        "--port", type=int, default=8000, help="port of engine 0; engine i uses port+i (0 = free ports)"
    )
    g.add_argument("--engines", type=int, default=1, help="number of engines in this process (default 1)")
    g.add_argument("--served-model-name", nargs="+", default=None, help="model names to serve")
    g.add_argument("--model", default=None, help="model directory (its tokenizer is used unless --tokenizer)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory; default: the built-in tokenizer")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument(
        "--enable-prompt-tokens-details", action="store_true", help="report usage.prompt_tokens_details"
    )
    g.add_argument("--legacy-metric-names", action="store_true", help="export pre-rename vLLM metric names")
    g = p.add_argument_group("KV cache and scheduler")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (CPU vLLM uses 128)")
    g.add_argument(
        "--num-gpu-blocks", type=int, default=8192, help="KV blocks per engine, including the null block"
    )
    g.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument(
        "--max-num-queued-reqs", type=int, default=None, help="503 beyond this many unfinished seqs"
    )
    g = p.add_argument_group("latency model (seconds at --time-scale 1)")
    g.add_argument("--time-scale", type=float, default=1.0, help="run N times faster, same ratios")
    g.add_argument("--prefill-per-token", type=float, default=0.00005)
    g.add_argument("--decode-base", type=float, default=0.008, help="inter-token latency at batch size 1")
    g.add_argument(
        "--decode-per-seq", type=float, default=0.0001, help="added inter-token latency per running seq"
    )
    g.add_argument("--step-overhead", type=float, default=0.001)
    g.add_argument(
        "--kv-load-per-token",
        type=float,
        default=0.000005,
        help="prefill cost of a prompt token loaded from the KV cache tier instead of computed",
    )
    g.add_argument("--seed", type=int, default=0, help="output and block-hash seed")
    g.add_argument(
        "--mean-output-len", type=int, default=128, help="mean tokens before EOS (without ignore_eos)"
    )
    g = p.add_argument_group("KV events")
    g.add_argument("--no-kv-events", dest="kv_events", action="store_false", help="do not publish KV events")
    g.add_argument(
        "--kv-events-port", type=int, default=0, help="ZMQ PUB port of engine 0 (+i); 0 = free port"
    )
    g.add_argument("--kv-events-replay", action="store_true", help="serve vLLM's replay protocol")
    g.add_argument("--kv-events-replay-port", type=int, default=0)
    g.add_argument("--kv-events-legacy-encoding", action="store_true", help="older array-encoded events")
    g.add_argument(
        "--kv-hold-timeout",
        type=float,
        default=30.0,
        help="P/D prefill side: seconds to hold blocks for a decode side that never pulls",
    )
    g = p.add_argument_group("KV cache tier (an emulated kvstack KV connector)")
    g.add_argument(
        "--kv-cache-server",
        metavar="tcp://HOST:PORT",
        help="load prompt chunks from this kvstack cache-server and save computed ones (default: off)",
    )
    g.add_argument(
        "--kv-cache-chunk-size",
        type=int,
        default=DEFAULT_CHUNK_SIZE,
        help="tokens per chunk, a multiple of --block-size; the cache server's --chunk-size",
    )
    g.add_argument(
        "--kv-cache-bytes-per-token", type=int, default=16, help="size of the synthetic chunk payloads"
    )
    g.add_argument("--kv-cache-timeout", type=float, default=0.5, help="seconds per cache server call")
    g = p.add_argument_group("fault injection (also at runtime: POST /admin/faults)")
    g.add_argument("--error-rate", type=float, default=0.0)
    g.add_argument("--error-codes", default="500", help="comma-separated subset of 429,500,503")
    g.add_argument("--drop-rate", type=float, default=0.0, help="fraction of streams cut mid-stream")
    g.add_argument("--drop-after-chunks", type=int, default=1)
    g.add_argument(
        "--first-token-delay", type=float, default=0.0, help="wall seconds added before the first byte"
    )
    g.add_argument("--hang-rate", type=float, default=0.0)
    g.add_argument("--log-level", default="info")


def _run_sim(args: argparse.Namespace) -> int:
    from kvstack.engines.tokenizer import load_tokenizer
    from kvstack.sim.cluster import RunningEngine, SimOptions, serve
    from kvstack.sim.engine import EngineConfig
    from kvstack.sim.faults import FaultConfig
    from kvstack.sim.kv_connector import CacheTierConfig, sim_kv_layout
    from kvstack.sim.scheduler import LatencyModel

    tokenizer_dir = args.tokenizer or args.model
    tokenizer = load_tokenizer(tokenizer_dir)
    names = args.served_model_name or [args.model or "kvstack-sim"]
    try:
        faults = FaultConfig(
            error_rate=args.error_rate,
            error_codes=tuple(int(c) for c in args.error_codes.split(",") if c),
            drop_rate=args.drop_rate,
            drop_after_chunks=args.drop_after_chunks,
            first_token_delay=args.first_token_delay,
            hang_rate=args.hang_rate,
        ).validate()
    except ValueError as exc:
        print(f"kvstack sim: {exc}", file=sys.stderr)
        return 2
    if args.time_scale <= 0 or args.engines < 1 or args.block_size < 1:
        print("kvstack sim: --time-scale, --engines and --block-size must be positive", file=sys.stderr)
        return 2
    model_root = str(Path(args.model).resolve()) if args.model else names[0]
    cache_tier = None
    if args.kv_cache_server:
        try:
            cache_tier = CacheTierConfig(
                server=args.kv_cache_server,
                layout=sim_kv_layout(model_root, args.model, args.block_size),
                chunk_size=args.kv_cache_chunk_size,
                bytes_per_token=args.kv_cache_bytes_per_token,
                timeout_s=args.kv_cache_timeout,
            ).validate(args.block_size)
        except ValueError as exc:
            print(f"kvstack sim: {exc}", file=sys.stderr)
            return 2
    engine = EngineConfig(
        model_name=names[0],
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_queued_reqs=args.max_num_queued_reqs,
        enable_prefix_caching=args.prefix_caching,
        time_scale=args.time_scale,
        seed=args.seed,
        mean_output_len=args.mean_output_len,
        latency=LatencyModel(
            step_overhead=args.step_overhead,
            prefill_per_token=args.prefill_per_token,
            decode_base=args.decode_base,
            decode_per_seq=args.decode_per_seq,
            load_per_token=args.kv_load_per_token,
        ),
        legacy_metric_names=args.legacy_metric_names,
    )
    opts = SimOptions(
        engine=engine,
        served_model_names=names,
        model_root=model_root,
        host=args.host,
        port=args.port,
        engines=args.engines,
        kv_events=args.kv_events,
        kv_events_port=args.kv_events_port,
        replay=args.kv_events_replay,
        replay_port=args.kv_events_replay_port,
        legacy_event_encoding=args.kv_events_legacy_encoding,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        kv_hold_timeout=args.kv_hold_timeout,
        faults=faults,
        cache_tier=cache_tier,
    )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[list[RunningEngine]] = loop.create_future()
        task: asyncio.Future[None] = asyncio.ensure_future(serve(opts, tokenizer, ready=ready))
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        waiters: set[asyncio.Future[Any]] = {task, ready}
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # start-up failed: raise its error
            return
        engines = ready.result()
        print(
            f"kvstack sim: {len(engines)} engine(s) serving model {names[0]!r} (tokenizer: {tokenizer.name})"
        )
        if cache_tier is not None:
            print(f"  KV cache tier: {cache_tier.server} (chunks of {cache_tier.chunk_size} tokens)")
        for e in engines:
            events = f"  kv events {e.events_endpoint}" if e.events_endpoint else ""
            print(f"  engine {e.index}: {e.url}/v1  metrics {e.url}/metrics{events}")
        first = engines[0].url
        print(
            f"try: curl {first}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{names[0]}", "prompt": "Hello", "max_tokens": 16}}\'',
            flush=True,
        )
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        import uvloop

        uvloop.run(main())
    except KeyboardInterrupt:
        pass
    return 0


def _run_model(args: argparse.Namespace) -> int:
    from kvstack.devtools.tiny_model import SHAPES, make_tiny_model

    path = make_tiny_model(Path(args.directory), shape=SHAPES[args.shape], model_name=args.name)
    if not args.quiet:
        print(json.dumps({"model_dir": str(path), "shape": args.shape}))
    return 0


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


def _add_router_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _run_router(args: argparse.Namespace, argv: list[str]) -> int:
    from kvstack.engines.discovery import FileDiscovery, parse_engine_spec
    from kvstack.router.app import RouterConfig
    from kvstack.router.circuit import CircuitConfig
    from kvstack.router.kv_feeds import CacheEvents
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
    return _serve(serve_forever(opts))


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


def _serve(main: Any) -> int:
    """Run a server coroutine under uvloop until SIGINT/SIGTERM."""
    import uvloop

    async def wrapper() -> None:
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    uvloop.run(wrapper())
    return 0


def _add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up", help="a local stack: simulated engines and a KV cache server with the router in front"
    )
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--port", type=int, default=8080, help="router port; engines use port+1 .. port+N")
    p.add_argument(
        "--model", default=None, help="model directory for the engines' tokenizer (default built-in)"
    )
    p.add_argument("--served-model-name", default="kvstack-sim")
    p.add_argument("--routing", default="auto")
    p.add_argument("--time-scale", type=float, default=1.0)
    g = p.add_argument_group("KV cache tier")
    g.add_argument(
        "--no-cache-server",
        dest="cache_server",
        action="store_false",
        help="no cache server: engines without a KV connector, the router without cache events",
    )
    g.add_argument(
        "--cache-port",
        type=int,
        default=0,
        help="cache server port; its events use port+1 and their replay port+2 (0 = free ports)",
    )
    g.add_argument("--cache-memory-mb", type=float, default=256.0, help="the cache server's memory budget")
    g.add_argument("--cache-chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="tokens per chunk")
    p.add_argument("--log-level", default="warning")


@dataclass(frozen=True)
class _CacheServerPlan:
    """Where ``kvstack up``'s cache server listens, and what it holds."""

    bind: str
    events: str
    replay: str
    node: str
    memory_mb: float
    chunk_size: int

    @classmethod
    def on_port(cls, port: int, **kwargs: Any) -> _CacheServerPlan:
        ports = [port, port + 1, port + 2] if port else [_free_port() for _ in range(3)]
        bind, events, replay = (f"tcp://127.0.0.1:{p}" for p in ports)
        return cls(bind, events, replay, **kwargs)

    def command(self, log_level: str) -> list[str]:
        return [
            sys.executable, "-m", "kvstack.cli", "cache-server", "--bind", self.bind,
            "--events", self.events, "--events-replay", self.replay, "--node", self.node,
            "--memory-gb", str(self.memory_mb / 1024), "--chunk-size", str(self.chunk_size),
            "--log-level", log_level,
        ]  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _start_cache_server(plan: _CacheServerPlan, log_level: str) -> asyncio.subprocess.Process:
    """``kvstack cache-server`` as a child process (same process group: stopping the stack's group stops
    it too); returns once it has bound its sockets (its first line of output)."""
    proc = await asyncio.create_subprocess_exec(
        *plan.command(log_level), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        ready = await asyncio.wait_for(proc.stdout.readline(), timeout=60.0)
    except BaseException:
        await _stop_process(proc)
        raise
    if not ready:
        code = await proc.wait()
        print(f"kvstack up: the cache server exited ({code}) before serving (see above)", file=sys.stderr)
        raise SystemExit(1)
    return proc


async def _stop_process(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def _drain_output(proc: asyncio.subprocess.Process) -> None:
    """Pass the cache server's later output on (an unread pipe would block it once full)."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()


def _run_up(args: argparse.Namespace) -> int:
    import socket

    from kvstack.engines.state import Endpoint
    from kvstack.engines.tokenizer import load_tokenizer
    from kvstack.router.kv_feeds import CacheEvents
    from kvstack.router.server import RouterOptions, running_router
    from kvstack.sim.cluster import SimOptions, start_engine, stop_engine
    from kvstack.sim.engine import EngineConfig
    from kvstack.sim.kv_connector import CacheTierConfig, sim_kv_layout
    from kvstack.sim.textgen import OutputSampler

    tokenizer = load_tokenizer(args.model)
    name = args.served_model_name
    engine_cfg = EngineConfig(model_name=name, time_scale=args.time_scale)
    model_root = args.model or name
    # Engines and cache server share one node: the cache's chunks count for every engine.
    node = socket.gethostname()
    plan = None
    cache_tier = None
    if args.cache_server:
        try:
            if args.cache_memory_mb <= 0:
                raise ValueError("--cache-memory-mb must be positive")
            plan = _CacheServerPlan.on_port(
                args.cache_port, node=node, memory_mb=args.cache_memory_mb, chunk_size=args.cache_chunk_size
            )
            cache_tier = CacheTierConfig(
                server=plan.bind,
                layout=sim_kv_layout(model_root, args.model, engine_cfg.block_size),
                chunk_size=args.cache_chunk_size,
            ).validate(engine_cfg.block_size)
        except ValueError as exc:
            print(f"kvstack up: {exc}", file=sys.stderr)
            return 2
    sim = SimOptions(
        engine=engine_cfg,
        served_model_names=[name],
        model_root=model_root,
        port=args.port + 1,
        engines=args.engines,
        enable_prompt_tokens_details=True,
        cache_tier=cache_tier,
    )

    async def main() -> None:
        cache = None if plan is None else await _start_cache_server(plan, args.log_level)
        background: list[asyncio.Task[Any]] = []
        engines = []
        try:
            sampler = OutputSampler(tokenizer)
            for i in range(args.engines):
                engines.append(await start_engine(sim, tokenizer, sampler, i))
            opts = RouterOptions(
                port=args.port,
                engines=[Endpoint(e.url, node=node) for e in engines],
                routing=args.routing,
                tokenizers={"*": args.model} if args.model else {},
                cache_events=[]
                if plan is None
                else [CacheEvents(plan.events, node=node, replay_endpoint=plan.replay)],
            )
            async with running_router(opts) as router:
                parts = f"{len(engines)} simulated engine(s)" + ("" if plan is None else " + KV cache server")
                print(f"kvstack: {parts} serving {name!r} behind the router")
                for e in engines:
                    print(f"  engine {e.index}: {e.url}  (kv events {e.events_endpoint})")
                if plan is not None:
                    print(
                        f"  cache:    {plan.bind}  (events {plan.events}, node {node}, "
                        f"{plan.memory_mb:g} MiB memory, chunks of {plan.chunk_size} tokens)"
                    )
                print(f"  router:   {router.url}  (/engines, /metrics, /ready)")
                print(f"OpenAI base URL: {router.url}/v1   model: {name}")
                print(
                    f"try: curl {router.url}/v1/chat/completions -H 'Content-Type: application/json' "
                    f'-d \'{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello"}}]}}\'',
                    flush=True,
                )
                if cache is not None:
                    background.append(asyncio.ensure_future(_drain_output(cache)))
                    code = await cache.wait()
                    # The engines keep serving (every lookup a miss), as a stack whose cache died would.
                    print(f"kvstack up: cache server exited ({code}); engines go on without it", flush=True)
                await asyncio.Event().wait()
        finally:
            for task in background:
                task.cancel()
            for e in engines:
                await stop_engine(e)
            if cache is not None:
                await _stop_process(cache)

    return _serve(main())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstack", description="KV-cache-aware serving stack around vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_sim_parser(sub)
    _add_router_parser(sub)
    _add_up_parser(sub)
    add_bench_parser(sub)
    add_cache_server_parser(sub)
    model = sub.add_parser("model", help="model directories for tests and benchmarks")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser("make-tiny", help="write a dummy-weight model directory (no network)")
    tiny.add_argument("directory")
    tiny.add_argument("--shape", choices=["tiny", "qwen2-0.5b"], default="tiny")
    tiny.add_argument("--name", default="kvstack-tiny")
    tiny.add_argument("--quiet", action="store_true")
    sub.add_parser("version", help="print the kvstack version")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        print(f"kvstack {__version__}")
        return 0
    if args.command == "model":
        return _run_model(args)
    if args.command == "bench":
        return run_bench_command(args)
    if args.command == "cache-server":
        return run_cache_server(args)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO))
    if args.command == "router":
        return _run_router(args, list(sys.argv[1:] if argv is None else argv))
    if args.command == "up":
        return _run_up(args)
    return _run_sim(args)


if __name__ == "__main__":
    sys.exit(main())
