"""One long-lived relay for the whole hostile suite, in front of one recording upstream.

The relay is the real daemon (``relay serve`` in a subprocess), started once per session;
every hostile test attacks that same process, and ``test_survivor.py`` (moved to the end of
the session by :func:`pytest_collection_modifyitems`) checks that it is still the same
process, still answers an authorized request and never logged an internal error.

Tests that need a configuration of their own (``listen.max_connections``, a memory
measurement) start a relay of their own and check it the same way before they end.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.hostile.recorder import Recorder
from tests.support.harness import DOMAIN, RelayProcess, route, write_routes
from tests.support.rawhttp import Connection, Response

ENVD_TOKEN = "envd-tok"
TRAFFIC_TOKEN = "traffic-tok"
HEADER_TIMEOUT_S = 1.0
SURVIVOR = "test_survivor.py::test_the_same_relay_still_serves_after_the_suite"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the survivor check after every other test of the session."""
    last = [item for item in items if item.nodeid.endswith(SURVIVOR)]
    for item in last:
        items.remove(item)
        items.append(item)


@dataclass
class Hostile:
    """The shared relay and what a test needs to aim at it."""

    relay: RelayProcess
    recorder: Recorder
    pid: int = 0  # the relay process the suite started with

    @property
    def port(self) -> int:
        return self.relay.port

    def host(self, role: str = "envd", sandbox: str = "sbx") -> str:
        return f"{self.recorder.ports[role]}-{sandbox}.{DOMAIN}"

    @property
    def envd(self) -> str:
        """Host of the secured sandbox's envd (needs X-Access-Token)."""
        return self.host("envd", "sbx")

    @property
    def app(self) -> str:
        """Host of an application port of an insecure sandbox (needs nothing)."""
        return self.host("app", "open")

    def set_routes(self, extra: list[dict[str, Any]]) -> None:
        self.relay.routes = [*shared_routes(), *extra]
        write_routes(self.relay.routes_file, self.relay.routes)


def shared_routes() -> list[dict[str, Any]]:
    return [
        route("sbx", envd_token=ENVD_TOKEN, traffic_token=TRAFFIC_TOKEN),
        route("open", insecure=True),
        route("lim", insecure=True, max_connections=1),
        # Outside upstream.allowed_cidrs (127.0.0.1/32, ::1/128): both must be rejected, though
        # each would reach a listener of the recorder if relay dialled it.
        route("outside", "127.0.0.2", insecure=True),
        route("mapped", "::ffff:127.0.0.1", insecure=True),
    ]


def relay_overrides(recorder: Recorder) -> dict[str, dict[str, Any]]:
    return {
        "listen": {"header_timeout_s": HEADER_TIMEOUT_S, "max_connections": 2000},
        "upstream": {
            "envd_port": recorder.ports["envd"],
            "denied_ports": [50090, recorder.ports["control"]],
            "allowed_cidrs": ["127.0.0.1/32", "::1/128"],
            "connect_timeout_s": 2,
        },
    }


@pytest.fixture(scope="session")
def recorder() -> Iterator[Recorder]:
    rec = Recorder(
        {"envd": "127.0.0.1", "app": "127.0.0.1", "control": "127.0.0.1", "outside": "127.0.0.2"}
    ).start()
    yield rec
    rec.stop()


@pytest.fixture(scope="session")
def hostile(tmp_path_factory: pytest.TempPathFactory, recorder: Recorder) -> Iterator[Hostile]:
    tmp = tmp_path_factory.mktemp("hostile-relay")
    proc = RelayProcess(tmp, shared_routes(), relay_overrides(recorder))
    proc.start()
    assert proc.proc is not None
    try:
        yield Hostile(proc, recorder, proc.proc.pid)
    finally:
        proc.stop()


@pytest.fixture(autouse=True)
def no_internal_error_in_the_shared_relay(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test during which the shared relay logged a bug (a traceback, an internal
    error), so that it is pinned on the attack that caused it."""
    if "hostile" not in request.fixturenames:
        yield
        return
    hostile: Hostile = request.getfixturevalue("hostile")
    before = len(relay_log(hostile.relay))
    yield
    new = relay_log(hostile.relay)[before:]
    for marker in ("Traceback", "internal error", "Fatal error"):
        assert marker not in new, new[-4000:]


# -- small helpers shared by the modules ---------------------------------------------------


@contextlib.asynccontextmanager
async def connected(port: int) -> AsyncIterator[Connection]:
    """A raw client connection that is closed however the test ends."""
    conn = await Connection.open(port)
    try:
        yield conn
    finally:
        await conn.close()


async def exchange(
    port: int, raw: bytes, *, timeout: float = 3.0, head: bool = False, linger: float = 1.0
) -> tuple[Response, bool]:
    """Send raw bytes on a fresh connection; return the first answer and whether relay closed
    the connection within ``linger`` seconds after it (0: do not wait)."""
    async with connected(port) as conn:
        await conn.send(raw)
        response = await conn.read_response(timeout=timeout, head=head)
        closed = conn.eof or (linger > 0 and await conn.closed_by_peer(linger))
        return response, closed


def body_json(response: Response) -> dict[str, Any]:
    data = json.loads(response.body)
    assert isinstance(data, dict)
    return data


def relay_log(relay: RelayProcess) -> str:
    return relay.output()


def assert_no_internal_error(relay: RelayProcess) -> None:
    log = relay_log(relay)
    assert "internal error" not in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
