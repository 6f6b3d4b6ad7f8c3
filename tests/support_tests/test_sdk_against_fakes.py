"""The real e2b SDK (2.52.0, unmodified) against the fake envd and fake API, no relay.

The SDK lives in its own virtualenv under tests/.cache/ (gitignored), created on first use by
``tests/support/sdk_venv.py``; the test is skipped, saying why, when the package index cannot be
reached. The scenario itself is tests/support/sdk_scenario.py (the driver of the SDK matrix in
tests/test_sdk_matrix.py, here in its "direct" form); every check it reports must pass.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.support.fake_api import FakeApi, SandboxInfo
from tests.support.fake_envd import FakeEnvd
from tests.support.sdk_venv import SdkUnavailable, ensure_sdk
from tests.support_tests.conftest import TOKEN

SDK_VERSION = "2.52.0"
SCENARIO = Path(__file__).resolve().parents[1] / "support" / "sdk_scenario.py"
SANDBOX_ID = "ixk3q7abcdefghij"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def sdk_python() -> Path:
    try:
        return ensure_sdk(SDK_VERSION)[0]
    except SdkUnavailable as exc:
        pytest.skip(str(exc))


async def run_scenario(python: Path, envd: FakeEnvd, api: FakeApi) -> list[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env |= {
        "E2B_API_URL": api.url,
        "E2B_SANDBOX_URL": envd.url,
        "E2B_API_KEY": "e2b_" + "0" * 40,
        "E2B_DOMAIN": "sandbox.localhost",
        "SCENARIO_CONFIG": json.dumps({"form": "direct", "sandbox_id": SANDBOX_ID}),
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
    checks = [line for line in lines if "check" in line]
    assert checks, stderr.decode()
    return checks


@pytest.mark.parametrize("token", [None, TOKEN], ids=["gateway-auth", "envd-token"])
async def test_sdk_scenario_passes(sdk_python: Path, token: str | None) -> None:
    sandbox = SandboxInfo(sandbox_id=SANDBOX_ID, envd_access_token=token)
    expected = {"is_running() while routed": "returned True"}
    if token is None:
        # SDK contract: a signature (and so an expiration) needs a secured sandbox.
        unsigned = "InvalidArgumentException: Signature expiration can be used only when sandbox"
        expected |= {
            "download_url with expiration": unsigned,
            "upload_url with expiration": unsigned,
        }
    async with (
        FakeEnvd(access_token=token) as envd,
        FakeApi([sandbox], templates={"base": sandbox}) as api,
    ):
        results = await run_scenario(sdk_python, envd, api)
    failures = [
        f"{r['check']}: {r['observed']}\n{r['detail']}"
        for r in results
        if not r["observed"].startswith(expected.get(r["check"], "ok"))
    ]
    assert not failures, "\n".join(failures)
    assert len(results) >= 20
    rpc = [r for r in envd.records if r.path.startswith("/process.Process/")]
    assert rpc
    assert all(r.header("E2b-Sandbox-Id") == SANDBOX_ID for r in rpc)
    assert all(r.has_header("X-Access-Token") == (token is not None) for r in rpc)
