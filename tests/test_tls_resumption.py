"""TLS session resumption across a certificate reload (SIGHUP), found by review.

A resumed handshake (a session ticket, or a session ID from the server's cache) presents no
certificate: it carries over the authentication of the session it resumes. The contexts that
hold the ticket key and the session cache were the listener's, which never changed, so a
client resumed, after a reload, a session made under the certificate the operator had just
replaced (rotated because its key leaked, or revoked), and the ticket key itself never
rotated for the life of the process. nginx builds new contexts at each reload, so tickets and
cached sessions from before it are refused and the client makes a full handshake.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
from pathlib import Path

from tests.support.certs import issue
from tests.support.harness import DOMAIN, running_relay


def _client(ca_file: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2  # the session is ready after the handshake
    return ctx


def _handshake(port: int, ctx: ssl.SSLContext, session: ssl.SSLSession | None) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    return ctx.wrap_socket(raw, server_hostname=f"49983-x.{DOMAIN}", session=session)


async def test_a_reload_ends_resumption_of_sessions_made_under_the_old_certificate(
    tmp_path: Path,
) -> None:
    old = issue(tmp_path / "old", [f"*.{DOMAIN}"])
    new = issue(tmp_path / "new", [f"*.{DOMAIN}"])  # another CA: the old one's clients refuse it
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(old.cert_file, cert)
    shutil.copy(old.key_file, key)
    overrides = {"listen": {"tls_cert": str(cert), "tls_key": str(key)}}
    ctx = _client(old.ca_file)
    async with running_relay(tmp_path, [], overrides) as relay:
        first = await asyncio.to_thread(_handshake, relay.port, ctx, None)
        session = first.session
        first.close()
        again = await asyncio.to_thread(_handshake, relay.port, ctx, session)
        assert again.session_reused  # resumption works while the certificate stays
        again.close()

        shutil.copy(new.cert_file, cert)
        shutil.copy(new.key_file, key)
        relay.relay.reload()

        def after() -> bool:
            try:
                sock = _handshake(relay.port, ctx, session)
            except ssl.SSLCertVerificationError:
                return False  # a full handshake: the new certificate, not of the old CA
            reused = bool(sock.session_reused)
            sock.close()
            return reused

        assert not await asyncio.to_thread(after)
