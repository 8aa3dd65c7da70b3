"""Running a server coroutine until SIGINT/SIGTERM, for the subcommands that serve."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any


def serve_until_signal(main: Any) -> int:
    """Run a server coroutine under uvloop until SIGINT/SIGTERM."""
    import uvloop

    async def wrapper() -> None:
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    uvloop.run(wrapper())
    return 0
