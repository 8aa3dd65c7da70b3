"""Real vLLM with kvstack's KV connector, for the connector tests: the tiny model with seeded random
weights, engines that load the connector from this checkout, and greedy answers compared within bf16
rounding.

Why random weights: vLLM's dummy weights (uniform in +-1e-3) make the output ignore the context: with
them, another prompt's KV gives the same tokens and logprobs, so an equal answer would prove nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.engines import REPO, EngineProcess, start_vllm, vllm_python

MODEL_ID = "kvstack-test-tiny-weighted"  # kv_connector_extra_config.model_id: the keys' model name
# bf16 logits: a prefill split at another point (loaded prefix + rest) rounds differently from a whole one.
LOGPROB_TOLERANCE = 0.1


def write_weighted_model(tiny_model_dir: Path, directory: Path) -> Path:
    """The tiny model's files with seeded random weights (``initializer_range`` 0.1, written by
    transformers in the vLLM environment) in ``directory``."""
    shutil.copytree(tiny_model_dir, directory)
    script = textwrap.dedent(
        """
        import sys, torch
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(sys.argv[1])
        config.initializer_range = 0.1
        torch.manual_seed(20261202)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(sys.argv[1])
        """
    )
    subprocess.run([str(vllm_python()), "-c", script, str(directory)], check=True, capture_output=True)
    return directory


def start_connector_engine(
    model: Path, workdir: Path, server: str | None, *, chunk_size: int, **extra: Any
) -> EngineProcess:
    """vLLM on ``model``'s weights with `KVStackConnector` (imported from this checkout's src/) on the cache
    server ``server`` (``extra``: more ``kv_connector_extra_config`` keys); ``server`` None: no connector."""
    config: dict[str, object] | None = None
    if server is not None:
        config = {
            "kv_connector": "KVStackConnector",
            "kv_connector_module_path": "kvstack.connector.vllm_v1",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "server": server,
                "model_id": MODEL_ID,
                "chunk_size": chunk_size,
                **extra,
            },
        }
    return start_vllm(
        model,
        workdir,
        extra_args=["--load-format", "safetensors"],  # real (random) weights, see the module docstring
        kv_transfer_config=config,
        env={"PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])},
    )


@dataclass(frozen=True)
class Answer:
    """A greedy completion: its tokens, the top logprobs at each, the prompt's length."""

    tokens: list[str]
    top: list[dict[str, float]]
    prompt_tokens: int


def assert_close(answer: Answer, cold: Answer) -> None:
    """Same greedy tokens; top logprobs within bf16 rounding of a prefill split elsewhere."""
    assert answer.tokens == cold.tokens
    for got, want in zip(answer.top, cold.top, strict=True):
        common = set(got) & set(want)
        assert len(common) >= 4, (got, want)
        assert all(abs(got[t] - want[t]) < LOGPROB_TOLERANCE for t in common), (got, want)
