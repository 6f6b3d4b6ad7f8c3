"""One run of the SDK matrix: a real ``e2b`` release driving fakes through a real relay process.

Topology of a run (all on loopback, nothing shared between runs, so runs go in parallel)::

    driver (sdk_scenario.py in the SDK's venv, or js/scenario.mjs under node)
      │  fixed form: E2B_API_URL = E2B_SANDBOX_URL = http://127.0.0.1:<relay>
      │  Host form:  https://api.<domain>, https://49983-<id>.<domain>, https://<port>-<id>.<domain>
      │              via HTTPS_PROXY → TunnelProxy → relay's TLS listener; CA in SSL_CERT_FILE
      │              (Python) or NODE_EXTRA_CA_CERTS (node; the JS SDK's ``proxy`` option)
      ▼
    relay serve (subprocess; stdout/stderr kept) ── no target ──▶ FakeApi (management upstream)
      ├── 49983 ──▶ FakeEnvd on 127.0.0.<n>:49983 (the address in the routes file)
      └── <port> ─▶ FakeApp on 127.0.0.<n>:<port>

Sandboxes: ``MAIN_ID`` (routed; envd and traffic tokens), ``WRONG_ID`` (routed, but the API
hands out another envd token), ``GHOST_ID`` (the API knows it, relay has no route),
``UNKNOWN_ID`` (nobody knows it). Tokens are random per run so that a scan of relay's output
cannot match by accident.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tests.support.certs import issue
from tests.support.fake_api import FakeApi, SandboxInfo
from tests.support.fake_app import FakeApp
from tests.support.fake_envd import ENVD_PORT, FakeEnvd
from tests.support.harness import DOMAIN, RelayProcess, route, write_routes
from tests.support.records import RequestRecord
from tests.support.tunnel_proxy import TunnelProxy

SCENARIO = Path(__file__).resolve().parent / "sdk_scenario.py"
FORMS = ("fixed", "host")
MAIN_ID = "sdkmatrixmain"
WRONG_ID = "sdkmatrixwrongtoken"
GHOST_ID = "sdkmatrixghost"
UNKNOWN_ID = "sdkmatrixunknown"
API_KEY = "e2b_" + "0" * 40
RUN_TIMEOUT_S = 180.0  # a run takes ~10 s; the SDK's own timeouts are 60 s
# How long a relay may take to become ready, or to re-read its routes file. The matrix starts
# ten relays at once; on two loaded cores (CI's ``make test``) one took 16-20 s to answer
# /readyz, past the former 10 s. Ready earlier, the wait ends earlier; a relay that exits
# fails at once (RelayProcess.start and _wait_routes watch the process).
READY_TIMEOUT_S = 60.0

# Variables of the test's own environment that must not reach the SDK process: the SDK's
# settings, proxies and trust stores are set per run.
_SCRUBBED = {"ssl_cert_file", "ssl_cert_dir", "requests_ca_bundle", "curl_ca_bundle"}
_SCRUBBED |= {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "nix_ssl_cert_file"}
_SCRUBBED |= {"node_extra_ca_certs", "node_options", "node_tls_reject_unauthorized"}


@dataclass(frozen=True)
class Driver:
    """How to start the driver process of one SDK release."""

    argv: tuple[str, ...]  # e.g. (<venv>/bin/python, sdk_scenario.py) or (node, scenario.mjs)
    language: Literal["python", "js"] = "python"
    env: tuple[tuple[str, str], ...] = ()  # more environment for the driver


def python_driver(python: Path) -> Driver:
    return Driver((str(python), str(SCENARIO)))


@dataclass
class Tokens:
    envd: str = field(default_factory=lambda: "envd-" + secrets.token_hex(24))
    traffic: str = field(default_factory=lambda: "tt-" + secrets.token_hex(16))
    wrong_route: str = field(default_factory=lambda: "envd-" + secrets.token_hex(24))
    wrong_api: str = field(default_factory=lambda: "envd-" + secrets.token_hex(24))
    ghost: str = field(default_factory=lambda: "envd-" + secrets.token_hex(24))

    def all(self) -> list[str]:
        return [self.envd, self.traffic, self.wrong_route, self.wrong_api, self.ghost]


@dataclass
class Check:
    name: str
    observed: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class RunResult:
    version: str
    form: str
    checks: dict[str, Check]
    info: list[dict[str, Any]]
    envd_records: list[RequestRecord]
    app_records: list[RequestRecord]
    api_records: list[RequestRecord]
    relay_output: str
    tunnels: list[str]
    refused: list[str]
    driver_stderr: str
    seconds: float
    tokens: Tokens
    app_port: int

    def access_log(self) -> list[dict[str, Any]]:
        """relay's JSON access-log lines."""
        lines = []
        for line in self.relay_output.splitlines():
            start = line.find("{")
            if start < 0:
                continue
            with contextlib.suppress(ValueError):
                entry = json.loads(line[start:])
                if isinstance(entry, dict) and "status" in entry and "method" in entry:
                    lines.append(entry)
        return lines


