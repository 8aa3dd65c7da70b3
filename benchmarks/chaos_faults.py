"""The faults the chaos benchmark injects under load, one function each, and what each measures.

Every fault runs `Load` through one router in front of two engines (the second, ``engines[1]``, is the one
hurt), and returns the load's `tally` plus its own numbers:

- ``engine-kill``: SIGKILL the engine's process group, restart it on the same ports after ``down_s``:
  seconds from restart to ``/health``, from healthy to the first request it serves through the router
  (its own /metrics; the rejoin time) and, for a router that follows KV events, to the first event batch
  the router applied from it again (the publisher restarted with the engine);
- ``slow-engine``: a first-token delay on the engine (sim): TTFT and the share of requests it served;
- ``engine-503``: the engine answers every generation with 503 (sim): what reaches the client;
- ``cache-server-kill``: SIGKILL the cache server the engines' connector uses, restart it (engines must
  compute instead and keep serving);
- ``redis-stop``: stop the cache server's Redis tier, start it again (the cache server must keep serving).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chaos_load import Load, tally
from chaos_setup import MODEL, Engine, Router, Service, kv_event_batches


@dataclass
class Stage:
    """A router running in front of engines, and how to load it."""

    router: Router
    url: str
    engines: list[Engine]
    users: int
    max_tokens: int
    deadline_s: float
    think_s: float
    seed: int

    def load(self) -> Load:
        return Load(self.url, MODEL, self.users, self.max_tokens, self.deadline_s, self.think_s, self.seed)


async def _poll(check: Callable[[], Any], budget_s: float, every_s: float = 0.1) -> float | None:
    """Seconds until ``check()`` (run in a thread: it blocks) is truthy; None past ``budget_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < budget_s:
        if await asyncio.to_thread(check):
            return round(time.monotonic() - t0, 2)
        await asyncio.sleep(every_s)
    return None


def _shares(engines: list[Engine], before: list[float]) -> list[float]:
    served = [e.served() - b for e, b in zip(engines, before, strict=True)]
    total = sum(served)
    return [round(s / total, 3) if total else 0.0 for s in served]


async def engine_kill(
    stage: Stage, warm_s: float, down_s: float, after_s: float, budget_s: float
) -> dict[str, Any]:
    victim = stage.engines[1]
    load = stage.load()
    load.start()
    await asyncio.sleep(warm_s)
    batches0 = (
        await asyncio.to_thread(kv_event_batches, stage.url, victim.url) if stage.router.kv_events else None
    )
    t_kill = time.monotonic()
    await asyncio.to_thread(victim.kill)
    await asyncio.sleep(down_s)
    await asyncio.to_thread(victim.start)
    t_restart = time.monotonic()
    healthy_s = await _poll(victim.healthy, budget_s, every_s=0.2)
    out: dict[str, Any] = {"down_s": down_s, "restart_to_healthy_s": healthy_s}
    if healthy_s is not None:
        t_healthy = time.monotonic()
        checks: dict[str, Callable[[], Any]] = {"rejoin_s": lambda: victim.served() > 0}
        if stage.router.kv_events:
            checks["kv_events_resumed_s"] = lambda: (
                (kv_event_batches(stage.url, victim.url) or 0) > (batches0 or 0)
            )
        found = await asyncio.gather(*(_poll(check, 60.0) for check in checks.values()))
        out.update(zip(checks, found, strict=True))
        down = load.since(t_kill)
        out["requests_while_down"] = len([r for r in down if r.started < t_healthy])
        out["failed_while_down"] = len([r for r in down if r.started < t_healthy and r.outcome != "ok"])
        out["healthy_at_s"] = round(t_healthy - t_kill, 2)
    out["restarted_at_s"] = round(t_restart - t_kill, 2)
    await asyncio.sleep(after_s)
    await load.stop()
    return {**tally(load.requests), **out}


async def with_faults(stage: Stage, faults: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Load for ``seconds`` while the second engine (a sim) has ``faults``; shares of requests served."""
    before = await asyncio.to_thread(lambda: [e.served() for e in stage.engines])
    await asyncio.to_thread(stage.engines[1].set_faults, faults)
    load = stage.load()
    load.start()
    try:
        await asyncio.sleep(seconds)
        await load.stop()
    finally:
        await asyncio.to_thread(stage.engines[1].set_faults, None)
    shares = await asyncio.to_thread(_shares, stage.engines, before)
    return {**tally(load.requests), "faults": faults, "faulty_engine_share": shares[1]}


async def service_restart(
    stage: Stage, service: Service, *, kill: bool, before_s: float, down_s: float, after_s: float
) -> dict[str, Any]:
    """Load while ``service`` goes down (SIGKILL, or SIGTERM with ``kill`` false) and comes back."""
    load = stage.load()
    load.start()
    await asyncio.sleep(before_s)
    await asyncio.to_thread(service.kill if kill else service.stop)
    await asyncio.sleep(down_s)
    await asyncio.to_thread(service.start)
    back_s = await _poll(service.answers, 30.0)
    await asyncio.sleep(after_s)
    await load.stop()
    alive = {e.name: e.exited() is None for e in stage.engines}
    return {**tally(load.requests), "down_s": down_s, "service_back_s": back_s, "engines_alive": alive}
