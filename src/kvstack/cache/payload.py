"""One chunk's bytes as the cache passes them around (`Payload`), and `byte_view`, which sees any of them as
flat unsigned bytes without a copy. Shared by the tiers, the store, the server and the clients; imports
nothing of kvstack.
"""

from __future__ import annotations

__all__ = ["Payload", "byte_view"]

Payload = bytes | bytearray | memoryview
"""One chunk's bytes, as given to ``put`` or returned by ``get``."""


def byte_view(data: Payload) -> memoryview:
    """``data`` as a flat view of unsigned bytes, without copying (any C-contiguous buffer works)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
