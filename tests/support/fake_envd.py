"""A fake envd (the daemon on port 49983 inside every E2B sandbox) that speaks envd's real wire
format, so that the unmodified ``e2b`` SDK, and a relay in front of it, can be tested on loopback.

Usage::

    async with FakeEnvd() as envd:                       # envd without a token (gateway auth)
        ...  envd.url, envd.port, envd.root, envd.records, envd.break_streams()

    async with FakeEnvd(access_token="tok") as envd:     # envd that checks X-Access-Token itself
        ...

Request handling follows envd's ``main.go`` middleware order: Go's target parsing → CORS
(rs/cors) → access token (``internal/api/auth.go WithAuthorization``) → Basic-auth user
(``permissions/authenticate.go``) → routes (chi, on the path as sent: the generated
``api.gen.go`` routes plus the Connect handlers of ``process.Process`` and
``filesystem.Filesystem``; see ``envd_routes``). See the ``envd_*`` modules for each part.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from tests.support import envd_cors, go_json
from tests.support.connect import ConnectError, JSONDict
from tests.support.envd_connect_handler import ConnectHandler, connect_error_answer
from tests.support.envd_file_access import json_error
from tests.support.envd_files import CORS_FIELDS, FilesApi
from tests.support.envd_filesystem import FilesystemService
from tests.support.envd_process import ProcessService
from tests.support.envd_routes import GoPath, parse_target, route
from tests.support.fake_server import FakeServer
from tests.support.records import RecordHandle
from tests.support.sandbox_fs import DEFAULT_USER, USERS, SandboxFS, SandboxUser

ENVD_PORT = 49983
ENVD_VERSION = "0.6.13"  # the infra snapshot's envd (packages/envd/pkg/version.go)

# auth.go authExcludedPaths: method + path, exact match.
AUTH_EXCLUDED = frozenset({"GET/health", "GET/files", "POST/files", "POST/init"})
UNAUTHORIZED = (
    "unauthorized access, please provide a valid access token or method signing if supported"
)
# Orchestrator-only routes (spec/envd.yaml x-internal, plus /upgrade). A relay must never let a
# request reach them; the fake answers them so that a leak is visible in the records.
CONTROL_PATHS = frozenset(
    {"/init", "/freeze", "/unfreeze", "/collapse", "/fsfreeze", "/fsthaw", "/upgrade"}
)


def sdk_start_request(command: str, *, stdin: bool = False) -> JSONDict:
    """A Process.Start request exactly as SDK 2.52 ``commands.run`` builds it (notes §2.2)."""
    return {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", command]}, "stdin": stdin}


# Headers SDK 2.52 sends on a streaming RPC besides the routing/auth ones (notes §2.2).
SDK_STREAM_HEADERS: Mapping[str, str] = {
    "Keepalive-Ping-Interval": "50",
    "User-Agent": "connectrpc/0.11.1",
    "Connect-Protocol-Version": "1",
    "Connect-Accept-Encoding": "identity",
    "Connect-Content-Encoding": "identity",
    "Accept-Encoding": "zstd,gzip,br",
}


class FakeEnvd(FakeServer):
    # envd main.go: IdleTimeout 640 s ("downstream timeout should be greater than upstream").
    keepalive_timeout_s = 640.0

    def __init__(
        self,
        *,
        access_token: str | None = None,
        root: Path | None = None,
        env_vars: Mapping[str, str] | None = None,
        watch_poll_interval: float = 0.05,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(host=host, port=port)
        self.access_token = access_token
        self._owns_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="fake-envd-")) if root is None else root
        self.fs = SandboxFS(self.root)
        self.env_vars = dict(env_vars or {})
        self.process = ProcessService(self.fs, self.env_vars)
        self.filesystem = FilesystemService(self.fs, poll_interval=watch_poll_interval)
        self.files = FilesApi(self.fs, access_token)
        self.rpc = ConnectHandler(
            unary={**self.process.unary_methods(), **self.filesystem.unary_methods()},
            streams={**self.process.stream_methods(), **self.filesystem.stream_methods()},
        )

    def break_streams(self, *, reset: bool = True, mid_envelope: bool = False) -> int:
        """End every in-flight exchange abruptly (see FakeServer.break_streams).

        ``mid_envelope``: first send, in its own chunk, the start of an envelope (a header that
        announces 64 bytes, then 8 of them) on every live Connect stream, as when envd dies in
        the middle of writing an event; those connections then end with a FIN so that the partial
        envelope surely reaches the peer before the connection ends.
        """
        if mid_envelope:
            partial = struct.pack(">BI", 0, 64) + b'{"event"'
            for transport in list(self.rpc.stream_transports):
                transport.write(b"%x\r\n%s\r\n" % (len(partial), partial))
                transport.close()
        return super().break_streams(reset=reset)

    def host_path(self, sandbox_path: str) -> Path:
        """Where a sandbox path lives on this machine (for arranging and checking files)."""
        return self.fs.host(sandbox_path)

    async def _before_close(self) -> None:
        await self.process.close()
        await self.filesystem.close()

    async def _after_close(self) -> None:
        if self._owns_root:
            await asyncio.to_thread(shutil.rmtree, self.root, True)

    # -- dispatch -------------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest, record: RecordHandle) -> web.StreamResponse:
        target = parse_target(request.raw_path)
        if target is None:
            # net/http's answer to a target url.ParseRequestURI refuses (a bad % escape),
            # written before any handler (and so before rs/cors) runs.
            refused = web.Response(
                status=400,
                body=b"400 Bad Request",
                headers={"Content-Type": "text/plain; charset=utf-8"},
            )
            refused.force_close()  # net/http closes the connection after it
            return refused
        if envd_cors.is_preflight(request):
            return envd_cors.preflight(request)
        # rs/cors sets its fields before envd's handler runs: a handler that streams its
        # answer (a download) sends them with its head (FilesApi reads them from here).
        request[CORS_FIELDS] = envd_cors.actual_fields(request)
        response = await self._authorized(request, record, target)
        if not response.prepared:
            cors = request[CORS_FIELDS]
            if "Vary" in response.headers:  # the handler's Set replaced rs/cors's Vary
                cors = [pair for pair in cors if pair[0] != "Vary"]
            response.headers.extend(cors)
        return response

    async def _authorized(
        self, request: web.BaseRequest, record: RecordHandle, target: GoPath
    ) -> web.StreamResponse:
        if self.access_token is not None:
            # auth.go:50 compares the decoded URL.Path, not the path chi routes on.
            token = request.headers.get("X-Access-Token", "")
            if token != self.access_token and request.method + target.path not in AUTH_EXCLUDED:
                return json_error(401, UNAUTHORIZED)
        try:
            user = _basic_auth_user(request.headers.get("Authorization"))
        except ConnectError as error:
            return connect_error_answer(request, error)
        return await self._route(request, record, target, user)

    async def _route(
        self,
        request: web.BaseRequest,
        record: RecordHandle,
        target: GoPath,
        user: SandboxUser | None,
    ) -> web.StreamResponse:
        method, found = request.method, route(request.method, target)
        if found.mount:
            # The generated Connect handler switches on the decoded URL.Path.
            if not self.rpc.serves(target.path):
                return _not_found()
            if method != "POST":
                return web.Response(status=405, headers={"Allow": "POST"})
            return await self.rpc.serve(request, record, target.path, user or DEFAULT_USER)
        if found.static is None:
            if found.status == 404:
                return _not_found()
            # chi methodNotAllowedHandler: one Allow field per method, an empty body.
            return web.Response(status=405, headers=CIMultiDict(("Allow", m) for m in found.allow))
        routes = {
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/envs"): self._envs,
            ("GET", "/files"): self.files.download,
            ("POST", "/files"): self.files.upload,
        }
        handler = routes.get((method, found.static))
        if handler is not None:
            return await handler(request, record)
        if found.static in CONTROL_PATHS:
            return web.Response(status=204)
        # POST /files/compose: routed (and guarded by the token) as in envd, not implemented.
        return web.Response(status=501, body=b"fake envd: /files/compose is not implemented\n")

    # -- envd HTTP API --------------------------------------------------------------------------

    async def _health(self, request: web.BaseRequest, record: RecordHandle) -> web.Response:
        # store.go GetHealth: 204, no-store, and an explicitly empty Content-Type.
        return web.Response(status=204, headers={"Cache-Control": "no-store"})

    async def _metrics(self, request: web.BaseRequest, record: RecordHandle) -> web.Response:
        disk = shutil.disk_usage(self.root)
        metrics = {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": 0.0,
            "mem_total_mib": 1024,
            "mem_used_mib": 128,
            "mem_total": 1024 << 20,
            "mem_used": 128 << 20,
            "disk_used": disk.used,
            "disk_total": disk.total,
        }
        return _json_response(metrics)

    async def _envs(self, request: web.BaseRequest, record: RecordHandle) -> web.Response:
        return _json_response(self.env_vars, go_map=True)  # envs.go: a map


def _basic_auth_user(header: str | None) -> SandboxUser | None:
    """authenticate.go: a Basic-auth username names the Linux user; no header, default user."""
    if header is None or header[:6].lower() != "basic ":
        return None
    try:
        decoded = base64.b64decode(header[6:], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    username, colon, _ = decoded.partition(":")
    if not colon:
        return None
    user = USERS.get(username)
    if user is None:
        raise ConnectError("unauthenticated", f"invalid username: '{username}'")
    return user


def _not_found() -> web.Response:
    """Go's http.NotFound (chi's NotFound handler, and the Connect handlers' default case)."""
    return web.Response(
        status=404,
        body=b"404 page not found\n",
        headers={"Content-Type": "text/plain; charset=utf-8", "X-Content-Type-Options": "nosniff"},
    )


def _json_response(payload: Mapping[str, Any], *, go_map: bool = False) -> web.Response:
    return web.Response(
        status=200,
        body=go_json.encode(payload, sort_keys=go_map),
        headers={"Content-Type": "application/json", "Cache-Control": "no-store"},
    )
