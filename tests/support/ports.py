"""Free 127.0.0.1 ports for servers a test starts later (in-process servers bind port 0 instead).

Ports are picked below the kernel's ephemeral range: a port from that range (what binding port 0 returns)
can be handed to any outgoing connection between this check and the server's own bind, which then fails
with "address already in use". Ports below it are only ever taken by a bind.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from contextlib import ExitStack
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = _ephemeral_low()
_ports = random.Random()  # not the tests' seeded generators: the same port every run would be no safer


def free_port() -> int:
    """A port nothing is bound to now."""
    high = max(1025, min(_EPHEMERAL_LOW, 65536))  # exclusive
    for _ in range(100):
        port = _ports.randrange(max(1024, high - 12000), high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is crowded: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int, *, avoid: Collection[int] = ()) -> range:
    """``n`` consecutive free ports, none in ``avoid`` (for servers that number their ports from a base)."""
    for _ in range(100):
        base = free_port()
        ports = range(base, base + n)
        if ports.stop > 65536 or any(p in ports for p in avoid):
            continue
        with ExitStack() as held:
            try:
                for port in ports:
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return ports
    raise RuntimeError(f"found no {n} consecutive free ports")
