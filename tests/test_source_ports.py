"""Dials from ``upstream.source_address`` take a local port per destination, as connect picks it.

uvloop's ``create_connection(local_addr=(source, 0))`` binds before it connects, and a bind to
port 0 must pick a port free towards every destination at once: every upstream connection of
the host, and every TIME_WAIT relay left, took one of ``ip_local_port_range`` (~28,000 by
default) whatever its guest, shared by all workers, and the next dial failed with EADDRINUSE
at the bind (found by review). With ``IP_BIND_ADDRESS_NO_PORT`` (Linux 4.2, as nginx's
``proxy_bind``) the bind only fixes the address and connect picks the port per 4-tuple.

The port test needs root: it runs relay's pool in a network namespace of its own
(``unshare -n``), where ``ip_local_port_range`` is a sysctl of that namespace alone, set to 4
ports. Without root (or ``unshare``) it is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.dial import SOURCE_GONE, DialError
from relay.sourcebind import IP_BIND_ADDRESS_NO_PORT
from relay.upstreams import Pool, PoolKey
from tests.support.harness import scripted_upstream

ROOT = Path(__file__).resolve().parent.parent

# Runs inside the namespace: lo up, 4 local ports, two listeners on the source address; relay's
# pool dials 4 connections to each (all held open), then one more to the first.
IN_NAMESPACE = """
import asyncio, json, socket, subprocess, sys
import uvloop
from relay.dial import DialError
from relay.upstreams import Pool, PoolKey

source = sys.argv[1]
subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=5)
with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
    f.write("40000 40003")  # also the range of IPv6 sockets
family = socket.AF_INET6 if ":" in source else socket.AF_INET
listeners = []
for port in (5001, 5002):
    listener = socket.socket(family)
    listener.bind((source, port))
    listener.listen(64)
    listeners.append(listener)

async def main():
    pool = Pool(source_address=source, connect_timeout_s=2.0)
    outcomes, held = [], []
    for port in (5001, 5002) * 4 + (5001,):
        try:
            conn = await pool.connect(PoolKey("box", 0, source, port))
        except DialError as exc:
            outcomes.append([port, str(exc), exc.shortage])
        else:
            held.append(conn)
            outcomes.append([port, "ok"])
    for conn in held:
        conn.abort()
    print(json.dumps(outcomes))

uvloop.run(main())
"""


def open_descriptors() -> int:
    """Socket descriptors this process holds (libuv opens /dev/null once, lazily)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the directory's own descriptor, closed since
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


@pytest.mark.parametrize("source", ["127.0.0.1", "::1"])
def test_ports_of_the_source_address_are_shared_per_destination(source: str) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        reason = "needs root, unshare and iproute2 to make a network namespace"
        print(f"skipping the namespace test: {reason}")
        pytest.skip(reason)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = ["unshare", "-n", sys.executable, "-c", IN_NAMESPACE, source]
    result = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=20, env=env
    )
    if result.returncode and "unshare failed" in result.stderr:
        reason = f"cannot make a network namespace: {result.stderr.strip()}"
        print(f"skipping the namespace test: {reason}")
        pytest.skip(reason)
    assert result.returncode == 0, result.stderr
    outcomes = json.loads(result.stdout)
    # Before: the 5th dial failed, "Address already in use: no local port left on
    # upstream.source_address ...", with 4 connections open of the 8 the range allows.
    assert outcomes[:8] == [[5001, "ok"], [5002, "ok"]] * 4
    # All 4 ports are taken towards 5001: the next dial there gets none (EADDRNOTAVAIL at
    # connect), named as the source address's shortage towards that destination.
    towards = f"[{source}]:5001" if ":" in source else f"{source}:5001"
    assert outcomes[8] == [
        5001,
        "Cannot assign requested address: no local port left on "
        f"upstream.source_address {source} towards {towards}",
        "source ports",
    ]


@pytest.mark.parametrize("source", [None, "127.0.0.1"])
async def test_upstream_sockets_get_the_same_options_with_or_without_a_source(
    source: str | None,
) -> None:
    """TCP_NODELAY and the keepalive probes, on uvloop's own socket and on relay's; and the
    source dial binds its address without a port."""
    pool = Pool(source_address=source)

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    async with scripted_upstream(accept) as port:
        conn = await pool.connect(PoolKey("box", 0, "127.0.0.1", port))
        try:
            assert conn.transport is not None
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 15
            assert sock.getsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT) == (1 if source else 0)
            assert sock.getsockname()[0] == "127.0.0.1"
            assert pool.opened == 1
        finally:
            conn.abort()
    await asyncio.sleep(0)
    assert pool.opened == 0


async def test_a_host_name_is_resolved_in_the_source_family() -> None:
    """The management upstream may be a name (``http://localhost:port``): resolved as
    uvloop's create_connection resolves it, in the family a socket bound to the source can
    dial."""
    pool = Pool(source_address="127.0.0.1", connect_timeout_s=2.0)  # bounds a slow resolver

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    async with scripted_upstream(accept) as port:
        conn = await pool.connect(PoolKey("", 0, "localhost", port))
        assert conn.transport is not None
        assert conn.transport.get_extra_info("peername") == ("127.0.0.1", port)
        conn.abort()
        with pytest.raises(DialError) as unknown:
            await pool.connect(PoolKey("", 0, "no-such-host.invalid", port))  # RFC 6761 §6.4
    assert not unknown.value.refused
    assert unknown.value.shortage is None


@pytest.fixture
def stalled() -> Iterator[int]:
    """A port whose connects never complete: a listener with a backlog of 0 and its accept
    queue filled, so that the kernel drops further SYNs (the client retries them)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))
    try:
        yield port
    finally:
        filler.close()
        listener.close()


async def test_a_failed_or_cancelled_source_dial_leaves_no_descriptor(stalled: int) -> None:
    """The socket relay makes for a source dial is its own until uvloop's transport takes it:
    a bind or connect that fails, a timeout or a cancellation must close it."""
    before = open_descriptors()

    gone = Pool(source_address="192.0.2.1")  # TEST-NET-1 (RFC 5737): no interface has it
    with pytest.raises(DialError) as failed:
        await gone.connect(PoolKey("box", 0, "127.0.0.1", stalled))
    assert failed.value.shortage == SOURCE_GONE
    assert open_descriptors() == before

    pool = Pool(source_address="127.0.0.1", connect_timeout_s=0.2)
    with pytest.raises(DialError, match=r"^connect timed out$"):
        await pool.connect(PoolKey("box", 0, "127.0.0.1", stalled))
    assert open_descriptors() == before

    dial = asyncio.get_running_loop().create_task(
        pool.connect(PoolKey("box", 0, "127.0.0.1", stalled))
    )
    await asyncio.sleep(0.05)
    assert not dial.done()
    assert open_descriptors() == before + 1  # the socket, connecting
    dial.cancel()
    with pytest.raises(asyncio.CancelledError):
        await dial
    assert open_descriptors() == before

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: refused, retried (SPEC §4), refused again
    with pytest.raises(DialError) as refused:
        await pool.connect(PoolKey("box", 0, "127.0.0.1", port))
    assert refused.value.refused
    assert str(refused.value) == "connection refused"
    assert open_descriptors() == before
    assert pool.opened == gone.opened == 0
