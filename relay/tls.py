"""TLS on the data listener (the SDK's Host form is ``https://49983-<id>.<domain>``).

The listener's ``SSLContext`` never changes; each handshake is switched by ``sni_callback``
to the *current* context, so that a reload (SIGHUP) can swap the certificate for new
connections while established ones keep theirs.

Only HTTP/1.1 is offered over ALPN: relay speaks HTTP/1.1, and pyqwest (SDK >= 2.52) then
uses one connection per concurrent stream, which is fine; it also avoids h2's empty DATA
frame pitfall noted for SDK 2.63 (``ENVD_API_FILE_DOWNLOAD_HTTP_VERSION``).
"""

from __future__ import annotations

import ssl


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context for one certificate chain; raises ``ssl.SSLError``/``OSError``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


class ReloadableContext:
    """A listener context whose certificate can be replaced while the listener runs."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.current = server_context(cert_file, key_file)
        self.listener = server_context(cert_file, key_file)
        self.listener.sni_callback = self._select

    def _select(self, sslobj: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        sslobj.context = self.current

    def reload(self) -> None:
        """Load the files again; on error the old certificate stays and the error is raised."""
        self.current = server_context(self.cert_file, self.key_file)
