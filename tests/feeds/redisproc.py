"""A private ``redis-server`` for tests and benches: loopback, free port, own directory.

Never the machine's Redis on 6379: each server gets a free port from
``tests.support.ports`` (outside the kernel's ephemeral range), a temporary
directory, no RDB snapshots and no AOF (``--save "" --appendonly no``). An explicit ``SAVE``
still writes ``dump.rdb`` into that directory, which a restart on the same port loads: the
kill-and-restart test uses that to come back with known contents.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port

START_TIMEOUT_S = 10.0


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


class RedisProcess:
    """One redis-server; ``start``/``kill``/``start`` again keeps its port and directory."""

    def __init__(
        self, directory: Path, *, config_lines: list[str] | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.host = host  # the loopback address it listens on: 127.0.0.1 or ::1
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.config_lines = config_lines  # a full config file instead of the plain defaults
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = directory / "redis.log"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://{host}:{self.port}"

    def _command(self) -> list[str]:
        binary = redis_server_path()
        if binary is None:
            raise RuntimeError("redis-server not found (make test installs it)")
        common = [
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            "--logfile",
            str(self.log),
            "--daemonize",
            "no",
        ]
        if self.config_lines is not None:
            conf = self.directory / "redis.conf"
            conf.write_text("\n".join(self.config_lines) + "\n")
            return [binary, str(conf), *common]
        return [binary, "--port", str(self.port), *common]

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        offset = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen(
            self._command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited: {err.strip() or self._log_tail(offset)}")
            if "Ready to accept connections" in self._log_tail(offset):
                return
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"redis-server did not start: {self._log_tail(offset)}")

    def _log_tail(self, offset: int) -> str:
        try:
            with self.log.open("rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no goodbye to clients, exactly like a crash."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
        else:
            self.proc = None
            if proc.stderr is not None:
                proc.stderr.close()


@contextlib.contextmanager
def running_redis(directory: Path, host: str = "127.0.0.1") -> Iterator[RedisProcess]:
    """A started redis-server for one test, stopped after it; fails the test (not skips it)
    when redis-server is missing, as ``make test`` installs it."""
    if redis_server_path() is None:
        pytest.fail("redis-server is not installed (make test installs it)")
    server = RedisProcess(directory, host=host)
    server.start()
    try:
        yield server
    finally:
        server.stop()
