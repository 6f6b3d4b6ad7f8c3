"""What the benchmark runs: the origins, nginx as a proxy, relay, each pinned to its cores.

Layout on this 2-core machine (see bench/README.md, "Setup and pinning"):

    core 0: load generator (wrk / bench.clients) + origins (nginx origin, bench.origin)
    core 1: the proxy under test, 1 worker (nginx or relay)
    cores 0,1: the proxy under test with 2 workers (it then competes with core 0's work)

All traffic is on loopback. Routing is by Host ``<port>-<sandbox>.sandbox.localhost`` for every
column, so direct, nginx and relay answer the very same requests.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

from bench.origin import blob_pattern
from bench.procs import Proc, http_get, spawn, tool_env, wait_port

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PRODUCT_BIN = ROOT / ".venv" / "bin"

DOMAIN = "sandbox.localhost"
SANDBOX = "bench"  # application ports, public (no traffic_token)
ENVD_SANDBOX = "benchenvd"  # the envd port 49983 on its own loopback address
ENVD_ADDRESS = "127.0.0.2"
ENVD_PORT = 49983
ENVD_TOKEN = "bench-envd-token-0123456789abcdef"  # a made-up token, loopback only

ORIGIN_APP_PORT = 18081  # nginx origin: /small, /blob
ORIGIN_PY_PORT = 18082  # bench.origin: /upload, /stream, /ws
# Each proxy column listens on its own port, so that all of them run at once and the
# workloads can visit the columns in turn (interleaved repetitions, see bench/README.md).
PROXY_PORTS = {
    ("nginx", 1, True): 18090,
    ("relay", 1, True): 18091,
    ("nginx", 2, True): 18093,
    ("relay", 2, True): 18094,
    ("nginx", 1, False): 18095,
    ("relay", 1, False): 18096,
    ("floor", 1, True): 18098,  # bench.floor: a bare uvloop forwarder to the Python origin
}
COMPARE_PORT = 18097
ADMIN_PORT_OFFSET = 100  # relay's admin listener: data port + 100

LOAD_CPUS = (0,)
ORIGIN_CPUS = (0,)
PROXY_CPUS = {1: (1,), 2: (0, 1)}

HOST_APP = f"{ORIGIN_APP_PORT}-{SANDBOX}.{DOMAIN}"
HOST_PY = f"{ORIGIN_PY_PORT}-{SANDBOX}.{DOMAIN}"
HOST_ENVD = f"{ENVD_PORT}-{ENVD_SANDBOX}.{DOMAIN}"


@dataclass(frozen=True)
class Column:
    """One side-by-side column: direct, or a proxy with a worker count."""

    name: str
    kind: str  # "direct" | "nginx" | "relay" | "floor"
    workers: int = 1
    access_log: bool = True
    src: str = ""  # relay only: another source tree (A/B runs of bench.profile --compare)

    @property
    def label(self) -> str:
        """Unique per process: the no-access-log variants get a suffix."""
        return self.name if self.access_log else f"{self.name}-nolog"

    @property
    def port(self) -> int:
        if self.src:
            return COMPARE_PORT
        return PROXY_PORTS[(self.kind, self.workers, self.access_log)]

    def address(self, service: str) -> str:
        """Where a client connects for ``service`` ("app", "py" or "envd")."""
        if self.kind != "direct":
            return f"127.0.0.1:{self.port}"
        return {
            "app": f"127.0.0.1:{ORIGIN_APP_PORT}",
            "py": f"127.0.0.1:{ORIGIN_PY_PORT}",
            "envd": f"{ENVD_ADDRESS}:{ENVD_PORT}",
        }[service]


def busy_ports() -> list[str]:
    """Every address the bench listens on that something else already holds.

    nginx listens with ``reuseport``: started beside a leftover process on the same port it
    would share the port without an error, and the run would measure the leftover."""
    wanted = [
        ("127.0.0.1", ORIGIN_APP_PORT),
        ("127.0.0.1", ORIGIN_PY_PORT),
        (ENVD_ADDRESS, ENVD_PORT),
    ]
    for port in (*PROXY_PORTS.values(), COMPARE_PORT):
        wanted += [("127.0.0.1", port), ("127.0.0.1", port + ADMIN_PORT_OFFSET)]
    busy = []
    for host, port in wanted:
        with socket.socket() as probe:
            # SO_REUSEADDR: connections of an earlier run in TIME_WAIT do not count as busy;
            # a listener still does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                busy.append(f"{host}:{port}")
    return busy


def render(template: Path, values: dict[str, str]) -> str:
    text = template.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


class Stack:
    """Starts and stops the processes of one benchmark run, all under ``run_dir``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[Proc] = []
        self.nginx = shutil.which("nginx")
        self.origin_nginx = False
        self.blob_crc = 0
        self.blob_size = 0
        self.values = {
            "RUNDIR": str(run_dir),
            "ORIGIN_APP_PORT": str(ORIGIN_APP_PORT),
            "ORIGIN_PY_PORT": str(ORIGIN_PY_PORT),
            "ENVD_ADDRESS": ENVD_ADDRESS,
            "ENVD_TOKEN": ENVD_TOKEN,
        }

    # -- origins ---------------------------------------------------------------------------
    def start_origins(self) -> None:
        www = self.run_dir / "www"
        www.mkdir(parents=True, exist_ok=True)
        blob = blob_pattern()
        (www / "blob").write_bytes(blob)
        self.blob_crc = zlib.crc32(blob)
        self.blob_size = len(blob)
        listen = [f"127.0.0.1:{ORIGIN_PY_PORT}"]
        if self.nginx:
            conf = self.run_dir / "origin-nginx.conf"
            conf.write_text(render(BENCH / "nginx" / "origin.conf", self.values))
            proc = spawn(
                "origin-nginx",
                [self.nginx, "-c", str(conf), "-e", str(self.run_dir / "origin-nginx.err")],
                ORIGIN_CPUS,
                stderr=self.run_dir / "origin-nginx.err",
            )
            self.procs.append(proc)
            wait_port("127.0.0.1", ORIGIN_APP_PORT, proc=proc)
            wait_port(ENVD_ADDRESS, ENVD_PORT, proc=proc)
            self.origin_nginx = True
        else:  # the Python origin plays every part (slower: direct numbers drop)
            listen += [f"127.0.0.1:{ORIGIN_APP_PORT}", f"{ENVD_ADDRESS}:{ENVD_PORT}"]
        argv = [sys.executable, "-m", "bench.origin"]
        for address in listen:
            argv += ["--listen", address]
        proc = spawn(
            "origin-py",
            argv,
            ORIGIN_CPUS,
            stdout=self.run_dir / "origin-py.log",
            stderr=self.run_dir / "origin-py.log",
            env=tool_env(),
            cwd=ROOT,
        )
        self.procs.append(proc)
        wait_port("127.0.0.1", ORIGIN_PY_PORT, proc=proc)

    # -- proxies -----------------------------------------------------------------------------
    def start_proxy(self, column: Column) -> Proc | None:
        if column.kind == "nginx":
            return self._start_nginx(column)
        if column.kind == "relay":
            return self._start_relay(column)
        if column.kind == "floor":
            return self._start_floor(column)
        return None

    def _start_floor(self, column: Column) -> Proc:
        """bench.floor on the proxy core, forwarding every connection to the Python origin."""
        argv = [
            sys.executable,
            "-m",
            "bench.floor",
            "--listen",
            f"127.0.0.1:{column.port}",
            "--upstream",
            f"127.0.0.1:{ORIGIN_PY_PORT}",
        ]
        err = self.run_dir / f"{column.label}.err"
        proc = spawn(
            column.label, argv, PROXY_CPUS[column.workers], stderr=err, env=tool_env(), cwd=ROOT
        )
        self.procs.append(proc)
        wait_port("127.0.0.1", column.port, proc=proc)
        return proc

    def _start_nginx(self, column: Column) -> Proc:
        assert self.nginx is not None
        values = dict(self.values, WORKERS=str(column.workers), PROXY_PORT=str(column.port))
        values["NAME"] = column.label
        log = self.run_dir / f"{column.label}.access.log"
        values["ACCESS_LOG"] = f"{log} combined" if column.access_log else "off"
        conf = self.run_dir / f"{column.label}.conf"
        conf.write_text(render(BENCH / "nginx" / "proxy.conf", values))
        err = self.run_dir / f"{column.label}.err"
        proc = spawn(
            column.label,
            [self.nginx, "-c", str(conf), "-e", str(err)],
            PROXY_CPUS[column.workers],
            stderr=err,
        )
        self.procs.append(proc)
        wait_port("127.0.0.1", column.port, proc=proc)
        self._check_route(proc, column.port)
        return proc

    def _start_relay(self, column: Column) -> Proc:
        routes = {
            "routes": [
                {"sandbox_id": SANDBOX, "address": "127.0.0.1", "envd_token": ENVD_TOKEN},
                {"sandbox_id": ENVD_SANDBOX, "address": ENVD_ADDRESS, "envd_token": ENVD_TOKEN},
            ]
        }
        (self.run_dir / "routes.json").write_text(json.dumps(routes, indent=2))
        conf = self.run_dir / f"{column.label}.toml"
        conf.write_text(
            "\n".join(
                [
                    "# relay under benchmark (written by bench/stack.py)",
                    "[listen]",
                    f'address = "127.0.0.1:{column.port}"',
                    "max_connections = 16000  # the idle test holds 10,000",
                    "[admin]",
                    f'address = "127.0.0.1:{column.port + ADMIN_PORT_OFFSET}"',
                    "[routing]",
                    f'domains = ["{DOMAIN}"]',
                    "[routes]",
                    'source = "file"',
                    'file = "routes.json"',
                    "[process]",
                    f"workers = {column.workers}",
                    "",
                ]
            )
        )
        argv = [
            str(PRODUCT_BIN / "python"),
            "-m",
            "relay",
            "serve",
            "--config",
            str(conf),
            "--log-level",
            "INFO" if column.access_log else "WARNING",
        ]
        env = dict(os.environ)
        relay_src = column.src or os.environ.get("BENCH_RELAY_SRC")
        if relay_src:  # bench another checkout (e.g. a scratch copy) with the same venv
            env["PYTHONPATH"] = relay_src
        proc = spawn(
            column.label,
            argv,
            PROXY_CPUS[column.workers],
            stdout=self.run_dir / f"{column.label}.access.log",
            stderr=self.run_dir / f"{column.label}.err",
            env=env,
            # Not the repository: `python -m` puts the working directory first on sys.path,
            # which would shadow BENCH_RELAY_SRC.
            cwd=self.run_dir,
        )
        self.procs.append(proc)
        wait_port("127.0.0.1", column.port, proc=proc)
        wait_port("127.0.0.1", column.port + ADMIN_PORT_OFFSET, proc=proc)
        self._check_route(proc, column.port)
        return proc

    def _check_route(self, proc: Proc, port: int) -> None:
        answer = http_get("127.0.0.1", port, "/small", HOST_APP)
        if not answer.startswith(b"HTTP/1.1 200") or not answer.endswith(b"hello, world\n"):
            raise RuntimeError(f"{proc.name} does not route /small: {answer[:200]!r}")

    def pids(self) -> list[int]:
        """Every process of the stack (nginx workers included)."""
        return [pid for proc in self.procs for pid in proc.tree()]

    def stop(self, proc: Proc | None) -> None:
        if proc is None:
            return
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        blob = self.run_dir / "www" / "blob"
        if blob.exists():
            blob.unlink()


def signed_files_path() -> str:
    """A signed ``GET /files`` URL made by relay's own ``sign-url`` (as the SDK makes it)."""
    env = dict(os.environ, BENCH_ENVD_TOKEN=ENVD_TOKEN)
    url = subprocess.run(
        [
            str(PRODUCT_BIN / "relay"),
            "sign-url",
            "--url",
            f"http://{HOST_ENVD}",
            "--path",
            "/home/user/data.txt",
            "--op",
            "read",
            "--user",
            "user",
            "--token-env",
            "BENCH_ENVD_TOKEN",
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    return url[url.index("/files") :]
