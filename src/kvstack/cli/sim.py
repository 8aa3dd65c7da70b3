"""``kvstack sim``: simulated vLLM engines, built from flags (served by kvstack.sim.cluster)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

from kvstack.sim.kv_connector import DEFAULT_CHUNK_SIZE


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def run(args: argparse.Namespace) -> int:
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
