"""The real e2b SDK (2.52.0, unmodified) against the fake envd and fake API.

The SDK lives in its own virtualenv under tests/.cache/ (gitignored), created on first use; the
test is skipped, saying why, when the package index cannot be reached. The scenario itself is
tests/support/sdk_scenario.py; every check it reports must pass.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fake_api import FakeApi, SandboxInfo
from tests.support.fake_envd import FakeEnvd
from tests.support_tests.conftest import TOKEN

SDK_VERSION = "2.52.0"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / f"sdk-e2b-{SDK_VERSION}"
SCENARIO = Path(__file__).resolve().parents[1] / "support" / "sdk_scenario.py"
SANDBOX_ID = "ixk3q7abcdefghij"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def sdk_python() -> Path:
    python = CACHE / "bin" / "python"
    marker = CACHE / ".installed"
    if marker.exists():
        return python
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(CACHE)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", f"e2b=={SDK_VERSION}"],
            check=True,
            timeout=300,
            env=env,
            capture_output=True,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        output = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"cannot install e2b=={SDK_VERSION} (package index unreachable?): {output!r}")
    marker.touch()
    return python


async def run_scenario(python: Path, envd: FakeEnvd, api: FakeApi) -> list[dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env |= {
        "E2B_API_URL": api.url,
        "E2B_SANDBOX_URL": envd.url,
        "E2B_API_KEY": "e2b_" + "0" * 40,
        "E2B_DOMAIN": "sandbox.localhost",
        "SCENARIO_SANDBOX_ID": SANDBOX_ID,
    }
    process = await asyncio.create_subprocess_exec(
        str(python),
        str(SCENARIO),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
    lines = [json.loads(line) for line in stdout.decode().splitlines() if line.startswith("{")]
    assert lines, stderr.decode()
    return lines


@pytest.mark.parametrize("token", [None, TOKEN], ids=["gateway-auth", "envd-token"])
async def test_sdk_scenario_passes(sdk_python: Path, token: str | None) -> None:
    sandbox = SandboxInfo(sandbox_id=SANDBOX_ID, envd_access_token=token)
    async with FakeEnvd(access_token=token) as envd, FakeApi([sandbox]) as api:
        results = await run_scenario(sdk_python, envd, api)
    failures = [f"{r['check']}: {r['detail']}" for r in results if not r["ok"]]
    assert not failures, "\n".join(failures)
    assert len(results) >= 20
    rpc = [r for r in envd.records if r.path.startswith("/process.Process/")]
    assert rpc
    assert all(r.header("E2b-Sandbox-Id") == SANDBOX_ID for r in rpc)
    assert all(r.has_header("X-Access-Token") == (token is not None) for r in rpc)
