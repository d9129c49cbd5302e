"""Options both ends set on a new connection's socket, and how an address is written."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

#: Send buffer asked for on a Unix stream socket. Unlike TCP's, it is not autotuned: the
#: default (net.core.wmem_default, 208 KiB) lets that much be in flight, so a 32 MiB batch
#: made ~160 trips of the writer to sleep and back, and a Unix-socket put ran slower than TCP
#: loopback. 4 MiB is TCP's own ceiling (tcp_wmem); the kernel caps it at net.core.wmem_max.
UNIX_SNDBUF = 4 << 20


def tune(sock: Any) -> None:
    """TCP_NODELAY on TCP (requests are whole frames, written at once); a larger send buffer
    on a Unix socket, never a smaller one than the host's default."""
    if sock is None:
        return
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    elif sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError):  # a socket that refuses the option works as it is
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < 2 * UNIX_SNDBUF:  # (reported doubled)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)


def bracketed(host: str) -> str:
    """A host as ``host:port`` names it: an IPv6 one in brackets (``[::1]:7600``, the form clients take)."""
    return f"[{host}]" if ":" in host else host
