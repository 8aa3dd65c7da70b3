"""A listening TCP socket for kvstack's servers (HTTP/1.1 and gRPC): address reuse, optionally a port shared
by several processes (SO_REUSEPORT), non-blocking; port 0 picks a free one."""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int, *, reuse_port: bool = False, backlog: int = 4096) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