async def _bind_envd_and_app() -> tuple[FakeEnvd, FakeApp]:
    """FakeEnvd must listen on port 49983 (the SDK's envd port): pick a free 127.0.0.<n>."""
    last: OSError | None = None
    for _ in range(40):
        address = f"127.0.0.{random.randint(2, 254)}"
        envd = FakeEnvd(host=address, port=ENVD_PORT)
        try:
            await envd.start()
        except OSError as exc:
            last = exc
            await asyncio.to_thread(shutil.rmtree, envd.root, True)
            continue
        app = FakeApp(host=address)
        try:
            await app.start()
        except OSError as exc:
            last = exc
            await envd.close()
            continue
        return envd, app
    raise RuntimeError(f"no free 127.0.0.<n>:{ENVD_PORT}: {last}")


def _driver_env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("E2B_") and k.lower() not in _SCRUBBED and not k.startswith("PYTEST")
    }
    return env | {"PYTHONUNBUFFERED": "1", "E2B_API_KEY": API_KEY, "E2B_DOMAIN": DOMAIN} | extra


async def _wait_routes(relay: RelayProcess, count: int, timeout: float = READY_TIMEOUT_S) -> None:
    """Until relay's /readyz reports ``count`` routes (the file was re-read)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if relay.proc is not None and relay.proc.poll() is not None:
            raise RuntimeError(f"relay exited: {relay.output()}")
        with contextlib.suppress(OSError, ValueError):
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.admin_port)
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
            raw = await reader.read()
            writer.close()
            body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
            if body.get("routes") == count:
                return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"relay did not report {count} routes within {timeout} s")


async def run_all(
    drivers: dict[str, Driver], tmp: Path, forms: tuple[str, ...] = FORMS
) -> tuple[list[RunResult], float]:
    """Every release in every URL form, in parallel; the runs and the seconds they took.

    A run that raises is reported only once every other run has ended and cleaned up: left
    running, they were cancelled by ``uvloop.run`` on its way out, and one cancelled before its
    fakes were in its ``try`` left servers open whose ResourceWarning (an error under
    ``-W error``) kept ``loop.close()`` waiting forever (tests/support_tests/
    test_sdk_matrix_runs.py).
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcomes = await asyncio.gather(
        *(run_one(drivers[v], v, f, tmp / f"{v}-{f}") for v in drivers for f in forms),
        return_exceptions=True,
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    runs = [outcome for outcome in outcomes if isinstance(outcome, RunResult)]
    return runs, loop.time() - started


async def run_one(driver: Driver, version: str, form: str, tmp: Path) -> RunResult:
    started = time.monotonic()
    await asyncio.to_thread(tmp.mkdir, parents=True, exist_ok=True)
    tokens = Tokens()
    envd, app = await _bind_envd_and_app()
    main = SandboxInfo(
        sandbox_id=MAIN_ID,
        envd_access_token=tokens.envd,
        traffic_access_token=tokens.traffic,
        domain=DOMAIN,
    )
    wrong = SandboxInfo(sandbox_id=WRONG_ID, envd_access_token=tokens.wrong_api, domain=DOMAIN)
    ghost = SandboxInfo(sandbox_id=GHOST_ID, envd_access_token=tokens.ghost, domain=DOMAIN)
    api = FakeApi([main], templates={"base": main, "wrongtoken": wrong, "ghost": ghost})
    await api.start()
    routes = [
        route(MAIN_ID, envd.host, envd_token=tokens.envd, traffic_token=tokens.traffic),
        route(WRONG_ID, envd.host, envd_token=tokens.wrong_route),
    ]
    overrides: dict[str, dict[str, Any]] = {"management": {"upstream": api.url}}
    if form == "host":
        certs = issue(tmp / "pki", [f"*.{DOMAIN}", DOMAIN])
        overrides["listen"] = {"tls_cert": str(certs.cert_file), "tls_key": str(certs.key_file)}
    relay = RelayProcess(tmp, routes, overrides)
    proxy: TunnelProxy | None = None
    lines: list[dict[str, Any]] = []
    stderr = b""
    try:
        await asyncio.to_thread(relay.start, READY_TIMEOUT_S)
        config: dict[str, Any] = {
            "form": form,
            "sandbox_id": MAIN_ID,
            "relay": True,
            "api_direct_url": api.url,
            "app_port": app.port,
            "wrong_token_template": "wrongtoken",
            "ghost_template": "ghost",
            "unknown_sandbox_id": UNKNOWN_ID,
        }
        extra = {"SCENARIO_CONFIG": json.dumps(config), "NO_PROXY": "127.0.0.1,localhost"}
        if form == "fixed":
            extra |= {"E2B_API_URL": relay.url, "E2B_SANDBOX_URL": relay.url}
        else:
            proxy = await TunnelProxy(DOMAIN, ("127.0.0.1", relay.port)).start()
            trust = "SSL_CERT_FILE" if driver.language == "python" else "NODE_EXTRA_CA_CERTS"
            extra |= {
                "E2B_API_URL": f"https://api.{DOMAIN}",
                "HTTPS_PROXY": proxy.url,
                trust: str(certs.ca_file),
            }
        process = await asyncio.create_subprocess_exec(
            *driver.argv,
            env=_driver_env(extra | dict(driver.env)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=1 << 20,
        )
        stderr_task = asyncio.create_task(_read_all(process.stderr))
        try:
            async with asyncio.timeout(RUN_TIMEOUT_S):
                await _drive(process, relay, routes, lines)
        except TimeoutError:
            # Every row this run did not reach fails, with this line to say why.
            lines.append({"check": "scenario", "observed": f"timed out after {RUN_TIMEOUT_S} s"})
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            stderr = await stderr_task
    finally:
        await asyncio.to_thread(relay.stop)
        if proxy is not None:
            await proxy.close()
        await api.close()
        await app.close()
        await envd.close()
    checks = {
        line["check"]: Check(
            line["check"], line["observed"], line.get("detail", ""), line.get("seconds", 0.0)
        )
        for line in lines
        if "check" in line
    }
    return RunResult(
        version=version,
        form=form,
        checks=checks,
        info=[line["info"] for line in lines if "info" in line],
        envd_records=envd.records,
        app_records=app.records,
        api_records=api.records,
        relay_output=relay.output(),
        tunnels=list(proxy.tunnels) if proxy else [],
        refused=list(proxy.refused) if proxy else [],
        driver_stderr=stderr.decode(errors="replace"),
        seconds=time.monotonic() - started,
        tokens=tokens,
        app_port=app.port,
    )


async def _drive(
    process: asyncio.subprocess.Process,
    relay: RelayProcess,
    routes: list[dict[str, Any]],
    lines: list[dict[str, Any]],
) -> None:
    """Collect the driver's JSON lines; remove the main sandbox's route when it asks."""
    assert process.stdout is not None
    assert process.stdin is not None
    while raw := await process.stdout.readline():
        if not raw.startswith(b"{"):
            continue
        line = json.loads(raw)
        lines.append(line)
        if line.get("event") == "remove-route":
            # As a control plane would: rewrite the file; relay notices the change.
            write_routes(relay.routes_file, routes[1:])
            await _wait_routes(relay, len(routes) - 1)
            process.stdin.write(b"removed\n")
            await process.stdin.drain()
    await process.wait()


async def _read_all(stream: asyncio.StreamReader | None) -> bytes:
    return await stream.read() if stream is not None else b""
