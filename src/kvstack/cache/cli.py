"""``kvstack cache-server``: the KV cache server process (memory, optional disk, Redis and S3 tiers).

Wired into ``kvstack`` by ``kvstack.cli`` (`add_cache_server_parser`, `run_cache_server`); also runnable as
``python -m kvstack.cache.cli cache-server ...``. Example::

    kvstack cache-server --bind tcp://127.0.0.1:5560 --memory-gb 1 --disk-dir /var/cache/kvstack \\
        --disk-gb 50 --redis-url redis://10.0.0.9:6379/0 --chunk-size 128 --http-port 9105 \\
        --events tcp://127.0.0.1:5561 --node "$(hostname)" --secret-file /etc/kvstack/cache.secret

Lower tiers are searched in the order memory, disk, Redis, S3 (each only when configured). The S3 tier
(``--s3-bucket``, needs ``pip install 'kvstack[s3]'``) takes credentials from the usual AWS chain
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` or ``--s3-profile``, ``~/.aws``, a role);
S3 has no per-object TTL: bound it with the bucket's lifecycle rules.

The secret file holds the shared secret (surrounding whitespace ignored); clients need the same bytes.
SIGINT/SIGTERM stop it: queued lower-tier writes get up to ``--drain-timeout`` seconds to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from kvstack.cache.keys import DEFAULT_CHUNK_SIZE
from kvstack.cache.server import DEFAULT_BIND, CacheServer
from kvstack.cache.store import TieredStore
from kvstack.cache.tails import DEFAULT_TAIL_LIMIT
from kvstack.cache.tiers import DiskTier, MemoryTier, Tier

__all__ = ["add_cache_server_parser", "main", "run_cache_server"]

log = logging.getLogger(__name__)

_GB = 1 << 30


def add_cache_server_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cache-server",
        help="run the KV cache server (memory, disk, Redis, S3 tiers behind ZMQ)",
        description="Run the kvstack KV cache server.",
    )
    p.add_argument("--bind", default=DEFAULT_BIND, help="ZMQ endpoint (tcp://host:port or ipc://path)")
    p.add_argument(
        "--unix-socket",
        metavar="PATH",
        help="also listen on this unix socket: clients on this host reach it as unix://PATH, a shorter round "
        "trip than ZMQ (same messages; --secret-file applies too)",
    )
    p.add_argument("--memory-gb", type=float, default=1.0, help="memory tier budget in GiB")
    g = p.add_argument_group("lower tiers")
    g.add_argument("--disk-dir", help="directory of the disk tier (off when not given)")
    g.add_argument("--disk-gb", type=float, default=10.0, help="disk tier budget in GiB")
    g.add_argument("--disk-fsync", choices=["never", "data", "always"], default="never")
    g.add_argument(
        "--disk-inline-read-mib",
        type=float,
        default=16.0,
        help="per request, disk hits wholly in the page cache up to this many MiB are read on the event loop "
        "instead of the I/O threads (0: always the threads)",
    )
    g.add_argument(
        "--redis-url", help="Redis/Valkey tier, e.g. redis://127.0.0.1:6379/0 (off when not given)"
    )
    g.add_argument("--redis-prefix", default="kvstack:kv:")
    g.add_argument("--redis-ttl-s", type=float, default=3600.0, help="0: no expiry")
    g.add_argument(
        "--redis-timeout-s",
        type=float,
        default=0.5,
        help="a Redis call taking longer marks the tier down (keep it below the clients' timeout, 1 s)",
    )
    g.add_argument("--s3-bucket", help="S3 tier in this (existing) bucket, after Redis (off when not given)")
    g.add_argument("--s3-prefix", default="kvstack/kv/", help="object key prefix of the S3 tier")
    g.add_argument(
        "--s3-endpoint-url", help="an S3-compatible endpoint, e.g. http://10.0.0.9:9000 (default: AWS)"
    )
    g.add_argument("--s3-region", help="default: AWS_REGION / AWS_DEFAULT_REGION / the profile's region")
    g.add_argument("--s3-profile", help="named profile of ~/.aws/config for the S3 credentials")
    g.add_argument("--s3-addressing-style", choices=["auto", "path", "virtual"], default="auto")
    g.add_argument("--s3-concurrency", type=int, default=16, help="S3 requests in flight at most")
    g.add_argument("--write-queue", type=int, default=64, help="queued writes per lower tier before drops")
    p.add_argument(
        "--chunk-size",
        type=int,
        default=DEFAULT_CHUNK_SIZE,
        help=f"tokens per chunk: the connectors' chunk_size, the events' block_size ({DEFAULT_CHUNK_SIZE})",
    )
    p.add_argument(
        "--tail-index",
        type=int,
        default=DEFAULT_TAIL_LIMIT,
        help="prompts' partial last chunks indexed for lookups; least recently used dropped first "
        f"({DEFAULT_TAIL_LIMIT})",
    )
    p.add_argument("--node", help="this server's node name in events and stats (default: the hostname)")
    p.add_argument("--secret-file", help="file holding the shared secret clients must sign requests with")
    p.add_argument("--events", help="ZMQ PUB endpoint for admit/evict events, e.g. tcp://127.0.0.1:5561")
    p.add_argument("--events-replay", help="ZMQ ROUTER endpoint serving event replays")
    p.add_argument(
        "--http-port", type=int, help="serve /metrics and /health on this port (off when not given)"
    )
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--max-message-mb", type=float, default=256.0, help="largest request accepted, in MiB")
    p.add_argument("--drain-timeout", type=float, default=5.0)
    p.add_argument("--log-level", default="info")


def _tiers(args: argparse.Namespace) -> list[Tier]:
    tiers: list[Tier] = [MemoryTier(int(args.memory_gb * _GB))]
    if args.disk_dir:
        tiers.append(
            DiskTier(
                args.disk_dir,
                int(args.disk_gb * _GB),
                fsync=args.disk_fsync,
                inline_read_bytes=int(args.disk_inline_read_mib * (1 << 20)),
            )
        )
    if args.redis_url:
        from kvstack.cache.tiers.redis import RedisTier  # imports redis-py only when used

        ttl = args.redis_ttl_s if args.redis_ttl_s > 0 else None
        tiers.append(
            RedisTier(
                args.redis_url, prefix=args.redis_prefix, ttl_s=ttl, socket_timeout_s=args.redis_timeout_s
            )
        )
    if args.s3_bucket:
        try:
            from kvstack.cache.tiers.s3 import S3Tier  # imports aiobotocore only when used
        except ImportError as e:
            raise ValueError(f"--s3-bucket needs aiobotocore ({e}): pip install 'kvstack[s3]'") from e
        tiers.append(
            S3Tier(
                args.s3_bucket,
                prefix=args.s3_prefix,
                endpoint_url=args.s3_endpoint_url,
                region=args.s3_region,
                profile=args.s3_profile,
                addressing_style=args.s3_addressing_style,
                concurrency=args.s3_concurrency,
            )
        )
    return tiers


def _secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    secret = Path(path).read_bytes().strip()
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret


def run_cache_server(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO))
    try:
        if (
            args.memory_gb <= 0
            or args.disk_gb <= 0
            or args.chunk_size < 1
            or args.max_message_mb <= 0
            or args.tail_index < 1
        ):
            raise ValueError(
                "--memory-gb, --disk-gb, --chunk-size, --max-message-mb and --tail-index must be positive"
            )
        if not args.disk_inline_read_mib >= 0:  # NaN too
            raise ValueError("--disk-inline-read-mib must be >= 0")
        secret = _secret(args.secret_file)
        store = TieredStore(_tiers(args), write_queue_size=args.write_queue)
        server = CacheServer(
            store,
            args.bind,
            secret=secret,
            node=args.node,
            chunk_size=args.chunk_size,
            events_endpoint=args.events,
            events_replay_endpoint=args.events_replay,
            http_port=args.http_port,
            http_host=args.http_host,
            max_message_bytes=int(args.max_message_mb * (1 << 20)),
            unix_path=args.unix_socket,
            tail_limit=args.tail_index,
        )
    except (OSError, ValueError) as e:
        print(f"kvstack cache-server: {e}", file=sys.stderr)
        return 2

    async def serve() -> None:
        await store.start()
        try:
            await server.start()
            print(
                f"kvstack cache-server: node {server.node} on {server.endpoint}"
                + (f" and {server.unix_endpoint}" if server.unix_endpoint is not None else "")
                + (f", events {server.publisher.endpoint}" if server.publisher is not None else "")
                + (
                    f", metrics http://{args.http_host}:{server.http_port}/metrics"
                    if server.http_port
                    else ""
                ),
                flush=True,
            )
            await asyncio.Event().wait()
        finally:
            await server.stop()
            await store.stop(drain_timeout_s=args.drain_timeout)

    return _run(serve())


def _run(main: Any) -> int:
    async def wrapper() -> int:
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass
        except OSError as e:  # cannot bind: say so, without a traceback
            print(f"kvstack cache-server: {e}", file=sys.stderr)
            return 1
        return 0

    try:
        import uvloop

        return uvloop.run(wrapper())
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstack")
    sub = parser.add_subparsers(dest="command", required=True)
    add_cache_server_parser(sub)
    return run_cache_server(parser.parse_args(argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
