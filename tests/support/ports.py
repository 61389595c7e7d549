"""Free TCP ports on 127.0.0.1."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now: the kernel's pick for a socket bound to port 0, closed again (another
    process could take it before the caller binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
