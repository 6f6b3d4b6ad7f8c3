"""A fake E2B control-plane API, just enough for the SDK to obtain a sandbox handle.

The SDK asks the API for a sandbox (``Sandbox.create`` → ``POST /v2/sandboxes``,
``Sandbox.connect`` → ``POST /v2/sandboxes/{id}/connect``; SDK 2.25 used the paths without
``/v2``) and reads from the answer which envd version it talks to, the envd access token and the
domain it dials. Field names are those of the SDK's generated models
(``e2b/api/client/models/sandbox.py``, ``sandbox_detail.py``). Everything else about a sandbox
is the fake envd's business.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from tests.support.fake_envd import ENVD_VERSION
from tests.support.fake_server import FakeServer, read_body
from tests.support.records import RecordHandle


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxInfo:
    sandbox_id: str
    envd_version: str = ENVD_VERSION
    envd_access_token: str | None = None
    traffic_access_token: str | None = None
    domain: str | None = None
    template_id: str = "base"
    client_id: str = "fakeclient"

    def to_json(self) -> dict[str, Any]:
        """The API's ``Sandbox`` model (create/connect answers)."""
        body: dict[str, Any] = {
            "templateID": self.template_id,
            "sandboxID": self.sandbox_id,
            "clientID": self.client_id,
            "envdVersion": self.envd_version,
        }
        if self.envd_access_token is not None:
            body["envdAccessToken"] = self.envd_access_token
        if self.traffic_access_token is not None:
            body["trafficAccessToken"] = self.traffic_access_token
        if self.domain is not None:
            body["domain"] = self.domain
        return body

    def detail_json(self) -> dict[str, Any]:
        """The API's ``SandboxDetail`` model (GET /sandboxes/{id})."""
        now = datetime.now(UTC)
        body = self.to_json()
        body.pop("trafficAccessToken", None)
        return body | {
            "startedAt": now.isoformat(),
            "endAt": (now + timedelta(minutes=5)).isoformat(),
            "cpuCount": 2,
            "memoryMB": 512,
            "diskSizeMB": 1024,
            "state": "running",
        }


_CONNECT = re.compile(r"^(?:/v2)?/sandboxes/([^/]+)/connect$")
_CREATE = re.compile(r"^(?:/v2)?/sandboxes$")
_ONE = re.compile(r"^/sandboxes/([^/]+)$")
_TIMEOUT = re.compile(r"^/sandboxes/([^/]+)/timeout$")


class FakeApi(FakeServer):
    """Known sandboxes answer connect/info/kill; ``create`` hands out the sandbox that
    ``templates`` maps the requested ``templateID`` to, else ``created`` (else 404)."""

    def __init__(
        self,
        sandboxes: Iterable[SandboxInfo] = (),
        *,
        created: SandboxInfo | None = None,
        templates: Mapping[str, SandboxInfo] | None = None,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(host=host, port=port)
        self.sandboxes: dict[str, SandboxInfo] = {s.sandbox_id: s for s in sandboxes}
        self.created = created
        self.templates = dict(templates or {})
        self.api_key = api_key
        self.killed: list[str] = []

    def add(self, sandbox: SandboxInfo) -> None:
        self.sandboxes[sandbox.sandbox_id] = sandbox

    async def _handle(self, request: web.BaseRequest, record: RecordHandle) -> web.StreamResponse:
        body = await read_body(request, record)
        if self.api_key is not None and request.headers.get("X-API-Key") != self.api_key:
            return _error(401, "Invalid API key")
        method, path = request.method, request.path
        if method == "GET" and path == "/health":
            return web.Response(status=200, text="ok")
        if method == "POST" and (match := _CONNECT.match(path)):
            return self._with_sandbox(match[1], lambda s: _json(200, s.to_json()))
        if method == "POST" and _CREATE.match(path):
            return self._create(body)
        if match := _ONE.match(path):
            if method == "GET":
                return self._with_sandbox(match[1], lambda s: _json(200, s.detail_json()))
            if method == "DELETE":
                return self._with_sandbox(match[1], self._kill)
        if method == "POST" and (match := _TIMEOUT.match(path)):
            return self._with_sandbox(match[1], lambda s: web.Response(status=204))
        return _error(404, f"{method} {path} is not served by the fake API")

    def _with_sandbox(self, sandbox_id: str, answer: Any) -> web.Response:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            return _error(404, f"sandbox \"{sandbox_id}\" doesn't exist or you don't have access")
        response: web.Response = answer(sandbox)
        return response

    def _create(self, body: bytes) -> web.Response:
        try:
            template = json.loads(body).get("templateID") if body else None
        except (ValueError, AttributeError):
            return _error(400, "request body is not a JSON object")
        sandbox = self.templates.get(template) if isinstance(template, str) else None
        sandbox = sandbox or self.created
        if sandbox is None:
            return _error(404, f"the fake API was given no sandbox to create from {template!r}")
        self.add(sandbox)
        return _json(201, sandbox.to_json())

    def _kill(self, sandbox: SandboxInfo) -> web.Response:
        self.killed.append(sandbox.sandbox_id)
        del self.sandboxes[sandbox.sandbox_id]
        return web.Response(status=204)


def _json(status: int, body: Mapping[str, Any]) -> web.Response:
    return web.Response(
        status=status, body=json.dumps(body).encode(), content_type="application/json"
    )


def _error(status: int, message: str) -> web.Response:
    return _json(status, {"code": status, "message": message})
