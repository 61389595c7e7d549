"""A group's replicas from its configured URLs: the one source of the router's membership.

Each URL in a group's `replicas` (router/config.py) is either one replica or a name that stands for
several:
- `http://<IP literal>:<port>` is one replica (it resolves to itself: local mode's
  `http://127.0.0.1:<port>`, or a URL a person wrote);
- `http://<name>:<port>` stands for every address the name resolves to, each one replica
  `http://<address>:<port>`. The operator writes each group's headless Service there
  (operator/config_files.py): its DNS answer is the group's READY pods (a headless Service publishes no
  not-ready address: operator/builders.py), so the router follows pod replacement and scaling by itself,
  as soon as the cluster's DNS says a pod is ready;
- `https://...` is one replica: TLS verifies the name, so it is not replaced by addresses.

A name with no address (NXDOMAIN or an empty answer: a Service with no ready pod) means no replicas; a
lookup that failed otherwise (the DNS server unreachable, a timeout) keeps what the last answer gave.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

Resolve = Callable[[str], Awaitable[Sequence[str]]]  # host name -> its addresses (raises socket.gaierror)

# getaddrinfo's answers for a name that has no address (as opposed to a lookup that failed)
NO_ADDRESS_ERRORS = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)


async def system_resolve(host: str) -> list[str]:
    """The addresses of `host` by the event loop's resolver (getaddrinfo: every A / AAAA record)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def name_of(url: str) -> str | None:
    """The host name an http URL stands for, or None when the URL is one replica as it is (an IP literal
    or https)."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme != "http" or not host:
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host
    return None


def replica_urls(url: str, addresses: Sequence[str]) -> list[str]:
    """The replica URLs a name's addresses give: the URL with each address for its host, sorted, once each."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port is not None else ""
    path = parts.path.rstrip("/")
    hosts = {f"[{a}]" if ":" in a else a for a in addresses}
    return sorted(f"{parts.scheme}://{host}{port}{path}" for host in hosts)


def is_no_address(exc: OSError) -> bool:
    """Whether a failed lookup says the name has no address (rather than that the lookup itself failed)."""
    return isinstance(exc, socket.gaierror) and exc.errno in NO_ADDRESS_ERRORS
