"""Fixtures of the connector tests that run in the vLLM virtualenv: the tiny model with seeded random
weights (``model_dir``, once per session), a ``kvstack cache-server`` process per module (chunks of
``CHUNK`` tokens, KV events with replay, a unix socket too), and ``run_hand_built``, which runs a script in
the vLLM environment against it after ``HAND_BUILT``, a prelude that builds the connector's halves by hand."""

from __future__ import annotations

import os
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.cache import CacheServerProcess, start_cache_server
from support.connector import write_weighted_model
from support.engines import REPO, require_vllm, vllm_python
from support.waiting import wait_until

CHUNK = 256  # tokens per chunk on the cache_server fixture


def require_connector_deps() -> None:
    """vLLM imports the connector in its own environment: the cache client's dependencies must be there."""
    require_vllm()
    probe = "import blake3, msgspec, xxhash, zmq"
    run = subprocess.run([str(vllm_python()), "-c", probe], capture_output=True, text=True)
    if run.returncode != 0:
        pytest.fail(
            f"the vLLM environment cannot import the connector's dependencies ({run.stderr.strip()[-200:]}); "
            f"run `{vllm_python().parent / 'pip'} install --no-deps -e . xxhash`"
        )


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with seeded random weights (``support.connector``)."""
    require_vllm()
    return write_weighted_model(tiny_model_dir, tmp_path_factory.mktemp("weighted") / "model")


@pytest.fixture(scope="module")
def cache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServerProcess]:
    """A ``kvstack cache-server`` process for a module's tests; stopped after them."""
    require_connector_deps()
    workdir = tmp_path_factory.mktemp("cache-server")
    options = ["--memory-gb", "0.25", "--chunk-size", str(CHUNK)]
    server = start_cache_server(workdir, *options, unix_socket=workdir / "cache.sock", events=True)
    client = server.client()
    try:

        def serving() -> bool:
            assert server.proc.poll() is None, server.log()
            return client.server_stats() is not None

        wait_until(serving, what="the cache server answering", timeout_s=30, interval_s=0.2)
    finally:
        client.close()
    yield server
    server.stop()


HAND_BUILT = textwrap.dedent(
    """
    import logging, sys, time
    from types import SimpleNamespace as NS
    import torch
    import vllm.distributed.parallel_state as parallel_state
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    import kvstack.connector.vllm_v1 as vllm_v1
    from kvstack.connector import PAGED_LAYOUT, AttentionShape, block_layout_name, kv_layout
    from kvstack.connector.vllm_v1 import KVStackConnector, KVStackLayoutReport

    # No engine in this process: no process group (rank 0), and no attention layers in vLLM's forward
    # context, so the backend a worker finds there is given (BACKEND[0]).
    parallel_state.get_tensor_model_parallel_rank = lambda: 0
    BACKEND = ["CPU_ATTN"]
    vllm_v1.layer_backends = lambda vllm_config, names: {name: BACKEND[0] for name in names}
    LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    FULL = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    SHAPE = AttentionShape(2, 2, 64, "bfloat16", 128)
    CPU_LAYOUT = block_layout_name(PAGED_LAYOUT, platform="cpu", backend="CPU_ATTN", block_size=128)
    LOG = []  # the connector's log lines

    class Kept(logging.Handler):
        def emit(self, record):
            LOG.append(record.getMessage())

    logging.getLogger("vllm.kvstack.connector").addHandler(Kept())
    logging.getLogger("vllm.kvstack.connector").setLevel(logging.INFO)

    def connector(role, spec=FULL, server=sys.argv[1], tp_size=1, **extra):
        transfer = KVTransferConfig(
            kv_connector="KVStackConnector",
            kv_connector_module_path="kvstack.connector.vllm_v1",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"server": server, "model_id": "hand-built", "timeout_s": 0.5, **extra},
        )
        vllm_config = NS(
            kv_transfer_config=transfer,
            cache_config=NS(block_size=128),
            model_config=NS(model="/models/x", served_model_name="x"),
            parallel_config=NS(
                tensor_parallel_size=tp_size, pipeline_parallel_size=1, decode_context_parallel_size=1
            ),
        )
        return KVStackConnector(vllm_config, role, NS(kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)]))

    def request(rid, seed, n=600):
        tokens = [(seed * 7919 + i * 104729) % 4000 + 3 for i in range(n)]
        return NS(
            request_id=rid, prompt_token_ids=tokens, mm_features=[], lora_request=None, cache_salt=None,
            kv_transfer_params=None,
        )
    """
)
"""A prelude for scripts that build the connector's halves by hand (in the vLLM environment, argv[1]: the
cache server): vLLM's config objects where the connector reads them, stand-ins for what only an engine
has (see the comment in it)."""


@pytest.fixture
def run_hand_built(cache_server: CacheServerProcess) -> Callable[[str], None]:
    """Runs ``HAND_BUILT`` + a script in the vLLM environment against ``cache_server``; it must print OK."""

    def run(script: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        done = subprocess.run(
            [str(vllm_python()), "-c", HAND_BUILT + textwrap.dedent(script), cache_server.endpoint],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]

    return run
