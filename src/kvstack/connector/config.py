"""The connector's settings: ``kv_connector_extra_config`` parsed and checked once, at start-up.

`parse_config` reads them. Every key is optional but ``server``; `ConnectorConfig` lists them with their
defaults. Unknown keys are an error (a misspelt ``"laod": false`` must not silently keep loading). vLLM's
``kv_role`` narrows the switches: "kv_producer" only saves, "kv_consumer" only loads, "kv_both" does both.

Set vLLM's ``"kv_load_failure_policy": "recompute"`` next to ``kv_role`` in ``--kv-transfer-config``
(not in ``kv_connector_extra_config``): a chunk that fails to load (lost, corrupt, the server down) is then
recomputed and the answer is the same as without the connector; under vLLM's default, "fail", the
request fails.

``model_id`` must name the weights, not just the architecture: two engines with the same ``model_id``
and layout load each other's chunks, so different weights under one name would serve wrong KV silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.cache.keys import DEFAULT_CHUNK_SIZE

__all__ = ["ConfigError", "ConnectorConfig", "parse_config"]


class ConfigError(ValueError):
    """The connector's configuration cannot work; the message says what to change."""


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The ``kv_connector_extra_config`` keys, all optional but ``server``:

    ==============  ===========  =====================================================================
    key             default      meaning
    ==============  ===========  =====================================================================
    server          (required)   the cache server: ``tcp://127.0.0.1:5560``, or ``unix:///path`` on its host
    chunk_size      128          tokens per chunk (the cache server's ``--chunk-size``); a multiple of vLLM's
                                 block size (128 on CPU, 16 on GPU)
    load            true         look chunks up and load them into the engine's KV blocks
    save            true         save the chunks the engine computes
    partial_tail    true         also save each prompt's partial last chunk (fewer tokens than a chunk) and
                                 load a stored one right after the loaded chunks (one lookup finds both)
    timeout_s       1.0          bound of one round trip to the server (a lookup holds the scheduler)
    retry_max_s     30.0         after failures, the server is skipped (misses, no I/O) for up to this long
    model_id        model path   the model's name in chunk keys: set it when engines load the same
                                 weights from different paths, so that they share chunks
    secret_file     none         file with the server's shared secret (see ``kvstack cache-server``)
    shm             true         payloads through shared memory when the server is on the same host
    arena_mb        128          that shared memory, per client: a worker has two (loads, and saves on
                                 their background thread); the scheduler's client only looks up
    save_queue      64           save jobs (a request's new chunks of one step) waiting for the worker's
                                 save thread; a step's save that finds it full is dropped and counted
    prefill_wait_s  2.0          P/D: how long a decode request waits for the chunks its prefill engine
                                 announced (``kvstack.connector.handoff``) before computing what is missing
    ==============  ===========  =====================================================================
    """

    server: str
    chunk_size: int = DEFAULT_CHUNK_SIZE
    load: bool = True
    save: bool = True
    partial_tail: bool = True
    timeout_s: float = 1.0
    retry_max_s: float = 30.0
    model_id: str | None = None
    secret_file: str | None = None
    shm: bool = True
    arena_mb: int = 128
    save_queue: int = 64
    prefill_wait_s: float = 2.0

    def check_block_size(self, block_size: int) -> None:
        """Chunks hold whole blocks: the connector moves blocks, never parts of one."""
        if block_size < 1 or self.chunk_size % block_size:
            raise ConfigError(
                f"kvstack connector: chunk_size {self.chunk_size} is not a multiple of vLLM's block size "
                f"{block_size}; set kv_connector_extra_config.chunk_size to a multiple of {block_size} "
                f"(e.g. {max(block_size, self.chunk_size // block_size * block_size)})"
            )

    def secret(self) -> bytes | None:
        if self.secret_file is None:
            return None
        try:
            secret = Path(self.secret_file).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"kvstack connector: cannot read secret_file: {e}") from None
        if not secret:
            raise ConfigError(f"kvstack connector: secret_file {self.secret_file} is empty")
        return secret


_TYPES: dict[str, tuple[type, ...]] = {
    "server": (str,),
    "chunk_size": (int,),
    "load": (bool,),
    "save": (bool,),
    "partial_tail": (bool,),
    "timeout_s": (int, float),
    "retry_max_s": (int, float),
    "model_id": (str,),
    "secret_file": (str,),
    "shm": (bool,),
    "arena_mb": (int,),
    "save_queue": (int,),
    "prefill_wait_s": (int, float),
}


def parse_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """``kv_connector_extra_config`` as a `ConnectorConfig`; `ConfigError` says what is wrong."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_TYPES))
    if unknown:
        raise ConfigError(
            f"kvstack connector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(_TYPES)}"
        )
    for key, value in extra.items():
        types = _TYPES[key]
        # bool is an int: reject True where a number is expected, and 1 where a bool is.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ConfigError(
                f"kvstack connector: {key} must be {' or '.join(t.__name__ for t in types)}, got {value!r}"
            )
    server = extra.pop("server", None)
    if not server or "://" not in server:
        raise ConfigError(
            "kvstack connector: kv_connector_extra_config.server must be the cache server's endpoint, "
            'e.g. "tcp://127.0.0.1:5560", or its unix socket on the same host, e.g. '
            f'"unix:///run/kvstack/cache.sock" (got {server!r})'
        )
    config = ConnectorConfig(server=server, **extra)
    if config.chunk_size < 1:
        raise ConfigError(f"kvstack connector: chunk_size must be >= 1, got {config.chunk_size}")
    if not 0 < config.timeout_s <= config.retry_max_s:
        raise ConfigError(
            f"kvstack connector: need 0 < timeout_s <= retry_max_s, got {config.timeout_s}, "
            f"{config.retry_max_s}"
        )
    if config.arena_mb < 1:
        raise ConfigError(f"kvstack connector: arena_mb must be >= 1, got {config.arena_mb}")
    if config.save_queue < 1:
        raise ConfigError(f"kvstack connector: save_queue must be >= 1, got {config.save_queue}")
    if config.prefill_wait_s < 0:
        raise ConfigError(f"kvstack connector: prefill_wait_s must be >= 0, got {config.prefill_wait_s}")
    if config.model_id is not None and not config.model_id:
        raise ConfigError("kvstack connector: model_id must not be empty")
    return config
