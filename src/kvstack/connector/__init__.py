"""kvstack's vLLM KV connector: engines load prompt chunks from the cache server instead of recomputing
them, and save the chunks they compute.

Runs inside vLLM's process, so its imports stay small: the cache client and keys (pyzmq, msgspec, blake3,
xxhash), torch and vLLM. The vLLM class lives in ``kvstack.connector.vllm_v1`` (imported by vLLM, never
here); this package's import pulls in neither torch nor vLLM::

    --kv-transfer-config '{"kv_connector": "KVStackConnector",
      "kv_connector_module_path": "kvstack.connector.vllm_v1", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"server": "tcp://127.0.0.1:5560", "chunk_size": 256}}'

- config: the ``kv_connector_extra_config`` keys and defaults (`parse_config`).
- layout: which KV cache tensor layouts work (vLLM's CPU backend), and the chunk-key namespace.
- plan / planner: the scheduler half's decisions, no vLLM types (`ChunkPlanner`, `StepPlan`).
- worker: whole-block copies between vLLM's KV cache and chunk payloads (`BlockMover`; torch).
- vllm_v1: `KVStackConnector`, the adapter between vLLM's calls and the pieces above.

Loads and saves are synchronous in this version (the load before the forward pass, the save after it).
"""

from kvstack.connector.config import ConfigError, ConnectorConfig, parse_config
from kvstack.connector.layout import AttentionShape, LayoutVerdict, detect_layout, kv_layout
from kvstack.connector.plan import StepPlan, loadable_end, plan_load, plan_save
from kvstack.connector.planner import ChunkPlanner, keys_by_rank

__all__ = [
    "AttentionShape",
    "ChunkPlanner",
    "ConfigError",
    "ConnectorConfig",
    "LayoutVerdict",
    "StepPlan",
    "detect_layout",
    "keys_by_rank",
    "kv_layout",
    "loadable_end",
    "parse_config",
    "plan_load",
    "plan_save",
]
