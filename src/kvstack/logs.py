"""Log helpers every kvstack component shares: `ThrottledLog`, a warning at most once per interval, with a
count of the ones it held back. Imports nothing of kvstack.
"""

from __future__ import annotations

import logging
import time

__all__ = ["ThrottledLog"]


class ThrottledLog:
    """Logs a warning at most once per ``interval_s``, with how many were suppressed since the last one."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._log = logger
        self._interval = interval_s
        self._next = 0.0
        self._suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        self._next = now + self._interval
        if self._suppressed:
            msg += f" (and {self._suppressed} similar since the last report)"
            self._suppressed = 0
        self._log.warning(msg, *args)
