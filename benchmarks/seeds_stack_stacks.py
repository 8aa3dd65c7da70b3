"""The two stacks of seeds_stack.py over two fresh vLLM engines each, and one QA run through a stack.

A `Setup` is one row: ``kvstack`` (``kvstack router --routing kv-aware`` reading the engines' KV events and
the cache server's chunk events, ``kvstack cache-server``, ``KVStackConnector`` in ``.venvs/vllm``) or
``seeds`` (production-stack's router, ``--routing-logic session --session-key <header>`` over static
discovery, LMCache 0.5.6's ``lmcache server`` and ``LMCacheMPConnector`` in ``.venvs/lmcache``), with its
levers: the kvstack connector's chunk size, the engines' KV blocks, session affinity added to kv-aware
(``kv_aware_with``). Both stacks' engines get the same command but for ``--kv-transfer-config``
(both publish KV events; only kvstack's router reads them).

``ensure_production_stack`` makes ``.venvs/production-stack`` (the router's ``requirements.txt`` from PyPI;
its source from ``--production-stack-src``: it is not on PyPI, whose ``vllm-router`` is the Rust router).
``run_setup`` starts a setup, warms each engine up directly, then runs the workload through the front with
the session header and sums it up (``qa_summary``); every process it starts is stopped when it returns.
"""

from __future__ import annotations

import asyncio
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from connector_ttft_engines import (
    LMCACHE_ENV,
    VLLM_PYTHON,
    BenchError,
    Busy,
    Config,
    Engine,
    Processes,
    delta,
    kvstack_cache_server,
    kvstack_transfer,
    lmcache_server,
    log_tail,
    random_prompt,
    read_metrics,
    start_engines,
    stream_completion,
    vllm_command,
    vllm_env,
    wait_http,
)
from connector_ttft_qa import qa_summary, wait_router
from procs import HOST, KVSTACK, OFFLINE, REPO, free_port
from seeds_stack_report import by_round, moves

from kvstack.bench import BenchConfig, MultiRoundQA, run_bench, write_report
from kvstack.cache.keys import DEFAULT_CHUNK_SIZE
from kvstack.scheduling.presets import PRESETS

PS_VENV = REPO / ".venvs" / "production-stack"
PS_REQUIREMENTS = Path("src") / "vllm_router" / "requirements.txt"
MODEL = "qa"


@dataclass(frozen=True)
class Setup:
    """One row of the run: a stack and its levers."""

    label: str
    stack: str  # kvstack | seeds
    blocks: int
    chunk: int = (
        DEFAULT_CHUNK_SIZE  # the tier's chunk: kvstack's connector + cache server, or LMCache's server
    )
    connector: tuple[tuple[str, Any], ...] = ()  # kvstack: more kv_connector_extra_config keys
    session_weight: int = 0  # kvstack: session-affinity-scorer on the session header added to kv-aware
    tier_weight: float | None = None  # kvstack: the precise prefix scorer's cpuWeight (None: the preset's)
    lever: str | None = None  # what this row changes against its stack's base row


@dataclass
class Front:
    """A started stack: where the client sends, the engines behind it, the command lines."""

    url: str
    engines: list[Engine]
    commands: dict[str, Any]


# -- production-stack's router ----------------------------------------------------------------------------
def production_stack_root(src: Path) -> Path:
    """The directory holding ``src/vllm_router`` (given that directory or its ``src``)."""
    for root in (src, src.parent):
        if (root / PS_REQUIREMENTS).is_file():
            return root
    raise BenchError(
        f"{src}: no {PS_REQUIREMENTS} there; give --production-stack-src a checkout of "
        "vllm-project/production-stack (or `git --git-dir=<mirror> archive HEAD src | tar -x -C DIR`)"
    )


