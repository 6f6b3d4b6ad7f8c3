"""The SDK scenario's checks that need relay: the app port behind the traffic token (HTTP and
WebSocket), relay's answers for a wrong token, an unknown sandbox and a sandbox without a route,
and what the SDK sees once the main sandbox's route is removed.

Runs in the SDK's virtualenv like the scenario: only the standard library and ``e2b``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from e2b import Sandbox

from tests.support.sdk_scenario_http import app_request, fetch, ws_handshake, ws_recv, ws_send
from tests.support.sdk_scenario_run import CONFIG, OPTS, expect


def relay_checks(sbx: Any) -> list[tuple[str, Callable[[], object]]]:
    port = int(CONFIG["app_port"])
    token = sbx.traffic_access_token

    def app_port() -> None:
        expect(bool(token), "the API gave no traffic access token")
        expect(sbx.get_host(port) == f"{port}-{sbx.sandbox_id}.{os.environ['E2B_DOMAIN']}", "host")
        url, headers = app_request(sbx, port, "/")
        status, body, _ = fetch(url, headers=headers)
        expect(status == 403 and b"is missing" in body, f"no token: HTTP {status} {body!r}")
        status, body, _ = fetch(url, headers=headers | {"E2b-Traffic-Access-Token": "wrong"})
        expect(status == 403 and b"is invalid" in body, f"wrong token: HTTP {status} {body!r}")
        status, body, _ = fetch(url, headers=headers | {"E2b-Traffic-Access-Token": token})
        expect(status == 200, f"with token: HTTP {status} {body!r}")
        seen = {name.lower() for name, _ in json.loads(body)["headers"]}
        expect("e2b-traffic-access-token" not in seen, f"token reached the app: {seen}")

    def websocket() -> None:
        url, headers = app_request(sbx, port, "/ws")
        sock, status = ws_handshake(url, headers)
        sock.close()
        expect(status == 403, f"handshake without token answered {status}")
        sock, status = ws_handshake(url, headers | {"E2b-Traffic-Access-Token": token})
        with sock:
            expect(status == 101, f"handshake answered {status}")
            ws_send(sock, 0x1, b"hello ws")
            expect(ws_recv(sock) == (0x1, b"hello ws"), "text echo")
            ws_send(sock, 0x2, bytes(range(256)) * 300)
            expect(ws_recv(sock) == (0x2, bytes(range(256)) * 300), "binary echo")
            ws_send(sock, 0x8, (1000).to_bytes(2, "big") + b"bye")
            opcode, payload = ws_recv(sock)
            expect(opcode == 0x8 and payload[:2] == (1000).to_bytes(2, "big"), repr(payload))

    def wrong_token() -> object:
        other = Sandbox.create(template=CONFIG["wrong_token_template"], **OPTS)
        return other.commands.run("echo never", timeout=10)

    def unknown_sandbox() -> object:
        return Sandbox.connect(CONFIG["unknown_sandbox_id"], **OPTS)

    def no_route() -> object:
        ghost = Sandbox.create(template=CONFIG["ghost_template"], **OPTS)
        return ghost.commands.run("echo never", timeout=10, request_timeout=10)

    def no_route_is_running() -> object:
        ghost = Sandbox.create(template=CONFIG["ghost_template"], **OPTS)
        return ghost.is_running()

    return [
        ("app port behind traffic token (403 without, 200 with)", app_port),
        ("WebSocket on app port", websocket),
        ("wrong envd token", wrong_token),
        ("unknown sandbox (control plane)", unknown_sandbox),
        ("sandbox without a route: commands.run", no_route),
        ("sandbox without a route: is_running()", no_route_is_running),
    ]


def after_removal_checks(sbx: Any) -> list[tuple[str, Callable[[], object]]]:
    def run_after() -> object:
        return sbx.commands.run("echo gone", timeout=10, request_timeout=10)

    return [
        ("is_running() after route removed", sbx.is_running),
        ("commands.run after route removed", run_after),
    ]
