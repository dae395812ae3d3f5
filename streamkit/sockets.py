"""Listening sockets made ahead of the servers that take them over.

A server that binds its own port only once it starts (aiohttp's sites) leaves a
window in which the port is free; binding first reserves it, lets clients queue
in the backlog meanwhile, and lets a caller pick ports for a pair of servers.
"""

from __future__ import annotations

import socket

__all__ = ["BACKLOG", "listen"]

BACKLOG = 128


def listen(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket bound and listening on host:port (0: the kernel's choice).

    SO_REUSEADDR as aiohttp's own sites set it: a restarted server may reuse a port in
    TIME_WAIT, while a port another socket listens on stays refused."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
