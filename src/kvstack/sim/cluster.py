"""Run one or many simulated engines in this process, each with its own port, metrics and event stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field, replace

from aiohttp import web

from kvstack.engines.tokenizer import Tokenizer
from kvstack.kvevents.publisher import KVEventPublisher
from kvstack.sim.engine import EngineConfig, SimEngine
from kvstack.sim.faults import FaultConfig
from kvstack.sim.kv_connector import CacheTierConfig, CacheTierConnector
from kvstack.sim.server import ServerConfig, SimServer
from kvstack.sim.textgen import OutputSampler

log = logging.getLogger(__name__)


@dataclass
class SimOptions:
    """Everything ``kvstack sim`` needs; engine i listens on ``port + i`` (0 = any free port)."""

    engine: EngineConfig
    served_model_names: list[str]
    model_root: str
    host: str = "127.0.0.1"
    port: int = 8000
    engines: int = 1
    kv_events: bool = True
    # Engine i publishes on ``kv_events_port + i`` (0 = any free port); replay on ``replay_port + i``.
    kv_events_port: int = 0
    replay: bool = False
    replay_port: int = 0
    legacy_event_encoding: bool = False
    enable_prompt_tokens_details: bool = False
    kv_hold_timeout: float = 30.0
    faults: FaultConfig = field(default_factory=FaultConfig)
    # The KV cache tier every engine loads prompt chunks from and saves them to (None: no connector).
    cache_tier: CacheTierConfig | None = None


@dataclass
class RunningEngine:
    index: int
    url: str
    engine: SimEngine
    server: SimServer
    publisher: KVEventPublisher | None
    runner: web.AppRunner
    connector: CacheTierConnector | None = None

    @property
    def events_endpoint(self) -> str | None:
        return self.publisher.endpoint if self.publisher else None


def _offset(port: int, i: int) -> int:
    return port + i if port else 0


async def start_engine(
    opts: SimOptions, tokenizer: Tokenizer, sampler: OutputSampler, i: int
) -> RunningEngine:
    """Start engine ``i``: publisher, engine loop and HTTP site."""
    publisher = None
    events_cfg = None
    if opts.kv_events:
        endpoint = f"tcp://{opts.host}:{_offset(opts.kv_events_port, i)}"
        replay = f"tcp://{opts.host}:{_offset(opts.replay_port, i)}" if opts.replay else None
        # Rank 0, as a single vLLM engine stamps its batches.
        publisher = KVEventPublisher(
            endpoint, replay_endpoint=replay, legacy_array=opts.legacy_event_encoding, data_parallel_rank=0
        )
        await publisher.start()
        # Advertise a wildcard host, as vLLM does; consumers substitute the engine's address.
        events_cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{publisher.port}",
            "replay_endpoint": f"tcp://*:{publisher.replay_port}" if publisher.replay_port else None,
            "buffer_steps": 10000,
            "hwm": 100000,
            "max_queue_size": 100000,
            "topic": "",
        }
    engine_cfg = replace(opts.engine, seed=opts.engine.seed)
    connector = None if opts.cache_tier is None else CacheTierConnector(opts.cache_tier, name=f"sim-{i}")
    engine = SimEngine(
        engine_cfg, sampler, events=publisher, eos_token_id=tokenizer.eos_token_id, connector=connector
    )
    server_cfg = ServerConfig(
        served_model_names=opts.served_model_names,
        model_root=opts.model_root,
        max_model_len=engine_cfg.max_model_len,
        enable_prompt_tokens_details=opts.enable_prompt_tokens_details,
        kv_events_config=events_cfg,
        engine_id=f"sim-{i}",
        advertise_host=opts.host,
        faults=opts.faults,
        kv_hold_timeout=opts.kv_hold_timeout,
        fault_seed=engine_cfg.seed + i,
    )
    server = SimServer(engine, tokenizer, server_cfg)
    # handler_cancellation: a client that goes away cancels its handler, which aborts the engine request
    # (as vLLM aborts on disconnect) and lets hung-fault handlers end.
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, opts.host, _offset(opts.port, i), backlog=2048, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        if connector is not None:
            await connector.aclose()
        if publisher is not None:
            await publisher.close()
        raise
    port = runner.addresses[0][1]
    server.config.advertise_port = port
    return RunningEngine(i, f"http://{opts.host}:{port}", engine, server, publisher, runner, connector)


async def stop_engine(running: RunningEngine) -> None:
    await running.runner.cleanup()
    if running.connector is not None:
        await running.connector.aclose()
    if running.publisher is not None:
        await running.publisher.close()


async def serve(
    opts: SimOptions, tokenizer: Tokenizer, *, ready: asyncio.Future[list[RunningEngine]] | None = None
) -> None:
    """Start ``opts.engines`` engines and serve until cancelled."""
    sampler = OutputSampler(tokenizer, seed=opts.engine.seed, mean_output_len=opts.engine.mean_output_len)
    started: list[RunningEngine] = []
    try:
        for i in range(opts.engines):
            started.append(await start_engine(opts, tokenizer, sampler, i))
        if ready is not None:
            ready.set_result(started)
        await asyncio.Event().wait()
    finally:
        for running in started:
            with contextlib.suppress(Exception):
                await stop_engine(running)
