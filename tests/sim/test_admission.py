"""The simulator's queue limit (vLLM's --max-num-queued-reqs): 503 beyond it, counted, nothing lost."""

from __future__ import annotations

import asyncio

import aiohttp

from kvstack.engines.tokenizer import load_tokenizer
from kvstack.sim.cluster import SimOptions, start_engine, stop_engine
from kvstack.sim.engine import EngineConfig
from kvstack.sim.textgen import OutputSampler
from support.metrics import counter_totals


async def test_requests_beyond_the_queue_limit_get_503_and_are_counted() -> None:
    tok = load_tokenizer(None)
    cfg = EngineConfig(model_name="m", max_num_queued_reqs=4, max_num_seqs=2, time_scale=5.0)
    opts = SimOptions(engine=cfg, served_model_names=["m"], model_root="m", port=0, kv_events=False)
    running = await start_engine(opts, tok, OutputSampler(tok), 0)
    try:
        async with aiohttp.ClientSession() as http:

            async def one() -> int:
                body = {"model": "m", "prompt": "hello there", "max_tokens": 30, "ignore_eos": True}
                async with http.post(f"{running.url}/v1/completions", json=body) as r:
                    payload = await r.json()
                    if r.status == 503:
                        assert payload["error"]["type"] == "Service Unavailable"
                        assert "busy" in payload["error"]["message"]
                    else:
                        assert payload["usage"]["completion_tokens"] == 30
                    return r.status

            statuses = await asyncio.gather(*(one() for _ in range(10)))
            assert statuses.count(200) == 4 and statuses.count(503) == 6
            # Capacity comes back once the admitted requests finish.
            assert await one() == 200
            async with http.get(f"{running.url}/metrics") as r:
                text = await r.text()
        rejections = counter_totals(text, "vllm:admission_rejections", "reason")
        assert rejections == {("max_num_queued_reqs",): 6.0, ("max_num_queued_tokens",): 0.0}
    finally:
        await stop_engine(running)