def ensure_production_stack(src: Path, say: Callable[[str], None], allow_install: bool) -> Path:
    """``.venvs/production-stack``'s python with the router's requirements; the router runs from ``src``."""
    root = production_stack_root(src)
    python = PS_VENV / "bin" / "python"
    probe = [str(python), "-c", "import vllm_router.app"]
    env = {"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"}

    def imports() -> bool:
        try:
            return subprocess.run(probe, capture_output=True, env=env, timeout=120).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    if python.exists() and imports():
        return python
    if not allow_install:
        raise BenchError(f"{PS_VENV} cannot import vllm_router from {root / 'src'}; run without --no-install")
    say(f"installing production-stack's router requirements ({root / PS_REQUIREMENTS}) into {PS_VENV} (pip)")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PS_VENV)], check=True, timeout=300)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-r", str(root / PS_REQUIREMENTS)], check=True, timeout=900)
    if not imports():
        raise BenchError(f"{PS_VENV}: pip finished but vllm_router.app does not import from {root / 'src'}")
    return python


def source_commit(root: Path) -> str | None:
    """The commit of a production-stack checkout, when it is one."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


# -- the stacks -------------------------------------------------------------------------------------------
def kv_aware_with(session_weight: int = 0, tier_weight: float | None = None) -> str:
    """The kv-aware preset's YAML with session-affinity-scorer added at ``session_weight`` (a conversation
    stays on its engine when the prefix scores, weight 3, and load do not tell the engines apart by more)
    and the precise prefix scorer's ``cpuWeight`` (a tier hit's worth against a GPU hit's) at
    ``tier_weight``."""
    text = PRESETS["kv-aware"]
    picker, ref = "- type: max-score-picker\n", "  - pluginRef: max-score-picker\n"
    prefix = "- type: precise-prefix-scorer\n"
    if text.count(picker) != 1 or text.count(ref) != 1 or text.count(prefix) != 1:
        raise BenchError("the kv-aware preset changed shape: update seeds_stack_stacks.kv_aware_with")
    if session_weight:
        text = text.replace(picker, "- type: session-affinity-scorer\n" + picker)
        text = text.replace(
            ref, f"  - pluginRef: session-affinity-scorer\n    weight: {session_weight}\n" + ref
        )
    if tier_weight is not None:
        text = text.replace(prefix, f"{prefix}  parameters:\n    cpuWeight: {tier_weight}\n")
    return text


def _engines(
    procs: Processes,
    setup: Setup,
    cfg: Config,
    model: Path,
    python: Path,
    transfer: dict[str, Any],
    env: dict[str, str] | None = None,
) -> list[Engine]:
    ports = [free_port(), free_port()]
    specs = [
        (
            f"{setup.label}-{name}",
            vllm_command(
                python,
                model,
                MODEL,
                port,
                cfg,
                blocks=setup.blocks,
                kv_transfer=transfer,
                kv_events_port=free_port(),
            ),
            vllm_env(env),
        )
        for name, port in zip("AB", ports, strict=True)
    ]
    return start_engines(procs, specs, ports, cfg)


def start_kvstack(procs: Processes, setup: Setup, cfg: Config, model: Path, work: Path, header: str) -> Front:
    node = "bench"
    ev, replay = free_port(), free_port()
    _, endpoint, server_cmd = kvstack_cache_server(
        procs, f"{setup.label}-cache-server", cfg, events=(ev, replay), node=node, chunk=setup.chunk
    )
    transfer = kvstack_transfer(endpoint, f"{MODEL}-{cfg.weights}", setup.chunk)
    transfer["kv_connector_extra_config"].update(setup.connector)
    engines = _engines(procs, setup, cfg, model, VLLM_PYTHON, transfer)
    port = free_port()
    routing = "kv-aware"
    if setup.session_weight or setup.tier_weight is not None:
        (config := work / f"{setup.label}-routing.yaml").write_text(
            kv_aware_with(setup.session_weight, setup.tier_weight)
        )
        routing = str(config)
    cmd = [str(KVSTACK), "router", "--host", HOST, "--port", str(port), "--routing", routing]
    if setup.session_weight:
        cmd += ["--session-header", header]
    for e in engines:
        cmd += ["--engine", f"{e.url}#node={node}"]
    cmd += ["--tokenizer", str(model), "--log-level", "warning"]
    cmd += ["--cache-events", f"tcp://{HOST}:{ev}#node={node},replay=tcp://{HOST}:{replay}"]
    router = procs.start(f"{setup.label}-router", cmd)
    url = f"http://{HOST}:{port}"
    wait_router(url, len(engines), router)
    return Front(url, engines, {"router": shlex.join(cmd), "tier": server_cmd})


def start_seeds(
    procs: Processes,
    setup: Setup,
    cfg: Config,
    model: Path,
    lmcache_python: Path,
    ps_python: Path,
    ps_root: Path,
    header: str,
) -> Front:
    transfer, server_cmd = lmcache_server(
        procs, f"{setup.label}-lmcache-server", cfg, lmcache_python, chunk=setup.chunk
    )
    engines = _engines(procs, setup, cfg, model, lmcache_python, transfer, LMCACHE_ENV)
    port = free_port()
    cmd = [str(ps_python), "-m", "vllm_router.app", "--host", HOST, "--port", str(port)]
    cmd += ["--service-discovery", "static", "--static-backends", ",".join(e.url for e in engines)]
    cmd += ["--static-models", ",".join(MODEL for _ in engines)]
    cmd += ["--routing-logic", "session", "--session-key", header, "--log-level", "warning"]
    router = procs.start(f"{setup.label}-router", cmd, env={"PYTHONPATH": str(ps_root / "src"), **OFFLINE})
    url = f"http://{HOST}:{port}"
    wait_http(url, "/v1/models", router, 120)
    command = f"PYTHONPATH={shlex.quote(str(ps_root / 'src'))} {shlex.join(cmd)}"
    return Front(url, engines, {"router": command, "tier": server_cmd})


# -- one run through a stack ------------------------------------------------------------------------------
def warm_up(engines: list[Engine], cfg: Config, seed: int) -> list[float | None]:
    """One short request straight to each engine (first requests pay one-off costs); shorter than a chunk,
    so nothing of it reaches a tier, and unlike the workload's text."""
    rng = random.Random(seed)
    ttfts = []
    for e in engines:
        answer = stream_completion(e.url, MODEL, random_prompt(rng, 96), 2, cfg.request_timeout_s)
        if answer.error:
            raise BenchError(f"warm-up request to {e.url}: {answer.error}\n{log_tail(e.group)}")
        ttfts.append(answer.ttft_s)
    return ttfts


