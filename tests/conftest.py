"""Session fixtures: the tiny model directory, one real vLLM server and one simulator configured alike.

Real-vLLM tests are marked ``vllm`` and are part of `make test`; `make unit` leaves them out. Without the
vLLM virtualenv they skip with the reason, unless KVSTACK_REQUIRE_VLLM=1 (as `make test` and CI set it), in
which case they fail (``support.engines.require_vllm``). With KVSTACK_EXPECT_COMPILED=1 (`make test`'s pass on
the compiled build) the session stops at once unless the request path imported is the compiled one.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import zmq.asyncio

from kvstack.devtools.tiny_model import make_tiny_model
from support.engines import EngineProcess, require_vllm, start_sim, start_vllm


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("KVSTACK_EXPECT_COMPILED") == "1":
        for name in ("kvstack.http.server", "kvstack.router.proxy", "kvstack.router.app"):
            where = importlib.import_module(name).__file__ or ""
            if not where.endswith(".so"):
                raise pytest.UsageError(f"KVSTACK_EXPECT_COMPILED=1 but {name} is {where}: `make compiled`")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """Real vLLM 0.32 on CPU: block size 128, 64 KV blocks, KV events with replay."""
    require_vllm()
    engine = start_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm"))
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def sim_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """The simulator configured like ``vllm_engine`` (same tokenizer, block size, capacity)."""
    engine = start_sim(tmp_path_factory.mktemp("sim"), model_dir=tiny_model_dir)
    yield engine
    engine.stop()


@pytest.fixture(params=["sim", "vllm"])
def engine(request: pytest.FixtureRequest) -> EngineProcess:
    """Each conformance test runs once against the simulator and once against real vLLM."""
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A ZMQ context for one test, its sockets closed without lingering at the end."""
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)
