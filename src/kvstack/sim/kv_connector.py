"""The simulated engine's KV connector: kvstack's vLLM connector (``kvstack.connector``) emulated over the
real cache server, so that simulated engines share prompt prefixes through the KV cache tier.

- Keys: the prompt's full chunks keyed by `kvstack.cache.keys.chunk_keys` over `sim_kv_layout` (the simulated
  model's layers, KV heads, head size and dtype from its ``config.json``); the layout names the simulator, so
  its synthetic chunks never reach a real engine sharing the server.
- Lookup, before the request is scheduled: ``locate`` from the chunk holding the end of the engine's local
  prefix hit gives an `ExternalPrefix`, labelled per chunk as the real connector labels
  ``prompt_tokens_cached_by_source``; those tokens are loaded at ``load_per_token`` each instead of prefilled.
- Save, when the prompt is computed: the full chunks past the local hit and past what the server held, with a
  deterministic payload of ``bytes_per_token`` bytes per token and the chunks' token ids, in the background.

Faults are misses: every cache call answers within ``timeout_s`` and backs off from a server that is down, so
the engine computes every prompt and keeps serving. At most ``max_pending_puts`` saves are in flight; more
are dropped and counted. Design notes: docs/design/simulator.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.cache.client import AsyncCacheClient
from kvstack.cache.keys import DEFAULT_CHUNK_SIZE, KEY_BYTES, KVLayout, chunk_keys
from kvstack.logs import ThrottledLog
from kvstack.sim.scheduler import ExternalPrefix, SimRequest

__all__ = ["DEFAULT_CHUNK_SIZE", "CacheTierConfig", "CacheTierConnector", "ConnectorStats", "sim_kv_layout"]

log = logging.getLogger(__name__)

# The real connector's tier -> vLLM CacheHitSource mapping (kvstack.connector.vllm_v1).
TIER_SOURCES = {"memory": "host", "disk": "disk"}


def sim_kv_layout(model: str, model_dir: str | None, block_size: int) -> KVLayout:
    """The chunk-key namespace of a simulated engine serving ``model`` (its model id, like vLLM's); the KV
    shape comes from ``model_dir/config.json``, else from the built-in tiny model's shape."""
    from kvstack.devtools.tiny_model import TinyShape  # its import loads the tokenizers library

    shape = TinyShape()
    config: dict[str, Any] = {}
    path = Path(model_dir) / "config.json" if model_dir else None
    if path is not None and path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the model's KV shape from {path}: {e}") from None
    heads = int(config.get("num_attention_heads", shape.num_attention_heads))
    hidden = int(config.get("hidden_size", shape.hidden_size))
    return KVLayout(
        model=model,
        num_layers=int(config.get("num_hidden_layers", shape.num_hidden_layers)),
        num_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_size=int(config.get("head_dim") or hidden // heads),
        dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
        block_layout=f"kvstack-sim:block={block_size}",
    )


@dataclass(frozen=True, slots=True)
class CacheTierConfig:
    """``kvstack sim --kv-cache-server``: where the cache server is and how the connector talks to it."""

    server: str
    layout: KVLayout
    chunk_size: int = DEFAULT_CHUNK_SIZE
    bytes_per_token: int = 16
    """Synthetic payload size: small, so a cache server holds many simulated chunks in a modest budget."""
    timeout_s: float = 0.5
    max_pending_puts: int = 32

    def validate(self, block_size: int) -> CacheTierConfig:
        if not self.server.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--kv-cache-server {self.server!r}: expected tcp://HOST:PORT or ipc://PATH")
        if self.chunk_size < 1 or self.chunk_size % block_size:
            raise ValueError(
                f"--kv-cache-chunk-size {self.chunk_size} is not a multiple of --block-size {block_size} "
                "(a chunk is whole blocks, as for the real connector)"
            )
        if self.bytes_per_token < 1 or self.timeout_s <= 0 or self.max_pending_puts < 1:
            raise ValueError(
                "--kv-cache-bytes-per-token, --kv-cache-timeout and max_pending_puts must be positive"
            )
        return self


@dataclass(slots=True)
class ConnectorStats:
    lookups: int = 0
    chunks_found: int = 0
    puts: int = 0
    """Saves sent (each one put of a prompt's new chunks)."""
    chunks_put: int = 0
    """Chunks of the saves the server accepted."""
    puts_failed: int = 0
    puts_dropped: int = 0
    """Saves not sent because ``max_pending_puts`` were in flight."""


class CacheTierConnector:
    """One engine's connector: an `AsyncCacheClient` (no shared memory: payloads are tiny) and its saves."""

    def __init__(self, config: CacheTierConfig, *, name: str = "") -> None:
        self.config = config
        self.name = name
        self.stats = ConnectorStats()
        self.client = AsyncCacheClient(config.server, timeout_s=config.timeout_s, shm=False, name=name)
        self._puts: set[asyncio.Task[None]] = set()
        self._drops = ThrottledLog(log)

    async def lookup(self, token_ids: Sequence[int], num_local: int) -> ExternalPrefix:
        """The stored chunks of the prompt from the one holding token ``num_local`` (the local hit's end)."""
        cs = self.config.chunk_size
        try:
            keys = chunk_keys(token_ids, self.config.layout, cs)
        except ValueError:  # ids no tokenizer makes: nothing to share
            return ExternalPrefix(cs)
        first = num_local // cs
        tiers = await self.client.locate(keys[first:]) if first < len(keys) else []
        self.stats.lookups += 1
        self.stats.chunks_found += len(tiers)
        sources = tuple(TIER_SOURCES.get(t, "external_unspecified") for t in tiers)
        return ExternalPrefix(cs, first, sources, tuple(keys))

    def save(self, req: SimRequest) -> None:
        """Put the full prompt chunks ``req`` computed (not a local hit, not found in the store) in the
        background."""
        prefix = req.external_prefix
        if prefix is None or not prefix.keys:
            return
        cs = self.config.chunk_size
        first = max(req.num_cached_tokens - req.num_external_tokens, 0) // cs
        stored_end = prefix.first_chunk + len(prefix.sources)
        if prefix.first_chunk <= first < stored_end:
            first = stored_end
        if first >= len(prefix.keys):
            return
        if len(self._puts) >= self.config.max_pending_puts:
            self.stats.puts_dropped += 1
            self._drops.warning(
                "sim KV connector %s: %d saves in flight; dropped one (the cache server is slow)",
                self.name,
                len(self._puts),
            )
            return
        task = asyncio.get_running_loop().create_task(self._put(req.prompt_token_ids, prefix.keys, first))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def _put(self, token_ids: Sequence[int], keys: Sequence[bytes], first: int) -> None:
        cs = self.config.chunk_size
        size = cs * self.config.bytes_per_token
        new = keys[first:]
        self.stats.puts += 1
        ok = await self.client.put(
            new,
            [synthetic_payload(key, size) for key in new],
            token_ids=[list(token_ids[c * cs : (c + 1) * cs]) for c in range(first, len(keys))],
            parent=keys[first - 1] if first else None,
        )
        if ok:
            self.stats.chunks_put += len(new)
        else:
            self.stats.puts_failed += 1

    async def aclose(self) -> None:
        for task in list(self._puts):
            task.cancel()
        await asyncio.gather(*self._puts, return_exceptions=True)
        await self.client.aclose()


def synthetic_payload(key: bytes, size: int) -> bytes:
    """``size`` bytes that depend only on the chunk key: the key repeated."""
    return (key * (size // KEY_BYTES + 1))[:size]
