"""Upstream dials from ``upstream.source_address``: bound to the address, not to a port.

uvloop's ``create_connection(local_addr=(source, 0))`` binds before it connects, and a bind
to port 0 picks a port free towards every destination at once: each upstream connection of
the host, and each TIME_WAIT relay left behind, took one of ``ip_local_port_range`` (~28,000
by default) whatever its guest, shared by every worker, and the next dial failed with
EADDRINUSE at the bind (found by review; tests/test_source_ports.py, with a 4-port range in a
network namespace). With ``IP_BIND_ADDRESS_NO_PORT`` (Linux 4.2) the bind fixes only the
address and connect picks the port, free towards that destination alone (its 4-tuple), as a
dial without a source does; nginx sets it for ``proxy_bind`` for the same reason. So relay
makes the socket itself: ``create_connection`` takes no socket options before its bind.

A dial without a source address does not come here: uvloop's own ``create_connection`` is
the hot path and stays as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable
from typing import TypeVar

__all__ = ["IP_BIND_ADDRESS_NO_PORT", "BindError", "dial_from"]

# linux/in.h; at SOL_IP, and read there for IPv6 sockets too (net/ipv6/ipv6_sockglue.c passes
# SOL_IP options of non-raw sockets to ip_setsockopt; __inet6_bind honours the flag). Python
# names it from 3.12 only: relay runs on 3.11.
IP_BIND_ADDRESS_NO_PORT = 24

_P = TypeVar("_P", bound=asyncio.BaseProtocol)


class BindError(OSError):
    """The bind to the source address failed (``relay.dial.shortage`` tells it from a
    connect's error: EADDRNOTAVAIL at the bind means the address left the host, at connect
    that no port of it is left towards the destination)."""


async def dial_from(
    loop: asyncio.AbstractEventLoop,
    factory: Callable[[], _P],
    host: str,
    port: int,
    source: str,
) -> _P:
    """Connect to ``host``:``port`` from ``source`` (an IP address, as the configuration
    requires), and hand the socket to uvloop: its transport and ``factory``'s protocol.

    ``host`` is resolved in the source's family (routes carry IP literals; the management
    upstream may be a name): a socket bound to it can dial no other. Its addresses are tried
    in order, as ``create_connection`` does; when all fail, the first one's error is raised
    (with its errno, which ``shortage`` and the refused-retry read). The socket is relay's
    until ``create_connection`` takes it: closed on any failure or cancellation before (after,
    uvloop closes it and detaches the object).
    """
    family = socket.AF_INET6 if ":" in source else socket.AF_INET
    infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
    first: OSError | None = None
    for _family, _type, _proto, _name, address in infos:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            # Before 4.2 the kernel lacks it (ENOPROTOOPT): the bind picks the port, as before.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            try:
                sock.bind((source, 0))
            except OSError as exc:
                raise BindError(exc.errno, exc.strerror) from None
            try:
                await loop.sock_connect(sock, address)
            except OSError as exc:
                if exc.errno is None:
                    raise
                # uvloop says "Connect call failed (address)" for an error it reads later
                # (SO_ERROR): the access log gets the errno's text, as from create_connection.
                # OSError(errno, ...) is ConnectionRefusedError for ECONNREFUSED, and so on.
                raise OSError(exc.errno, os.strerror(exc.errno)) from None
            _, protocol = await loop.create_connection(factory, sock=sock)
            return protocol
        except BindError:
            sock.close()
            raise  # the source, not this destination address: the next would fail alike
        except OSError as exc:
            sock.close()
            first = first or exc
        except BaseException:
            sock.close()  # cancelled, timed out: a no-op once create_connection detached it
            raise
    raise first or OSError("getaddrinfo() returned empty list")
