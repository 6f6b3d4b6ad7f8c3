"""TLS on the data listener (the SDK's Host form is ``https://49983-<id>.<domain>``).

The listener's ``SSLContext`` never changes; each handshake is switched by ``sni_callback``
to the *current* context, so that a reload (SIGHUP) can swap the certificate for new
connections while established ones keep theirs.

Only HTTP/1.1 is offered over ALPN: relay speaks HTTP/1.1, and pyqwest (SDK >= 2.52) then
uses one connection per concurrent stream, which is fine; it also avoids h2's empty DATA
frame pitfall noted for SDK 2.63 (``ENVD_API_FILE_DOWNLOAD_HTTP_VERSION``).
"""

from __future__ import annotations

import errno
import os
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path

from relay.tlscheck import CertInfo, TLSCheckError, check_pair, read_pair


def load_checked(
    cert_file: Path, key_file: Path, domains: Sequence[str], *, dates: bool = True
) -> tuple[CertInfo, tuple[bytes, bytes], ssl.SSLContext]:
    """Read the pair once, check it (:mod:`relay.tlscheck`) and load it as OpenSSL will serve
    it; every refusal is a :class:`~relay.tlscheck.TLSCheckError` naming the key.

    OpenSSL refuses some pairs the checks pass (at its default security level 2: an RSA key
    under 2048 bits, a SHA-1 signature). ``check-config`` passed them and ``serve`` stopped on
    a traceback, exit 1 (found by review); both now run this.
    """
    pem = read_pair(cert_file, key_file)
    info = check_pair(*pem, cert_file, key_file, domains, dates=dates)
    try:
        ctx = server_context(pem)
    except ssl.SSLError as exc:
        why = str(exc.reason or exc).lower().replace("_", " ")
        raise TLSCheckError(
            f"listen.tls_cert: OpenSSL refuses {cert_file} with {key_file}: {why}"
        ) from None
    except OSError as exc:  # the memfds (EMFILE at the descriptor limit, a seccomp filter)
        raise TLSCheckError(
            f"listen.tls_cert: cannot load {cert_file} with {key_file}: {exc.strerror or exc}"
        ) from None
    return info, pem, ctx


def server_context(
    pem: tuple[bytes, bytes], kind: type[ssl.SSLContext] = ssl.SSLContext
) -> ssl.SSLContext:
    """A server context (of ``kind``) for one certificate chain and key, given as the bytes
    that were checked; raises ``ssl.SSLError``/``OSError``.

    ``load_cert_chain`` takes only paths, and reading the files again would load whatever a
    renewal wrote since the check (an unchecked certificate, or a new certificate with the old
    key; found by review). So OpenSSL reads the same bytes from anonymous memory files, which
    never touch a disk (the key is a secret).
    """
    ctx = kind(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    fds: list[int] = []
    try:
        # One at a time inside the try: at the descriptor limit the second memfd_create fails
        # (EMFILE), and the first must be closed too (found by review: one leaked per reload).
        for name in ("relay-tls-cert", "relay-tls-key"):
            fds.append(_memfd(name))
        for fd, data in zip(fds, pem, strict=True):
            os.write(fd, data)  # a memfd takes a whole write
        ctx.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
    finally:
        for fd in fds:
            os.close(fd)
    return ctx


# Linux 6.3+: a memfd that can never be executed. With vm.memfd_noexec = 2 (a hardening
# sysctl) kernels 6.3-6.5 refuse a memfd made without it (EACCES); kernels before 6.3 do not
# know the flag (EINVAL) and get a plain one. (os.MFD_NOEXEC_SEAL exists from Python 3.12.)
MFD_NOEXEC_SEAL = getattr(os, "MFD_NOEXEC_SEAL", 0x0008)


def _memfd(name: str) -> int:
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC | MFD_NOEXEC_SEAL)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.memfd_create(name, os.MFD_CLOEXEC)


class Feed:
    """The transport whose bytes a TLS protocol is being fed, while it is: ``send`` is its
    ``write``, set by ``relay.handshake.FirstBytes`` around each feed of a handshake's bytes
    (the TLS protocol runs ``do_handshake`` on them within the feed, synchronously), for
    :class:`AlertingObject`. A value for the length of one call, not a per-connection map:
    an ``SSLObject`` has no way to know its transport."""

    send: Callable[[bytes], object] | None = None