def run_setup(
    setup: Setup,
    start: Callable[[], Front],
    procs: Processes,
    cfg: Config,
    workload: MultiRoundQA,
    header: str,
    out_dir: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    info: dict[str, Any] = {"setup": asdict(setup)}
    try:
        t0 = time.monotonic()
        front = start()
        info["startup_s"] = round(time.monotonic() - t0, 1)
        info["commands"] = {**front.commands, "engines": [e.command for e in front.engines]}
        info["warm_up_ttft_s"] = warm_up(front.engines, cfg, cfg.seed)
        say(f"{setup.label}: engines {[e.url for e in front.engines]} behind {front.url}")
        before = [read_metrics(e.url) for e in front.engines]
        config = BenchConfig(
            url=front.url,
            model=MODEL,
            workload=workload,
            api="chat",
            max_concurrency=16,
            request_timeout=cfg.request_timeout_s,
            engine_metrics=tuple(e.url for e in front.engines),
            session_header=header,
            label=setup.label,
        )
        busy = Busy(lambda: procs.groups)
        result = asyncio.run(run_bench(config))
        info["machine"] = busy.result()
        time.sleep(0.5)
        after = [read_metrics(e.url) for e in front.engines]
        write_report(result, out_dir / setup.label)
        per_engine = [delta(b, a) for b, a in zip(before, after, strict=True)]
        info["engines"] = [{"url": e.url, **d} for e, d in zip(front.engines, per_engine, strict=True)]
        info["summary"] = qa_summary(per_engine, result)
        usage = [(r.round, r.prompt_tokens, r.cached_tokens) for r in result.records if r.ok]
        info["summary"]["by_round"] = by_round(usage)
        served = [
            (r.session, r.round, r.engine, r.prompt_tokens, r.cached_tokens) for r in result.records if r.ok
        ]
        info["summary"]["moves"] = moves(served)
        lengths = [r.prompt_tokens for r in result.records if r.prompt_tokens]
        info["summary"]["prompt_tokens_min_max"] = [min(lengths), max(lengths)] if lengths else None
        info["log_tails"] = {g.name: log_tail(g, 2000) for g in procs.groups}
    finally:
        procs.stop_all()
    return info
