"""Soak: a long run of mixed OpenAI load through both kvstack front ends over faulty simulated engines.

Three ``kvstack sim`` processes (standing faults: 2% errors 429/500/503, 2% streams dropped after 2 chunks,
0.3% hangs; a KV cache server as their connector) serve ``kvstack router`` and ``kvstack epp`` behind real
Envoy at once. Users of the real ``openai`` client (no retries) send chat and completions, streaming and
not, closing some streams early (``soak_load``). Every ``--restart-every`` seconds one engine is SIGKILLed
and started again on its ports; in between, fault bursts (503s, slow first tokens, drops, hangs) hit one
engine for a while. The router, the picker, Envoy and the cache server are sampled from /proc
(``soak_sampler``); after the load the in-flight gauges must return to 0 and the verdict (``soak_report``)
asks that every request be accounted for and nothing leak. Writes ``soak.json`` and ``soak.png`` to
``--out``; exits 1 when the verdict fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
from machine_info import machine
from procs import REPO
from results import git_state, write_json
from soak_load import Tally, drive
from soak_report import accounting_verdict, leak_verdict, plot, table
from soak_sampler import front_counters, group_sample
from soak_stack import BASE_FAULTS, BURSTS, Stack, start_stack


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--minutes", type=float, default=30.0, help="load duration (default 30)")
    p.add_argument("--users", type=int, default=6, help="concurrent users per front end")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=10.0, help="the sims' speed-up")
    p.add_argument("--restart-every", type=float, default=None, help="seconds (default: minutes*60/30, ≥ 15)")
    p.add_argument("--sample-every", type=float, default=None, help="seconds (default: minutes*60/300, ≥ 1)")
    p.add_argument("--warmup", type=float, default=0.1, help="share of the run before leak baselines")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds before a request counts as hung")
    p.add_argument("--rss-pct", type=float, default=10.0)
    p.add_argument("--rss-slack-mib", type=float, default=0.0, help="absolute RSS slack (short runs)")
    p.add_argument("--count-slack", type=int, default=4, help="fds/sockets slack")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--logs", type=Path, default=None, help="keep the processes' logs here (default: dropped)")
    p.add_argument("--from-json", type=Path, default=None, help="judge a saved soak.json again (no run)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "soak")
    return p.parse_args(argv)


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        return front_counters(await r.text())


class Soak:
    def __init__(self, args: argparse.Namespace, stack: Stack) -> None:
        self.args = args
        self.stack = stack
        self.t0 = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self.restarts: list[float] = []
        self.bursts: list[dict[str, Any]] = []
        self.watched = stack.watched()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def sample(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        s: dict[str, Any] = {"t": round(self.now(), 2), "procs": {}, "in_flight": {}}
        for name, pgid in self.watched.items():
            s["procs"][name] = group_sample(pgid)
        for name, url in (("router", self.stack.router_url), ("epp", self.stack.epp_url)):
            try:
                s["in_flight"][name] = (await _metrics(http, url))["in_flight"]
            except (aiohttp.ClientError, TimeoutError):
                s["in_flight"][name] = None
        return s

    async def sampler(self, http: aiohttp.ClientSession, stop: asyncio.Event, every: float) -> None:
        while not stop.is_set():
            self.samples.append(await self.sample(http))
            await asyncio.sleep(every)

    async def chaos(self, http: aiohttp.ClientSession, stop: asyncio.Event, every: float) -> None:
        """Alternate: a fault burst on one engine for a third of the period, then SIGKILL + restart of one."""
        rng = random.Random(self.args.seed)
        i = 0
        while not stop.is_set():
            engine = self.stack.engines[i % len(self.stack.engines)]
            name = rng.choice(sorted(BURSTS))
            await asyncio.sleep(every / 3)
            if stop.is_set():
                break
            with _suppress_http():
                await http.post(f"{engine.url}/admin/faults", json=BURSTS[name])
            self.bursts.append({"t": round(self.now(), 1), "engine": engine.index, "burst": name})
            await asyncio.sleep(every / 3)
            with _suppress_http():
                await http.post(f"{engine.url}/admin/faults", json=BASE_FAULTS)
            await asyncio.sleep(every / 3)
            if stop.is_set():
                break
            victim = self.stack.engines[(i + 1) % len(self.stack.engines)]
            self.restarts.append(round(self.now(), 1))
            await asyncio.to_thread(victim.kill)
            await asyncio.sleep(rng.uniform(0.5, 2.0))
            await asyncio.to_thread(victim.start)
            i += 1


class _suppress_http:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], aiohttp.ClientError | TimeoutError)  # type: ignore[arg-type]


async def run(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    seconds = args.minutes * 60
    restart_every = args.restart_every or max(15.0, seconds / 30)
    sample_every = args.sample_every or max(1.0, seconds / 300)
    soak = Soak(args, stack)
    tallies = {"router": Tally(), "envoy": Tally()}
    urls = {"router": stack.router_url, "envoy": stack.envoy_url}
    async with aiohttp.ClientSession() as http:
        baseline = await soak.sample(http)
        load_stop, chaos_stop, sampling_stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
        sampling = asyncio.create_task(soak.sampler(http, sampling_stop, sample_every))
        chaos = asyncio.create_task(soak.chaos(http, chaos_stop, restart_every))
        drivers = [
            asyncio.create_task(
                drive(
                    f"{urls[f]}/v1",
                    load_stop,
                    tallies[f],
                    concurrency=args.users,
                    seed=args.seed + k,
                    deadline_s=args.deadline,
                )
            )
            for k, f in enumerate(tallies)
        ]
        load_start = soak.now()
        await asyncio.sleep(seconds)
        chaos_stop.set()
        await chaos  # a restart under way completes: every engine serves when the load ends
        load_stop.set()
        # Users finish the request they are in; each is bounded by the deadline.
        await asyncio.wait_for(asyncio.gather(*drivers), timeout=args.deadline + 30)
        load_end = soak.now()
        sampling_stop.set()
        await sampling
        # Idle: in-flight back to 0, then a last sample.
        settle_deadline = time.monotonic() + 30
        counters: dict[str, Any] = {}
        while time.monotonic() < settle_deadline:
            counters = {
                "router": await _metrics(http, stack.router_url),
                "envoy": await _metrics(http, stack.epp_url),
            }
            if all(c["in_flight"] == 0 for c in counters.values()):
                break
            await asyncio.sleep(1)
        await asyncio.sleep(5)
        idle = await soak.sample(http)
        counters = {
            "router": await _metrics(http, stack.router_url),
            "envoy": await _metrics(http, stack.epp_url),
        }
    return {
        "minutes": args.minutes,
        "restart_every_s": restart_every,
        "sample_every_s": sample_every,
        "load_start_s": load_start,
        "load_end_s": load_end,
        "watched": list(soak.watched),
        "fronts": {f: {"client": tallies[f].as_json(), "counters": counters[f]} for f in tallies},
        "restarts_s": soak.restarts,
        "bursts": soak.bursts,
        "baseline": baseline,
        "idle": idle,
        "samples": soak.samples,
    }


def judge(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The verdict on a run's facts, with this command line's bounds (also for a saved run: --from-json)."""
    start, end = result["load_start_s"], result["load_end_s"]
    result["warmup_end_s"] = start + args.warmup * (end - start)
    result["bounds"] = {k: getattr(args, k) for k in ("warmup", "rss_pct", "rss_slack_mib", "count_slack")}
    for f, front in result["fronts"].items():
        front["accounting"] = accounting_verdict(f, front["client"], front["counters"])
    result["leaks"] = leak_verdict(
        result["samples"],
        result["idle"],
        warmup_end=result["warmup_end_s"],
        load_end=end,
        edge=max(0.05 * (end - start), 2 * result["sample_every_s"]),
        rss_pct=args.rss_pct,
        rss_slack_mib=args.rss_slack_mib,
        count_slack=args.count_slack,
    )
    result["ok"] = all(f["accounting"]["ok"] for f in result["fronts"].values()) and all(
        v["ok"] for v in result["leaks"].values()
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a test's timeout) unwinds like Ctrl-C, so that the processes started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = shlex.join([".venvs/dev/bin/python", "benchmarks/soak.py", *(argv or sys.argv[1:])])
    started = datetime.now(UTC).isoformat(timespec="seconds")
    info = machine() if args.from_json is None else {}
    if args.from_json is not None:
        result = judge(json.loads(args.from_json.read_text()), args)
    else:
        with tempfile.TemporaryDirectory(prefix="kvstack-soak-") as tmp:
            workdir = args.logs or Path(tmp)
            stack = start_stack(workdir, args.engines, args.time_scale)
            try:
                facts = asyncio.run(run(args, stack))
            finally:
                stack.stop()
            facts["problems_in_logs"] = _log_problems(workdir / "logs")
        facts = {"command": command, "started": started, "machine": info, "git": git_state(), **facts}
        result = judge(facts, args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "soak.json", result)
    plot(result, args.out / "soak.png")
    print(table(result))
    for f, v in result["fronts"].items():
        for problem in v["accounting"]["problems"]:
            print(f"{f}: {problem}")
    print(f"{'PASS' if result['ok'] else 'FAIL'}: {args.out / 'soak.json'}\n{command}")
    return 0 if result["ok"] else 1


def _log_problems(logs: Path) -> dict[str, list[str]]:
    """Tracebacks and unexpected errors the kvstack processes logged (first few lines each)."""
    out: dict[str, list[str]] = {}
    for name in ("router", "epp", "cache-server"):
        path = logs / f"{name}.log"
        if not path.exists():
            continue
        text = path.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if "Traceback" in ln or "ERROR" in ln]
        out[name] = lines[:20] + ([f"... {len(lines) - 20} more"] if len(lines) > 20 else [])
    return out


if __name__ == "__main__":
    sys.exit(main())
