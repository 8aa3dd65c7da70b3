"""Clients of the cache server: `CacheClient` (synchronous, for the vLLM connector) and `AsyncCacheClient`.

Both have the same operations: ``lookup`` (consecutive prefix count), ``locate`` (a tier per chunk of that
prefix), ``find`` (``locate`` and the partial tails stored right after that prefix), ``exists``, ``get``
(`Chunks`: the payloads of the longest consecutive prefix served), ``put`` (with each chunk's
``token_ids``, the ``parent`` key and the ``model``, which the server's admit events need), ``reserve``
(`Reservation`: arena regions for a one-copy put), ``evict``, ``clear``, ``server_stats``. Never an
exception in the caller's hot path: an unreachable server, a timeout, an error or malformed reply, even a
bug here, makes the operation a miss (``lookup`` 0, ``locate`` [], ``find`` ([], []), ``exists`` all
False, ``get`` None, ``put`` False, ``evict`` 0, ``clear`` False, ``server_stats`` None), counted in
``stats.failures`` (`ClientStats`) by reason and logged at most once per ``log_interval_s``. Only
constructor arguments raise.
Endpoints: any ZMQ endpoint, or ``unix:///path`` for a server on this host (``--unix-socket``).

Modules: core (requests, replies, failures, backoff), arena (shared-memory regions), results (what callers
get back), sync and aio (the two clients), dealer and unix (their connections).
"""

from kvstack.cache.client.aio import AsyncCacheClient
from kvstack.cache.client.results import Chunks, ClientStats, Reservation
from kvstack.cache.client.sync import CacheClient

__all__ = ["AsyncCacheClient", "CacheClient", "Chunks", "ClientStats", "Reservation"]
