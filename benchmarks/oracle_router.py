"""The oracle of the KV-aware routing experiment: kvstack's router that knows what every engine caches.

It runs kvstack's router with the ``kv-aware`` load policy (the same saturation filter, scorers, weights and
picker; ``--routing`` takes another preset or YAML config to compare a tuned policy against its own oracle)
and KV events off, and replaces the prefix index with ``OracleSource``: for every request it asks each
routable candidate's ``POST /admin/prefix_match`` (a ``kvstack sim`` endpoint; vLLM has none) how many of the
prompt's tokens the engine holds right now, concurrently and with a short timeout, and hands the scheduler
``precise[url] = (n, n, n, n)`` (all of it in GPU blocks). An engine that does not answer in time is left
out of the view (it counts as holding nothing) and the miss is counted. Nothing is recorded after the
decision: the next request asks again.

So the oracle differs from kv-aware routing only in what it knows: no event lag, no missed or orphaned
events, evictions seen at once. A kv-aware hit rate close to the oracle's says the index is as good as
perfect knowledge under that load policy; a gap to a better load policy is not the index's fault.

    .venvs/dev/bin/python benchmarks/oracle_router.py --port 8090 --engine http://127.0.0.1:8000 \\
        --engine http://127.0.0.1:8001 --tokenizer .cache/tiny-model

It prints ``oracle router: http://HOST:PORT/v1 ...`` when it serves, and stops cleanly on SIGTERM or SIGINT,
printing its lookup counts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import uvloop

from kvstack.engines.discovery import parse_engine_spec
from kvstack.engines.state import EngineState
from kvstack.frontend.prefix import PrefixLookup
from kvstack.router.server import RouterOptions, running_router
from kvstack.scheduling.interfaces import PrefixView

log = logging.getLogger("oracle_router")

_decode = msgspec.json.Decoder().decode


@dataclass(slots=True)
class OracleStats:
    lookups: int = 0  # requests looked up
    asked: int = 0  # engine answers asked for
    failed: int = 0  # answers missing (timeout, refused, bad body): the engine counted as holding nothing
    hit_lookups: int = 0  # lookups where some engine held part of the prompt


class OracleSource:
    """A ``PrefixSource`` that asks the simulated engines what they hold, per request."""

    def __init__(self, session: aiohttp.ClientSession, *, timeout: float = 0.5) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.stats = OracleStats()
        self._warned: set[str] = set()

    async def find(
        self,
        token_ids: Sequence[int],
        candidates: Sequence[EngineState],
        now: float,
        *,
        model: str = "",
        cache_salt: str | None = None,
    ) -> PrefixLookup:
        """What each routable engine holds of ``token_ids`` now (the sims serve one model, unsalted)."""
        body = msgspec.json.encode({"token_ids": list(token_ids)})
        urls = [e.url for e in candidates if e.routable]
        answers = await asyncio.gather(*(self._cached_tokens(url, body) for url in urls))
        precise = {url: (n, n, n, n) for url, n in zip(urls, answers, strict=True) if n is not None}
        self.stats.lookups += 1
        self.stats.hit_lookups += any(t[0] for t in precise.values())
        return PrefixLookup(PrefixView(len(token_ids), precise, {}), [])

    def record(self, engine: str, lookup: PrefixLookup, now: float | None = None) -> None:
        """Nothing to remember: the next lookup asks the engines again."""

    async def _cached_tokens(self, url: str, body: bytes) -> int | None:
        self.stats.asked += 1
        try:
            async with self.session.post(
                f"{url}/admin/prefix_match",
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=self.timeout,
            ) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {payload[:200]!r}")
                return int(_decode(payload)["cached_tokens"])
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError, TypeError) as exc:
            self.stats.failed += 1
            if url not in self._warned:
                self._warned.add(url)
                log.warning(
                    "engine %s: POST /admin/prefix_match failed (%s); it counts as holding nothing for "
                    "this request (is it a kvstack sim?)",
                    url,
                    exc or type(exc).__name__,
                )
            return None


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Its own connections, so the oracle's questions never queue behind proxied streams.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        source = OracleSource(session, timeout=args.timeout)
        opts = RouterOptions(
            host=args.host,
            port=args.port,
            engines=[parse_engine_spec(spec) for spec in args.engine],
            routing=args.routing,
            tokenizers={"*": args.tokenizer},
            kv_events=False,
            prefix_source=source,
        )
        async with running_router(opts) as router:
            print(
                f"oracle router: {router.url}/v1 ({len(opts.engines)} engine(s), routing {args.routing!r}, "
                "prefix knowledge from POST /admin/prefix_match)",
                flush=True,
            )
            await stop.wait()
        s = source.stats
        print(
            f"oracle router: stopped; {s.lookups} lookups ({s.hit_lookups} with a hit), {s.asked} engine "
            f"answers asked, {s.failed} missing",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--engine", action="append", required=True, metavar="URL", help="repeat per engine")
    parser.add_argument("--tokenizer", required=True, metavar="DIR", help="the engines' tokenizer directory")
    parser.add_argument(
        "--routing", default="kv-aware", help="load policy: a preset or YAML config (default kv-aware)"
    )
    parser.add_argument("--timeout", type=float, default=0.5, help="seconds per /admin/prefix_match answer")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    if not (Path(args.tokenizer) / "tokenizer.json").is_file():
        parser.error(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING))
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
