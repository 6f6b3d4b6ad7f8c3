"""What must hold whatever bytes a client sends; shared by the atheris harnesses.

The model of envd's view of a path is independent of relay's own helpers: Go's ``net/url``
decodes a path once (a bad escape is a 400) and E2B matches control paths after
``path.Clean``; here that is ``re`` and ``posixpath``.
"""

from __future__ import annotations

import posixpath
import re

from relay.core import auth, headers, policy
from relay.core.decide import Settings
from relay.core.model import Forward, Route
from relay.core.routes import RouteTable

ENVD_PORT = 49983
SETTINGS = Settings(domains=("e2b.test",), management=True)
FORWARD_MODE = Settings(domains=("e2b.test",), management=True, strip=False)
ROUTES = {
    "sbx1": Route(
        sandbox_id="sbx1",
        address="127.0.0.1",
        envd_token="envd-tok",  # noqa: S106  (a test credential)
        traffic_token="traffic-tok",  # noqa: S106
    ),
    "open": Route(sandbox_id="open", address="127.0.0.1", insecure=True),
}
TABLE = RouteTable.of(ROUTES)
_BAD_ESCAPE = re.compile(rb"%(?![0-9a-fA-F]{2})")


def go_path(target: bytes) -> str | None:
    """What envd's router (and E2B's control-path check) makes of a request-target."""
    if not target.startswith(b"/"):
        return None
    raw = target.partition(b"?")[0]
    if _BAD_ESCAPE.search(raw):
        return None
    decoded = re.sub(rb"%([0-9a-fA-F]{2})", lambda m: bytes([int(m[1], 16)]), raw)
    return "/" + posixpath.normpath(decoded.decode("latin-1")).lstrip("/")


def check_forward(result: Forward, settings: Settings) -> None:
    """A forwarded request never reaches the control surface nor carries a credential."""
    if result.target is not None:
        assert result.target.port not in settings.denied_ports, result
        if result.target.port == settings.envd_port:
            assert go_path(result.path) not in policy.CONTROL_PATHS, result.path
    names = [n.lower() for n, _ in result.headers]
    own = {b"content-length", b"transfer-encoding", b"connection", b"upgrade"}
    assert not set(names) & (headers.HOP_BY_HOP - own), names
    assert names.count(b"content-length") + names.count(b"transfer-encoding") <= 1, names
    if settings.strip:
        assert not set(names) & headers.CREDENTIALS, names
        for key, _ in auth.go_parse_query(result.path.partition(b"?")[2]):
            assert key.lower() not in auth.STRIPPED_PARAMS, result.path


def frame_ends(data: bytes) -> set[int]:
    """Where whole WebSocket frames end (RFC 6455 §5.2), 0 included."""
    ends, pos = {0}, 0
    while len(data) - pos >= 2:
        length7 = data[pos + 1] & 0x7F
        size = 2 + (2 if length7 == 126 else 8 if length7 == 127 else 0)
        size += 4 if data[pos + 1] & 0x80 else 0
        if len(data) - pos < size:
            break
        length = length7
        if length7 >= 126:
            length = int.from_bytes(data[pos + 2 : pos + (4 if length7 == 126 else 10)], "big")
        end = pos + size + length
        if end > len(data):
            break
        ends.add(end)
        pos = end
    return ends
