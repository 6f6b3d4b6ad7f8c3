"""relay's protocols wired to recording transports, with the loop's turns run by hand.

No sockets and no event loop: a test feeds bytes to ``ClientConnection`` and
``UpstreamConnection`` as uvloop would and reads what they wrote, closed, aborted or paused,
in order (``tests/test_outbox.py``, ``tests/test_connection_faults.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.config_parse import parse
from relay.core.model import Route
from relay.runtime import Relay
from relay.server import ClientConnection
from relay.upstream_conn import UpstreamConnection
from relay.upstreams import PoolKey

DOMAIN = "sandbox.test"
MASKED_DATE = b"Date: <now>"
_DATE = re.compile(rb"(^|\r\n)Date: [^\r\n]*")


class Recorder:
    """A transport that records what happens to it, in order."""

    def __init__(self, peer: tuple[str, int] = ("127.0.0.1", 40000)) -> None:
        self.peer = peer
        self.events: list[tuple[str, bytes]] = []
        self.closing = False
        self.reading = True  # pause_reading / resume_reading
        self.buffered = 0  # what get_write_buffer_size() says: bytes the peer did not take

    @property
    def data(self) -> bytes:
        return b"".join(data for kind, data in self.events if kind == "write")

    def write(self, data: bytes) -> None:
        assert not self.closing, "written after close"
        # relay's own answers carry the time (Date, RFC 9110 §6.6.1): recordings compare what
        # relay decided, so two runs across a second's turn record the same bytes.
        self.events.append(("write", _DATE.sub(b"\\1" + MASKED_DATE, bytes(data))))

    def writelines(self, parts: list[bytes]) -> None:
        self.write(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def close(self) -> None:
        self.closing = True
        self.events.append(("close", b""))

    def abort(self) -> None:
        self.closing = True
        self.events.append(("abort", b""))

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.events.append(("eof", b""))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.peer if name == "peername" else default

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class Turns:
    """``loop.call_soon`` as the outbox uses it: callbacks run when the turn ends."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def __call__(self, callback: Callable[[], None]) -> None:
        self.pending.append(callback)

    def end(self) -> None:
        while self.pending:
            self.pending.pop(0)()


REQUEST = f"GET /x HTTP/1.1\r\nHost: 3000-sbx.{DOMAIN}\r\n\r\n".encode()
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@dataclass
class Wired:
    relay: Relay
    turns: Turns
    client: ClientConnection
    client_transport: Recorder
    upstream: UpstreamConnection
    upstream_transport: Recorder


def make_wired(tmp_path: Path, *, busy: int = 0, listen: dict[str, Any] | None = None) -> Wired:
    """A relay whose outbox is bound to a hand-run turn, a client connection and one pooled
    upstream connection to the sandbox's port 3000, all on recording transports.
    ``listen``: settings of the config's ``[listen]`` table."""
    (tmp_path / "routes.json").write_text('{"routes": []}')
    config = {"routing": {"domains": [DOMAIN]}, "routes": {"file": "routes.json"}}
    relay = Relay(parse({**config, "listen": listen or {}}, tmp_path))
    relay.install_routes({"sbx": Route(sandbox_id="sbx", address="127.0.0.1", insecure=True)}, "t")
    turns = Turns()
    relay.outbox.bind(turns, busy=busy)  # busy=0: every small write held
    upstream = UpstreamConnection(relay.pool, PoolKey("sbx", 0, "127.0.0.1", 3000))
    upstream_transport = Recorder(("127.0.0.1", 3000))
    upstream.connection_made(upstream_transport)  # type: ignore[arg-type]
    relay.pool.release(upstream)
    client = ClientConnection(relay, tls=False)
    client_transport = Recorder()
    client.connection_made(client_transport)  # type: ignore[arg-type]
    return Wired(relay, turns, client, client_transport, upstream, upstream_transport)
