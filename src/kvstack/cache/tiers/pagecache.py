"""Is a file wholly in the page cache? Linux's ``cachestat`` system call (kernel 6.5+), asked through ctypes.

The disk tier reads a chunk file whose pages are all cached on its event loop, as the memory tier reads
memory: a thread pool's hand-off and return costs about as much as mapping and checksumming a cached MiB,
so the hop would double the cost of the read. Other files go to its I/O threads.

Where ``cachestat`` cannot be asked (another OS, a kernel before 6.5, a seccomp filter that refuses unknown
system calls, as container runtimes' default profiles do), `PageCache.resident` answers None from then on
and every read goes to the threads.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import sys
from collections.abc import Callable

__all__ = ["PageCache"]

log = logging.getLogger(__name__)

# cachestat(2) has this number on every Linux architecture (calls added since 5.1 share one numbering).
_SYS_CACHESTAT = 451
# Answers that mean "never available here" (a seccomp filter answers EPERM or ENOSYS).
_UNAVAILABLE = frozenset({errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP, errno.EINVAL})


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]  # len 0: to the end of the file


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _cachestat_call() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_long, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    call.restype = ctypes.c_long
    return call


class PageCache:
    """Asks whether files are wholly in the page cache. Not thread-safe: one per thread that asks (the
    answer buffer is reused, so a question costs one system call, ~1 µs)."""

    def __init__(self) -> None:
        self._call = _cachestat_call()
        self._range = _Range(0, 0)
        self._stat = _Stat()
        self._range_at = ctypes.addressof(self._range)
        self._stat_at = ctypes.addressof(self._stat)

    @property
    def available(self) -> bool:
        """False once the system has shown it cannot answer (then `resident` is always None)."""
        return self._call is not None

    def resident(self, fd: int, nbytes: int) -> bool | None:
        """Whether the first ``nbytes`` of the open file ``fd`` are all in the page cache (dirty pages
        count: they are in memory); None when this system cannot tell."""
        if self._call is None:
            return None
        self._range.len = nbytes
        if self._call(_SYS_CACHESTAT, fd, self._range_at, self._stat_at, 0) != 0:
            code = ctypes.get_errno()
            if code in _UNAVAILABLE:
                name = errno.errorcode.get(code, code)
                log.info("page cache residency cannot be asked here (cachestat: %s)", name)
                self._call = None
            return None
        return bool(self._stat.nr_cache >= -(-nbytes // mmap.PAGESIZE))
