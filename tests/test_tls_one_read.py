"""The TLS pair is read once per start or reload, and the bytes read are the ones checked, served
and saved for a restarted worker (SPEC §7: SIGHUP reloads the certificate; relay.tlscheck).

A renewal (certbot, cert-manager) rewrites the files while relay may be reading them. When the
pair was read once for the check and again for the context, a renewal landing between the two
was served unchecked (here: a certificate that does not cover the routing domain, so every
handshake for it fails), while the metrics and the saved copy still described the checked one.
The renewal is placed deterministically: the files are rewritten right after relay's Nth read
of the key file.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import shutil
import ssl
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509

from relay.tls import ReloadableContext
from relay.tlscheck import TLSCheckError
from tests.support.certs import Issued, issue
from tests.support.harness import DOMAIN


def _serial(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


async def _served_serial(tls: ReloadableContext) -> int:
    """The serial of the certificate a new handshake gets from the listener context."""

    async def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0, ssl=tls.listener)
    port = server.sockets[0].getsockname()[1]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=f"x.{DOMAIN}"),
            5,
        )
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    return x509.load_der_x509_certificate(der).serial_number


def _renew_after_key_read(
    monkeypatch: pytest.MonkeyPatch, key: Path, n: int, install: Callable[[], None]
) -> None:
    """Rewrite the pair on disk right after the ``n``th read of ``key`` (a renewal mid-reload)."""
    original = Path.read_bytes
    reads = 0

    def read_bytes(self: Path) -> bytes:
        nonlocal reads
        data = original(self)
        if self == key:
            reads += 1
            if reads == n:
                install()
        return data

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


@pytest.mark.parametrize("n", [1, 2])
async def test_a_renewal_during_a_reload_is_not_served_unchecked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    pki = tmp_path / "pki"
    first = issue(pki, [f"*.{DOMAIN}"], prefix="first")
    second = issue(pki, [f"*.{DOMAIN}"], prefix="second")
    narrow = issue(pki, [f"api.{DOMAIN}"], prefix="narrow")  # does not cover *.DOMAIN
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"

    def install(pair: Issued) -> None:
        shutil.copy(pair.cert_file, cert)
        shutil.copy(pair.key_file, key)

    install(first)
    tls = ReloadableContext(str(cert), str(key), [DOMAIN])
    install(second)
    _renew_after_key_read(monkeypatch, key, n, lambda: install(narrow))
    with contextlib.suppress(ssl.SSLError, OSError, ValueError):
        tls.reload([DOMAIN])  # refusing the pair is fine; serving an unchecked one is not
    monkeypatch.undo()

    served = await _served_serial(tls)
    assert served != _serial(narrow.cert_file.read_bytes())
    assert served == tls.info.serial  # what the metrics and logs report
    assert served == _serial(tls.pem[0])  # what a restarted worker will serve


def test_a_reload_short_of_descriptors_leaves_none_open(tmp_path: Path) -> None:
    """The pair goes to OpenSSL through two memfds (server_context). At the descriptor limit
    (RLIMIT_NOFILE: a busy relay, LimitNOFILE= in the unit) the first may be made and the
    second not: the reload fails, as it should, but the first memfd was never closed, so each
    such SIGHUP took one more descriptor from the connections for good."""
    pair = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    tls = ReloadableContext(str(pair.cert_file), str(pair.key_file), [DOMAIN])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 32, hard))
    try:
        for _ in range(top + 64):  # bounded: the limit is 32 above the highest descriptor
            try:
                held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError as exc:
                full = exc.errno
                break
        else:
            full = 0
        assert full == errno.EMFILE
        # One descriptor free: the reload reads each file (and closes it), then makes the
        # first memfd and fails on the second.
        os.close(held.pop())
        # A config error like any other refusal of the pair (found by the next review: an
        # OSError from the memfds was a traceback in serve and check-config).
        with pytest.raises(TLSCheckError, match=r"cannot load .* Too many open files"):
            tls.reload([DOMAIN])
        held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))  # EMFILE: one leaked
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert tls.info.serial == _serial(pair.cert_file.read_bytes())  # the old pair still serves
