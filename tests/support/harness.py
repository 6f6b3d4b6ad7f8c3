"""Start relay for a test: in-process (fast, inspectable) or as a subprocess (real daemon).

In-process relays run on the test's own event loop; subprocess relays are the real
``relay serve`` with a TOML file and a routes file written into the test's temp dir.
Both bind 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.config import Config
from relay.config_parse import parse
from relay.runtime import Relay
from tests.support.certs import issue
from tests.support.ports import free_port

DOMAIN = "e2b.test"


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def scripted_upstream(handler: Handler) -> AsyncIterator[int]:
    """An upstream on a free loopback port that runs ``handler`` per connection; its port."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def until(check: Callable[[], bool], within_s: float = 5.0) -> None:
    """Wait for ``check`` to hold, polling; fail after ``within_s`` (generous: CI machines
    are shared)."""
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in {within_s} s")
        await asyncio.sleep(0.01)


def tls_listener(directory: Path) -> tuple[dict[str, dict[str, Any]], ssl.SSLContext]:
    """Config overrides for a TLS listener with a fresh certificate for ``*.DOMAIN``, and a
    client context that trusts it."""
    certs = issue(directory, [f"*.{DOMAIN}"])
    listen = {"tls_cert": str(certs.cert_file), "tls_key": str(certs.key_file)}
    return {"listen": listen}, certs.client_context()


def route(sandbox_id: str, port_address: str = "127.0.0.1", **fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"sandbox_id": sandbox_id, "address": port_address}
    out.update(fields)
    return out


def write_routes(path: Path, routes: list[dict[str, Any]]) -> None:
    """Atomic replace, as a control plane should do it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"routes": routes}))
    os.replace(tmp, path)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(type(value))


def to_toml(data: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        lines.append("")
    return "\n".join(lines)


def config_data(
    tmp_path: Path, overrides: dict[str, dict[str, Any]] | None = None, *, port: int = 0
) -> dict[str, dict[str, Any]]:
    data: dict[str, dict[str, Any]] = {
        "listen": {"address": f"127.0.0.1:{port}", "header_timeout_s": 5},
        "admin": {"address": "127.0.0.1:0"},
        "routing": {"domains": [DOMAIN]},
        "routes": {"file": str(tmp_path / "routes.json"), "poll_interval_s": 0.1},
    }
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    return data


def serve_until_exit(
    config: Path, *, timeout: float = 30, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``relay serve --config`` run to its exit, for start-ups that must be refused."""
    return subprocess.run(
        [sys.executable, "-m", "relay", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


@dataclass
class RelayUnderTest:
    relay: Relay
    routes_file: Path

    @property
    def port(self) -> int:
        return self.relay.bound[0][1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_routes(self, routes: list[dict[str, Any]]) -> None:
        write_routes(self.routes_file, routes)
        self.relay.feed.load()  # do not wait for the next poll


@contextlib.asynccontextmanager
async def running_relay(
    tmp_path: Path,
    routes: list[dict[str, Any]],
    overrides: dict[str, dict[str, Any]] | None = None,
    *,
    hold_every_write: bool = False,
    make: Callable[[Config], Relay] = Relay,
) -> AsyncIterator[RelayUnderTest]:
    """relay in this event loop. ``hold_every_write``: its outbox holds every small write to
    the end of the loop's turn (``busy=0``), as it does only under load when serving.
    ``make``: the Relay (a worker's ``WorkerRelay``, say) made of the configuration."""
    routes_file = tmp_path / "routes.json"
    write_routes(routes_file, routes)
    config: Config = parse(config_data(tmp_path, overrides), base_dir=tmp_path)
    relay = make(config)
    await relay.start()
    if hold_every_write:
        relay.outbox.bind(asyncio.get_running_loop().call_soon, busy=0)
    try:
        for _ in range(100):
            if relay.feed_state.ready:
                break
            await asyncio.sleep(0.01)
        yield RelayUnderTest(relay, routes_file)
    finally:
        await relay.stop()


class PortTaken(RuntimeError):
    """The relay exited because a port it was given to bind was taken."""


@dataclass
class RelayProcess:
    """``relay serve`` in a subprocess; output goes to files in the temp dir."""

    tmp_path: Path
    routes: list[dict[str, Any]]
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    port: int = 0
    admin_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None  # the child's environment (default: inherited)
    args: list[str] = field(default_factory=list)  # extra ``relay serve`` arguments
    close_stdout: bool = False  # start with descriptor 1 closed (``relay serve >&-``)
    nofile: tuple[int, int] | None = None  # start with this RLIMIT_NOFILE (``ulimit -n``)
    stdout_fd: int | None = None  # standard output on this descriptor (a pipe), not a file
    stderr_fd: int | None = None  # standard error likewise (``output()`` then lacks it)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def routes_file(self) -> Path:
        return self.tmp_path / "routes.json"

    def start(self, timeout: float = 10.0, *, until_ready: bool = True) -> None:
        """Start and wait for ``/readyz`` 200 (or, ``until_ready=False``, any admin answer).

        Ports this picked are picked again, up to three times, when the relay finds one taken:
        another process may bind a free port between ``free_port`` and the relay's bind.
        """
        picked = (not self.port, not self.admin_port)
        for attempt in range(3):
            self.port = self.port or free_port()
            self.admin_port = self.admin_port or free_port()
            try:
                self._start_once(timeout, until_ready=until_ready)
                return
            except PortTaken:
                if attempt == 2 or not any(picked):
                    raise
                self.port = 0 if picked[0] else self.port
                self.admin_port = 0 if picked[1] else self.admin_port

    def _start_once(self, timeout: float, *, until_ready: bool) -> None:
        data = config_data(self.tmp_path, self.overrides, port=self.port)
        data["admin"]["address"] = f"127.0.0.1:{self.admin_port}"
        write_routes(self.routes_file, self.routes)
        config = self.tmp_path / "relay.toml"
        config.write_text(to_toml(data))
        self.stdout = (self.tmp_path / "relay.stdout").open("wb")
        self.stderr = (self.tmp_path / "relay.stderr").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "--config", str(config), *self.args],
            stdout=self.stdout if self.stdout_fd is None else self.stdout_fd,
            stderr=self.stderr if self.stderr_fd is None else self.stderr_fd,
            env=self.env,
            preexec_fn=self._preexec,  # noqa: PLW1509
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stdout.close()
                self.stderr.close()
                output = self.output()
                if "address already in use" in output.lower():
                    raise PortTaken(f"relay exited: {output}")
                raise RuntimeError(f"relay exited: {output}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.admin_port), 0.2) as s,
            ):
                s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = s.recv(100)
                if answer.startswith(b"HTTP/1.1 200") or (answer and not until_ready):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"relay not ready: {self.output()}")

    def rss_kib(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def output(self) -> str:
        parts = []
        for name in ("relay.stdout", "relay.stderr"):
            path = self.tmp_path / name
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stdout.close()
        self.stderr.close()
        return self.proc.returncode

    def _preexec(self) -> None:
        """In the child, before ``exec``."""
        if self.nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, self.nofile)
        if self.close_stdout:
            os.close(1)


@contextlib.contextmanager
def relay_process(
    tmp_path: Path, routes: list[dict[str, Any]], overrides: dict[str, dict[str, Any]] | None = None
) -> Iterator[RelayProcess]:
    proc = RelayProcess(tmp_path, routes, overrides or {})
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
