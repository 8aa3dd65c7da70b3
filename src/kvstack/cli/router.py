"""``kvstack router``: the OpenAI-compatible router, built from flags (kvstack.router.server serves it).

``--workers`` (default ``auto``: one per usable core, ``kvstack.router.workers.usable_cores``) above 1 runs
that many copies of this command on one port (SO_REUSEPORT) and stops them together; kvstack.router.workers
is how they share state. ``--workers 1`` serves in this process.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvstack.cli import front_end
from kvstack.cli.front_end import int_in, positive
from kvstack.cli.signals import serve_until_signal


def worker_count(text: str) -> int:
    """An argparse type: ``auto`` (one worker per usable core) or a count >= 1."""
    if text == "auto":
        from kvstack.router.workers import usable_cores

        return usable_cores()
    return int_in(1)(text)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "router", help="run the OpenAI-compatible router", description="Run the kvstack router."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_in(0, 65535), default=8080, help="0 = a free port")
    p.add_argument(
        "--workers",
        type=worker_count,
        default="auto",
        help="router processes sharing the port (SO_REUSEPORT); auto (default) = one per usable core "
        "(CPU affinity, capped by a cgroup CPU limit); 1 = this process only. They share admin changes, "
        "circuit breaker trips, in-flight counts and /metrics; admission limits are divided between them",
    )
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    front_end.add_engine_arguments(p)
    front_end.add_routing_arguments(p)
    g = p.add_argument_group("timeouts and retries")
    g.add_argument("--timeout-connect", type=positive, default=5.0)
    g.add_argument("--timeout-first-byte", type=positive, default=120.0)
    g.add_argument("--timeout-idle", type=positive, default=60.0)
    g.add_argument("--timeout-total", type=positive, default=1800.0)
    g.add_argument(
        "--max-attempts", type=int_in(1), default=3, help="engines tried per request before giving up"
    )
    g.add_argument(
        "--hold-until-content",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hold a stream's status, headers and role chunk back until its first content, so that an engine "
        "failing before then is retried on another one unseen",
    )
    g.add_argument(
        "--hold-bytes",
        type=int_in(0),
        default=64 * 1024,
        help="bytes of a stream's start held at most; past them it is relayed and no longer retried",
    )
    g.add_argument(
        "--hold-seconds",
        type=positive,
        default=None,
        help="seconds from sending a request that its stream may be held (default: --timeout-first-byte); "
        "past them it is relayed and no longer retried",
    )
    g.add_argument(
        "--pd-prefill-timeout",
        type=positive,
        default=30.0,
        help="seconds a P/D prefill request may take; past it the decode engine computes the prompt itself",
    )
    front_end.add_limit_arguments(p)
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
    from kvstack.router.app import RouterConfig
    from kvstack.router.hold import HoldPolicy
    from kvstack.router.proxy import RetryPolicy, Timeouts
    from kvstack.router.server import RouterOptions, serve_forever
    from kvstack.scheduling.interfaces import SESSION_HEADERS

    try:
        shared = front_end.front_end_options(args)
    except front_end.UsageError as exc:
        print(f"kvstack router: {exc}", file=sys.stderr)
        return 2
    api_keys = set(args.api_key) | {k for k in os.environ.get("KVSTACK_API_KEYS", "").split(",") if k}
    opts = RouterOptions(
        **shared,
        host=args.host,
        port=args.port,
        app=RouterConfig(
            max_body_bytes=int(args.max_body_mb * 1024 * 1024),
            api_keys=frozenset(api_keys),
            admin_key=args.admin_key or os.environ.get("KVSTACK_ADMIN_KEY") or None,
            timeouts=Timeouts(
                args.timeout_connect, args.timeout_first_byte, args.timeout_idle, args.timeout_total
            ),
            hold=HoldPolicy(args.hold_until_content, args.hold_bytes, args.hold_seconds),
            session_headers=tuple(args.session_header) or SESSION_HEADERS,
            pd_prefill_timeout=args.pd_prefill_timeout,
        ),
        retry=RetryPolicy(max_attempts=args.max_attempts),
        reuse_port=args.reuse_port or args.workers > 1,
    )
    if args.workers > 1:
        return _supervise(argv, args.workers, args.host, args.port)
    from kvstack.router.workers import WorkerGroupConfig

    opts.group = WorkerGroupConfig.from_env()
    return serve_until_signal(serve_forever(opts))


def _supervise(argv: list[str], workers: int, host: str, port: int) -> int:
    """Run ``workers`` router processes on one port and stop them together (kvstack.router.workers)."""
    import shutil
    import socket
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
    # Port 0: the supervisor picks the free port and holds it (bound, not listening: it takes no connections).
    reserved = None
    if port == 0:
        reserved = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind((host, 0))
        port = reserved.getsockname()[1]
    # Each worker is this command again with one worker; the last --workers/--reuse-port/--port wins.
    command = [sys.executable, "-m", "kvstack.cli", *argv, "--workers", "1", "--reuse-port"]
    command += ["--port", str(port)]
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
        if reserved is not None:
            reserved.close()
    return code
