"""The fake control-plane API answers in the SDK's model shapes."""

from __future__ import annotations

import aiohttp

from tests.support.fake_api import FakeApi, SandboxInfo

SANDBOX = SandboxInfo(sandbox_id="ixk3q7abcdefghij", envd_access_token="tok", domain="e2b.test")


async def test_connect_create_info_kill(http: aiohttp.ClientSession) -> None:
    created = SandboxInfo(sandbox_id="newsandbox0000000000")
    async with FakeApi([SANDBOX], created=created, api_key="e2b_key") as api:
        headers = {"X-API-Key": "e2b_key"}
        for path in (
            "/v2/sandboxes/ixk3q7abcdefghij/connect",
            "/sandboxes/ixk3q7abcdefghij/connect",
        ):
            async with http.post(f"{api.url}{path}", json={"timeout": 60}, headers=headers) as r:
                assert r.status == 200
                assert await r.json() == {
                    "templateID": "base",
                    "sandboxID": "ixk3q7abcdefghij",
                    "clientID": "fakeclient",
                    "envdVersion": "0.6.13",
                    "envdAccessToken": "tok",
                    "domain": "e2b.test",
                }
        async with http.post(f"{api.url}/v2/sandboxes", json={}, headers=headers) as r:
            assert r.status == 201
            assert (await r.json())["sandboxID"] == created.sandbox_id
        async with http.get(f"{api.url}/sandboxes/ixk3q7abcdefghij", headers=headers) as r:
            assert (await r.json())["state"] == "running"
        async with http.delete(f"{api.url}/sandboxes/ixk3q7abcdefghij", headers=headers) as r:
            assert r.status == 204
        async with http.post(
            f"{api.url}/v2/sandboxes/ixk3q7abcdefghij/connect", headers=headers
        ) as r:
            assert r.status == 404
        async with http.get(f"{api.url}/health") as r:
            assert r.status == 401
    assert api.killed == ["ixk3q7abcdefghij"]


async def test_create_by_template(http: aiohttp.ClientSession) -> None:
    other = SandboxInfo(sandbox_id="othersandbox", envd_access_token="other")
    async with FakeApi(templates={"base": SANDBOX, "other": other}) as api:
        for template, sandbox_id in (("other", "othersandbox"), ("base", SANDBOX.sandbox_id)):
            body = {"templateID": template, "timeout": 300}
            async with http.post(f"{api.url}/sandboxes", json=body) as r:
                assert r.status == 201
                assert (await r.json())["sandboxID"] == sandbox_id
        async with http.post(f"{api.url}/v2/sandboxes", json={"templateID": "nope"}) as r:
            assert r.status == 404
        # A created sandbox is known afterwards, as after a real create.
        async with http.post(f"{api.url}/v2/sandboxes/othersandbox/connect", json={}) as r:
            assert (await r.json())["envdAccessToken"] == "other"
