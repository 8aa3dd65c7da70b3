"""Free 127.0.0.1 ports for servers a test starts later (in-process servers bind port 0 instead).

Ports are picked below the kernel's ephemeral range: a port from that range (what binding port 0 returns)
can be handed to any outgoing connection between this check and the server's own bind, which then fails
with "address already in use". Ports below it are only ever taken by a bind. A port handed out is not handed
out again for the next 4,096 calls: a test that asks for two ports before starting either server gets two.
"""

from __future__ import annotations

import collections
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
_recent: collections.deque[int] = collections.deque(maxlen=4096)  # handed out lately, not bound yet maybe
_recent_set: set[int] = set()


def _hand_out(port: int) -> int:
    if len(_recent) == _recent.maxlen:
        _recent_set.discard(_recent[0])
    _recent.append(port)
    _recent_set.add(port)
    return port


def free_port() -> int:
    """A port nothing is bound to now."""
    high = max(1025, min(_EPHEMERAL_LOW, 65536))  # exclusive
    for _ in range(100):
        port = _ports.randrange(max(1024, high - 12000), high)
        if port in _recent_set:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return _hand_out(port)
    with socket.socket() as s:  # the range below is crowded: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return _hand_out(int(s.getsockname()[1]))


def free_ports(n: int, *, avoid: Collection[int] = ()) -> range:
    """``n`` consecutive free ports, none in ``avoid`` (for servers that number their ports from a base)."""
    for _ in range(100):
        base = free_port()
        ports = range(base, base + n)
        if ports.stop > 65536 or any(p in ports for p in avoid) or any(p in _recent_set for p in ports[1:]):
            continue
        with ExitStack() as held:
            try:
                for port in ports:
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        for port in ports[1:]:
            _hand_out(port)
        return ports
    raise RuntimeError(f"found no {n} consecutive free ports")
