"""kvstack's vLLM KV connector: engines load prompt chunks from the cache server instead of recomputing
them, and save the chunks they compute.

Runs inside vLLM's process, so it imports little beyond torch, vLLM and the cache client and keys (pyzmq,
msgspec, blake3, xxhash). The vLLM class, `KVStackConnector`, lives in ``kvstack.connector.vllm_v1``
(imported by vLLM, never here); this package's import pulls in neither torch nor vLLM::

    --kv-transfer-config '{"kv_connector": "KVStackConnector",
      "kv_connector_module_path": "kvstack.connector.vllm_v1", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"server": "tcp://127.0.0.1:5560", "chunk_size": 128}}'

Modules: ``config`` (`parse_config`), ``layout`` (the KV layouts handled, the key namespace), ``plan`` and
``planner`` (`StepPlan`, `ChunkPlanner`: the scheduler half, no vLLM types), ``saves`` (`SaveQueue`: the
background save thread, no torch), ``worker`` (`BlockMover`: block copies, torch), ``vllm_v1`` (the adapter).
Loads are synchronous, saves asynchronous. With ``"kv_load_failure_policy": "recompute"`` vLLM recomputes
whatever fails to load; under its default ("fail") such a request fails.
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