class AlertingObject(ssl.SSLObject):
    """A handshake that fails sends OpenSSL's alert (RFC 8446 §6.2: "protocol_version",
    "handshake_failure", "unexpected_message"...) before the connection closes.

    uvloop's TLS protocol (``SSLProtocol``, 0.23; asyncio's too before CPython gh-98078 was
    fixed by python/cpython#153620 in 2026) closes the transport at a failed
    ``do_handshake`` (``_on_handshake_complete`` → ``_fatal_error`` → the TCP transport's
    ``_force_close``) without sending what OpenSSL wrote to the outgoing ``MemoryBIO``: the
    alert. That BIO is a private attribute of the Cython class, and by the time ``start_tls``
    wakes relay the transport drops writes. So the alert is sent from here, at the failure,
    through ``Feed.send``, before ``SSLProtocol`` closes the transport: a write that nothing
    waits before goes to the socket at once (uvloop's fast path), so it leaves before the
    close (a write queued behind a full socket would be lost with the close, as before).
    Clients then report "tlsv1 alert protocol version" or "handshake failure", as against
    nginx, rather than "connection reset" or "unexpected EOF".
    """

    outgoing: ssl.MemoryBIO  # set by ListenerContext.wrap_bio

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError:
            pending = self.outgoing.read()  # the alert (after anything not yet sent)
            if pending and Feed.send is not None:
                Feed.send(pending)
            raise


class ListenerContext(ssl.SSLContext):
    """The listener's context: its handshakes are :class:`AlertingObject`s (``wrap_bio``
    and ``sslobject_class`` are the ``ssl`` module's hooks for this)."""

    sslobject_class = AlertingObject

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        tls = super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)
        assert isinstance(tls, AlertingObject)
        tls.outgoing = outgoing
        return tls


class ReloadableContext:
    """A listener context whose certificate can be replaced while the listener runs.

    Every pair is checked (:mod:`relay.tlscheck`: key matches, in date, SANs cover each
    routing domain's wildcard) before it is used, at start and on reload.
    """

    def __init__(
        self,
        cert_file: str,
        key_file: str,
        domains: Sequence[str] = (),
        *,
        load_from: tuple[Path, Path] | None = None,
    ) -> None:
        """``load_from``: where to read the pair this time (a restarted worker's copy of the
        pair its siblings serve, whose dates are not checked again: see check_pair); reloads
        read ``cert_file`` and ``key_file``."""
        self.cert_file = cert_file
        self.key_file = key_file
        cert, key = load_from if load_from else (Path(cert_file), Path(key_file))
        # Read once: the bytes checked are the bytes served (see server_context).
        self.info: CertInfo
        self.info, pem, self.current = load_checked(cert, key, domains, dates=not load_from)
        # The files' bytes as they were loaded, for a worker that its supervisor restarts
        # (relay.worker_config.save): the pair may be rewritten in place later.
        self.pem = pem
        self.listener = self._listener(pem)

    def _listener(self, pem: tuple[bytes, bytes]) -> ssl.SSLContext:
        """The context each accept's ``start_tls`` takes (relay.handshake reads it anew at
        every accept). It holds the session cache and the session-ticket key (OpenSSL's
        ``session_ctx`` stays the context a handshake began with, whatever ``sni_callback``
        switches to), so a reload makes a new one: a resumed handshake presents no
        certificate, and with one listener for the process's life clients resumed sessions
        made under the certificate a reload had just replaced (found by review), and the
        ticket key never rotated. nginx, too, builds new contexts at each reload."""
        listener = server_context(pem, ListenerContext)
        listener.sni_callback = self._select
        return listener

    def _select(self, sslobj: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        sslobj.context = self.current

    def reload(
        self,
        domains: Sequence[str] = (),
        cert_file: str | None = None,
        key_file: str | None = None,
    ) -> CertInfo:
        """Load the (possibly moved) files again and swap them in for new handshakes.

        On any problem the old certificate stays and the error is raised
        (:class:`~relay.tlscheck.TLSCheckError`, ``ssl.SSLError`` or ``OSError``).
        """
        cert_file = cert_file or self.cert_file
        key_file = key_file or self.key_file
        info, pem, current = load_checked(Path(cert_file), Path(key_file), domains)
        listener = self._listener(pem)
        self.current, self.listener = current, listener
        self.cert_file, self.key_file, self.info, self.pem = cert_file, key_file, info, pem
        return info
