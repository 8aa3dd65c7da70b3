"""Shared-memory arenas: chunk payloads between a client and a cache server on the same host, one memcpy each
way and none on the socket.

An arena is a file in ``/dev/shm`` (mode 0600) created and owned by one client (`ClientArena`) and mapped
shared by the client and the server (`ServerArenas`). Its first page holds ``MAGIC`` and a random nonce; at
``hello`` the server maps the named file and compares the nonce, which proves a shared host. Any failure
leaves that client on socket payloads. A get lends the server a region to copy chunks into, a put sends the
offsets of a region the client filled; what does not fit its region travels in frames.

Bounds: regions come from `ArenaAllocator`; a client whose request timed out retires the whole arena, so a
late server access never touches memory the client reuses; the server maps at most ``max_arenas`` and opens
only names matching ``ARENA_NAME``; an arena is allocated in full at creation (a full /dev/shm is an error at
connect, not a SIGBUS later). Trust: arenas are for same-host clients of the same user, since a client that
truncates its arena while the server copies into it crashes the server with SIGBUS. `sweep_orphan_arenas`
removes the files of killed clients.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import re
import secrets
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ARENA_NAME",
    "HEADER_BYTES",
    "ArenaAllocator",
    "ArenaError",
    "ClientArena",
    "ServerArena",
    "ServerArenas",
    "sweep_orphan_arenas",
]

log = logging.getLogger(__name__)

SHM_DIR: Final = "/dev/shm"
MAGIC: Final = b"kvstack-arena/1\0"
NONCE_BYTES: Final = 16
HEADER_BYTES: Final = mmap.PAGESIZE
ALIGN: Final = 64
ARENA_NAME: Final = re.compile(r"kvstack-arena-[0-9A-Za-z_.-]{1,96}")
_OWN_NAME: Final = re.compile(r"kvstack-arena-([0-9]+)-([0-9]+)-[0-9a-f]{16}")


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def sweep_orphan_arenas(directory: str = SHM_DIR) -> int:
    """Unlink arena files left by processes of this pid namespace and user that no longer exist; how many.

    A client killed with SIGKILL leaves its arena file behind; each client process runs this before its
    first arena, and the server at start. The pid namespace in the name keeps it from judging files of
    processes it cannot see (containers that share /dev/shm but not their pids)."""
    namespace, uid, removed = _pid_namespace(), os.getuid(), 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        match = _OWN_NAME.fullmatch(name)
        if match is None or match.group(1) != namespace or os.path.exists(f"/proc/{match.group(2)}"):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid == uid:
                os.unlink(path)
                removed += 1
        except OSError:
            continue
    if removed:
        log.info("removed %d shared-memory arena(s) of exited processes from %s", removed, directory)
    return removed


_swept: set[str] = set()  # directories this process has swept (once each)


class ArenaError(Exception):
    """An arena cannot be created, opened or used; the message says why."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ArenaAllocator:
    """Regions of ``[start, end)``: first fit, sizes rounded up to 64 bytes, freed regions coalesce."""

    def __init__(self, start: int, end: int) -> None:
        start = _align(start)
        if end <= start:
            raise ValueError(f"empty arena range [{start}, {end})")
        self._free_offsets: list[int] = [start]  # sorted
        self._free_sizes: dict[int, int] = {start: end - start}
        self._used: dict[int, int] = {}
        self.capacity = end - start

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def largest_free(self) -> int:
        return max(self._free_sizes.values(), default=0)

    def alloc(self, size: int) -> int | None:
        """The offset of a new region of at least ``size`` bytes (> 0), or None when none is free."""
        if size <= 0:
            raise ValueError(f"region size must be > 0, got {size}")
        size = _align(size)
        for i, offset in enumerate(self._free_offsets):
            free = self._free_sizes[offset]
            if free < size:
                continue
            del self._free_sizes[offset]
            if free == size:
                del self._free_offsets[i]
            else:
                self._free_offsets[i] = offset + size
                self._free_sizes[offset + size] = free - size
            self._used[offset] = size
            return offset
        return None

    def shrink(self, offset: int, size: int) -> None:
        """Keep the first ``size`` bytes of the region at ``offset`` (0: free it); the rest is free again."""
        held = self._used[offset]
        size = _align(size)
        if size >= held:
            return
        if size == 0:
            del self._used[offset]
            self._release(offset, held)
        else:
            self._used[offset] = size
            self._release(offset + size, held - size)

    def free(self, offset: int) -> None:
        self.shrink(offset, 0)

    def _release(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + size:  # merge the next one
            size += self._free_sizes.pop(self._free_offsets.pop(i))
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_sizes[prev] == offset:  # merge into the previous one
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(i, offset)
        self._free_sizes[offset] = size


class ClientArena:
    """A client's arena: created in ``/dev/shm``, unlinked by `retire` (or `close`).

    The file is named ``kvstack-arena-<pid namespace>-<pid>-<random>`` (mode 0600) and allocated in full
    (``posix_fallocate``: ``size`` bytes of shared memory, the client's ``arena_bytes``), so a full /dev/shm
    raises `ArenaError` here (the client then uses the socket) rather than a SIGBUS on the first write into a
    hole.

    - get: the client lends a region of its arena in the request; the server copies each chunk from its
      memory tier into the region and replies with offsets; the client reads views of its own mapping (no
      copy). Chunks that do not fit the region come back in frames.
    - put: the client copies the payloads into a region and sends offsets; the server copies them into its
      memory tier; the client frees the region when the reply arrives. Payloads that do not fit go in frames.

    Regions are handed out by `allocator` (first fit, 64-byte aligned, coalescing).
    """

    def __init__(self, size: int, *, directory: str = SHM_DIR) -> None:
        if size < HEADER_BYTES + ALIGN:
            raise ValueError(f"an arena needs more than {HEADER_BYTES} bytes, got {size}")
        if directory not in _swept:
            _swept.add(directory)
            sweep_orphan_arenas(directory)
        self.name = f"kvstack-arena-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.path = os.path.join(directory, self.name)
        if not hasattr(os, "posix_fallocate"):
            raise ArenaError("shared-memory arenas need posix_fallocate (Linux)")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise ArenaError(f"cannot create shared-memory arena {self.path}: {e}") from e
        try:
            # Allocated now: a full /dev/shm fails here, not later as SIGBUS on a write into a hole.
            os.posix_fallocate(fd, 0, size)
            self._map: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except OSError as e:
            os.unlink(self.path)
            raise ArenaError(
                f"cannot allocate or map shared-memory arena {self.path} ({size} bytes): {e}"
            ) from e
        finally:
            os.close(fd)
        self.size = size
        self.view = memoryview(self._map)
        self.view[: len(MAGIC)] = MAGIC
        self.view[len(MAGIC) : len(MAGIC) + NONCE_BYTES] = self.nonce
        self.allocator = ArenaAllocator(HEADER_BYTES, size)
        self.retired = False
        # Unlinked at retirement, or when the arena is collected or the interpreter exits without one.
        self._unlink = weakref.finalize(self, _unlink_quietly, self.path)

    def retire(self) -> None:
        """Unlink the file and stop handing out regions; the mapping goes when its last view does.

        For a request that timed out: the server may still execute it later, writing into or reading from
        its region, so the client never reuses a byte of this arena and creates a fresh one."""
        if self.retired:
            return
        self.retired = True
        self._unlink()
        self.view.release()
        mapping, self._map = self._map, None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view is still read: freed with the last one
                mapping.close()

    close = retire


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


@dataclass(slots=True, eq=False)
class ServerArena:
    """The server's mapping of one client arena."""

    name: str
    map: mmap.mmap
    inode: int

    @property
    def size(self) -> int:
        return len(self.map)

    def check_range(self, offset: int, size: int) -> None:
        """Raise `ArenaError` unless ``[offset, offset + size)`` lies in the arena, past its header."""
        if offset < HEADER_BYTES or size < 0 or offset + size > len(self.map):
            raise ArenaError(
                f"region [{offset}, {offset + size}) is outside arena {self.name} "
                f"([{HEADER_BYTES}, {len(self.map)}))"
            )

    def close(self) -> bool:
        try:
            self.map.close()
        except BufferError:  # a copy into the tier is still running; closed by a later sweep
            return False
        return True


class ServerArenas:
    """The arenas a server has mapped, by name: at most ``max_arenas``, least recently used closed first.

    `sweep` drops mappings whose file was unlinked. Only names matching ``ARENA_NAME`` are opened, so a client
    cannot point the server at another shared-memory file; arenas are mode 0600, so the server maps only
    those of its own user."""

    def __init__(self, *, max_arenas: int = 64, directory: str = SHM_DIR) -> None:
        sweep_orphan_arenas(directory)
        self._arenas: OrderedDict[str, ServerArena] = OrderedDict()
        self._closing: list[ServerArena] = []
        self._max = max_arenas
        self._dir = directory

    def __len__(self) -> int:
        return len(self._arenas)

    def open(self, name: str, nonce: bytes | None = None) -> ServerArena:
        """The mapping of arena ``name`` (mapped now if needed); with ``nonce``, checked against the
        arena's header (a fresh mapping is always checked for the magic)."""
        arena = self._arenas.get(name)
        if arena is None:
            arena = self._map(name)
            self._arenas[name] = arena
            while len(self._arenas) > self._max:
                _, old = self._arenas.popitem(last=False)
                self._close(old)
        else:
            self._arenas.move_to_end(name)
        if nonce is not None and arena.map[len(MAGIC) : len(MAGIC) + NONCE_BYTES] != nonce:
            raise ArenaError(f"arena {name} has another nonce: it is not the client's (another host?)")
        return arena

    def sweep(self) -> None:
        """Close mappings whose file was unlinked or replaced (the client retired or exited)."""
        for name, arena in list(self._arenas.items()):
            try:
                gone = os.stat(os.path.join(self._dir, name)).st_ino != arena.inode
            except OSError:
                gone = True
            if gone:
                del self._arenas[name]
                self._close(arena)
        self._closing = [arena for arena in self._closing if not arena.close()]

    def close(self) -> None:
        for arena in self._arenas.values():
            self._close(arena)
        self._arenas.clear()

    def _close(self, arena: ServerArena) -> None:
        if not arena.close():
            self._closing.append(arena)

    def _map(self, name: str) -> ServerArena:
        if not ARENA_NAME.fullmatch(name):
            raise ArenaError(f"{name!r} is not an arena name (expected {ARENA_NAME.pattern})")
        path = os.path.join(self._dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise ArenaError(f"cannot open arena {path}: {e} (not on this host, or another user's?)") from e
        try:
            st = os.fstat(fd)
            if st.st_size < HEADER_BYTES + ALIGN:
                raise ArenaError(f"arena {path} has {st.st_size} bytes, too small to be one")
            mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED)
        except OSError as e:
            raise ArenaError(f"cannot map arena {path}: {e}") from e
        finally:
            os.close(fd)
        if mapping[: len(MAGIC)] != MAGIC:
            mapping.close()
            raise ArenaError(f"{path} does not start with the arena magic {MAGIC!r}")
        return ServerArena(name, mapping, st.st_ino)
