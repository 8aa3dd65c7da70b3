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
- layout: which KV cache tensor layouts the copies handle (told from shapes), and the chunk-key namespace
  (platform, attention backend, layout, block size; the workers report it at start-up).
- plan / planner: the scheduler half's decisions, no vLLM types (`ChunkPlanner`, `StepPlan`).
- saves: the worker's background save thread, bounded, and the bookkeeping that keeps a save's blocks
  allocated until it has read them (`SaveQueue`; no torch).
- worker: whole-block copies between vLLM's KV cache (CPU or a device) and chunk payloads (`BlockMover`;
  torch).
- vllm_v1: `KVStackConnector`, the adapter between vLLM's calls and the pieces above.

Loads are synchronous (before the forward pass reads them); saves are asynchronous (a background thread
per worker, after the forward pass). ``"kv_load_failure_policy": "recompute"`` makes vLLM recompute
whatever fails to load; without it (vLLM's default "fail") such a request fails.
"""

from kvstack.connector.config import ConfigError, ConnectorConfig, parse_config
from kvstack.connector.layout import (
    PAGED_LAYOUT,
    AttentionShape,
    LayoutVerdict,
    block_layout_name,
    detect_layout,
    kv_layout,
)
from kvstack.connector.plan import StepPlan, loadable_end, plan_load, plan_save
from kvstack.connector.planner import ChunkPlanner, keys_by_rank
from kvstack.connector.saves import SaveQueue, SaveStats

__all__ = [
    "PAGED_LAYOUT",
    "AttentionShape",
    "ChunkPlanner",
    "ConfigError",
    "ConnectorConfig",
    "LayoutVerdict",
    "SaveQueue",
    "SaveStats",
    "StepPlan",
    "block_layout_name",
    "detect_layout",
    "keys_by_rank",
    "kv_layout",
    "loadable_end",
    "parse_config",
    "plan_load",
    "plan_save",
]
