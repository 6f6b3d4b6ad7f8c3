"""Drive a sandbox with the real ``e2b`` SDK and report what happened, one JSON line per check.

Runs in a separate virtualenv holding one exact ``e2b`` release (2.25.0, 2.52.0 or 2.64.0), so it
imports only the standard library and ``e2b``, and copes with the differences between those
releases (2.25 speaks httpx, 2.52+ pyqwest; 2.25 has no ``close_stdin``...).

The caller points the SDK at fakes or at relay with the usual environment (``E2B_API_URL``,
``E2B_SANDBOX_URL`` for the fixed-URL form, ``E2B_DOMAIN``, ``E2B_API_KEY``; ``HTTPS_PROXY`` and
``SSL_CERT_FILE`` for the Host form over TLS) and describes the run in ``SCENARIO_CONFIG``
(JSON)::

    form            "direct" (no relay), "fixed" (E2B_SANDBOX_URL) or "host" (https://<port>-<id>.<domain>)
    sandbox_id      the sandbox that ``Sandbox.create(template="base")`` hands out
    api_direct_url  the control plane reached without relay (for 2.25's connect() handle)
    relay           true: also run the checks that need relay (app port, errors, route removal)
    app_port        an app port behind the sandbox's traffic token (FakeApp: /, /ws)
    wrong_token_template, ghost_template, unknown_sandbox_id: see the relay checks below

Output lines:

- ``{"check": <name>, "observed": <str>, "detail": <str>, "seconds": <float>}``: ``observed`` is
  ``"ok"`` when the check returned nothing, ``"returned <repr>"`` when it returned a value, or
  ``"<ExceptionClass>: <message>"`` when it raised. The caller compares ``observed`` with what it
  expects for this SDK version and URL form; the exit status is 0 whatever happened.
- ``{"info": {...}}``: facts for debugging (SDK version, URLs the SDK built).
- ``{"event": "remove-route"}``: the driver then waits for one line on stdin, sent once the
  caller has removed the main sandbox's route from relay.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import socket
import ssl
import sys
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEventType,
    PtySize,
    Sandbox,
)

SDK_VERSION = importlib.metadata.version("e2b")
CONFIG: dict[str, Any] = json.loads(os.environ.get("SCENARIO_CONFIG") or "{}")
FORM: str = CONFIG.get("form", "direct")
MAIN_ID: str = CONFIG.get("sandbox_id", "")
PROXY = os.environ.get("HTTPS_PROXY")
# 2.52+ send everything through pyqwest (reqwest), which reads HTTPS_PROXY itself. 2.25 builds
# its httpx clients on an explicit transport object, and httpx ignores the proxy environment
# variables then: the SDK's own ``proxy`` option is the way in.
HTTPX_TRANSPORT = importlib.util.find_spec("pyqwest") is None
OPTS: dict[str, Any] = {"proxy": PROXY} if PROXY and HTTPX_TRANSPORT else {}
MIB = 1024 * 1024


class NotAvailable(Exception):
    """This SDK release has no API for the feature; reported as ``n/a: <reason>``."""


def emit(payload: dict[str, Any]) -> None:
    print(json.dumps(payload), flush=True)


def describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:400]


def observed_value(value: object) -> str:
    return "ok" if value is None else f"returned {value!r}"[:400]


def report(name: str, started: float, observed: str, detail: str = "") -> None:
    emit(
        {
            "check": name,
            "observed": observed,
            "detail": detail[:1500],
            "seconds": round(time.monotonic() - started, 3),
        }
    )


def run_check(name: str, check: Callable[[], object]) -> None:
    started = time.monotonic()
    try:
        value = check()
    except NotAvailable as exc:
        report(name, started, f"n/a: {exc}")
    except Exception as exc:
        report(name, started, describe(exc), traceback.format_exc(limit=4))
    else:
        report(name, started, observed_value(value))


async def run_async_check(name: str, check: Callable[[], Awaitable[object]]) -> None:
    started = time.monotonic()
    try:
        value = await check()
    except Exception as exc:
        report(name, started, describe(exc), traceback.format_exc(limit=4))
    else:
        report(name, started, observed_value(value))


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# -- plain HTTP clients (what a browser or curl would do with the SDK's URLs) -------------------


def fetch(
    url: str,
    *,
    method: str = "GET",
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    """urllib, through HTTPS_PROXY and SSL_CERT_FILE like any program; HTTP errors returned."""
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def app_request(sbx: Any, port: int, path: str) -> tuple[str, dict[str, str]]:
    """URL and headers that reach ``port`` in the sandbox, as a user of each URL form would."""
    if FORM == "host":
        return f"https://{sbx.get_host(port)}{path}", {}
    base = os.environ["E2B_SANDBOX_URL"].rstrip("/")
    return f"{base}{path}", {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port)}


def open_socket(url: str) -> socket.socket:
    """A connection to ``url``'s origin: via a CONNECT tunnel and TLS for https."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "https":
        return socket.create_connection((host, parts.port or 80), timeout=15)
    proxy = urlsplit(PROXY or "")
    sock = socket.create_connection((proxy.hostname or "", proxy.port or 80), timeout=15)
    authority = f"{host}:{parts.port or 443}"
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    status, _ = read_head(sock)
    expect(status == 200, f"proxy answered CONNECT with {status}")
    return ssl.create_default_context().wrap_socket(sock, server_hostname=host)


def read_head(sock: socket.socket) -> tuple[int, dict[str, str]]:
    """Read a response head byte by byte (nothing after it is consumed)."""
    data = b""
    while not data.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        if not byte:
            raise ConnectionError(f"connection closed in the response head: {data!r}")
        data += byte
    lines = data.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ")[1]), headers


def recv_exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("connection closed in a WebSocket frame")
        data += chunk
    return data


def ws_send(sock: socket.socket, opcode: int, payload: bytes) -> None:
    """One masked client frame (RFC 6455 §5.2)."""
    head = bytes([0x80 | opcode])
    size = len(payload)
    if size < 126:
        head += bytes([0x80 | size])
    elif size < 65536:
        head += bytes([0x80 | 126]) + size.to_bytes(2, "big")
    else:
        head += bytes([0x80 | 127]) + size.to_bytes(8, "big")
    mask = os.urandom(4)
    sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def ws_recv(sock: socket.socket) -> tuple[int, bytes]:
    first, second = recv_exact(sock, 2)
    size = second & 0x7F
    if size == 126:
        size = int.from_bytes(recv_exact(sock, 2), "big")
    elif size == 127:
        size = int.from_bytes(recv_exact(sock, 8), "big")
    mask = recv_exact(sock, 4) if second & 0x80 else b""
    payload = recv_exact(sock, size)
    if mask:
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return first & 0x0F, payload


def ws_handshake(url: str, headers: dict[str, str]) -> tuple[socket.socket, int]:
    parts = urlsplit(url)
    sock = open_socket(url)
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [
        f"GET {parts.path or '/'} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    status, response_headers = read_head(sock)
    if status == 101:
        accept = base64.b64encode(
            hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()
        ).decode()
        expect(response_headers.get("sec-websocket-accept") == accept, "bad Sec-WebSocket-Accept")
    return sock, status


# -- handles ------------------------------------------------------------------------------------


def connect_handle() -> Any:
    """What ``Sandbox.connect(MAIN_ID)`` gives a user of this release.

    2.25's connect() puts E2b-Sandbox-Id/Port on the control-plane call (E2B PR #1272). relay
    ignores routing headers on ``api.<domain>``, so in the Host form the real connect() works
    through relay. With a fixed URL the API shares relay's address with envd and the headers
    route the call to envd (the "Sandbox.connect" check shows it); to still see what the envd
    calls of a 2.25 connect() handle do there (no routing headers; notes §1.2), the control
    plane is reached directly with the real ``Sandbox.connect(api_url=...)``.
    """
    if not HTTPX_TRANSPORT or not CONFIG.get("relay") or FORM == "host":
        return Sandbox.connect(MAIN_ID, **OPTS)
    return Sandbox.connect(MAIN_ID, api_url=CONFIG["api_direct_url"], **OPTS)


# -- checks on one sandbox handle (sync SDK) -----------------------------------------------------


def sandbox_checks(sbx: Any) -> list[tuple[str, Callable[[], object]]]:
    def run_output() -> None:
        sbx.files.make_dir("/home/user/work")
        result = sbx.commands.run('echo "$FOO" && pwd', envs={"FOO": "bar"}, cwd="/home/user/work")
        expect(result.exit_code == 0, repr(result))
        expect(result.stdout.startswith("bar\n"), repr(result.stdout))
        expect(result.stdout.endswith("/home/user/work\n"), repr(result.stdout))

    def run_failure() -> None:
        try:
            sbx.commands.run("echo oops >&2; exit 3")
        except CommandExitException as exc:
            expect(exc.exit_code == 3 and exc.stderr == "oops\n", repr(exc))
            return
        raise AssertionError("no CommandExitException")

    def incremental() -> None:
        arrivals: list[tuple[float, str]] = []
        started = time.monotonic()
        sbx.commands.run(
            "for i in 1 2 3 4; do echo line$i; sleep 0.4; done",
            on_stdout=lambda text: arrivals.append((time.monotonic() - started, text)),
        )
        text = "".join(chunk for _, chunk in arrivals)
        expect(text == "line1\nline2\nline3\nline4\n", repr(text))
        expect(len(arrivals) >= 3, f"only {len(arrivals)} on_stdout callbacks: {arrivals!r}")
        spread = arrivals[-1][0] - arrivals[0][0]
        # Four lines 0.4 s apart: streamed, the callbacks span ~1.2 s; buffered, ~0 s.
        expect(spread >= 0.8, f"callbacks within {spread:.2f}s: {arrivals!r}")
        emit({"info": {"on_stdout arrivals": [round(t, 3) for t, _ in arrivals]}})

    def background_connect_kill() -> None:
        handle = sbx.commands.run(
            "echo started; for i in $(seq 1 300); do echo tick $i; sleep 0.1; done",
            background=True,
        )
        pids = [p.pid for p in sbx.commands.list()]
        expect(handle.pid in pids, f"{handle.pid} not in {pids}")
        attached = sbx.commands.connect(handle.pid)
        expect(attached.pid == handle.pid, "connect returned another pid")
        seen = ""
        for stdout, _, _ in attached:
            seen += stdout or ""
            if "tick" in seen:
                break
        expect("tick" in seen, f"no output through connect(pid): {seen!r}")
        expect(sbx.commands.kill(handle.pid) is True, "kill returned False")
        try:
            handle.wait()
        except CommandExitException as exc:
            expect(exc.exit_code == -1, f"exit code {exc.exit_code}")
            return
        raise AssertionError("killed command exited cleanly")

    def stdin() -> None:
        handle = sbx.commands.run('read line; echo "got:$line"', background=True, stdin=True)
        sbx.commands.send_stdin(handle.pid, "hello stdin\n")
        result = handle.wait()
        expect(result.stdout == "got:hello stdin\n", repr(result.stdout))

    def close_stdin() -> object:
        if not hasattr(sbx.commands, "close_stdin"):
            raise NotAvailable("no commands.close_stdin in this release")
        handle = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(handle.pid, "to cat\n")
        sbx.commands.close_stdin(handle.pid)
        result = handle.wait()
        expect(result.stdout == "to cat\n", repr(result.stdout))
        return None

    def pty_session() -> None:
        chunks: list[bytes] = []
        handle = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.resize(handle.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(handle.pid, b"stty size; echo $((6*7)); exit\n")
        result = handle.wait(on_pty=chunks.append)
        output = b"".join(chunks).decode(errors="replace")
        expect("42" in output, repr(output))
        expect("30 100" in output, f"resize not seen: {output!r}")
        expect(result.exit_code == 0, repr(result))

    def files_text() -> None:
        sbx.files.write("/home/user/t/a.txt", "alpha ✓\n")
        expect(sbx.files.read("/home/user/t/a.txt") == "alpha ✓\n", "text read back differs")

    def files_binary() -> None:
        data = os.urandom(MIB)
        sbx.files.write("/home/user/t/blob.bin", data)
        back = sbx.files.read("/home/user/t/blob.bin", format="bytes")
        expect(bytes(back) == data, f"binary read back differs ({len(back)} bytes)")

    def files_ops() -> None:
        sbx.files.write("/home/user/dir/a.txt", "alpha")
        expect(sbx.files.make_dir("/home/user/dir/sub") is True, "make_dir returned False")
        expect(sbx.files.make_dir("/home/user/dir/sub") is False, "second make_dir returned True")
        names = sorted(e.name for e in sbx.files.list("/home/user/dir"))
        expect(names == ["a.txt", "sub"], repr(names))
        moved = sbx.files.rename("/home/user/dir/a.txt", "/home/user/dir/b.txt")
        expect(moved.path == "/home/user/dir/b.txt", repr(moved))
        expect(sbx.files.exists("/home/user/dir/b.txt"), "renamed file missing")
        expect(not sbx.files.exists("/home/user/dir/a.txt"), "old name still exists")
        sbx.files.remove("/home/user/dir")
        expect(not sbx.files.exists("/home/user/dir"), "remove left the directory")

    def files_missing() -> None:
        try:
            sbx.files.read("/home/user/nope.txt")
        except Exception as exc:  # FileNotFoundException / NotFoundException
            expect("NotFound" in type(exc).__name__, describe(exc))
            return
        raise AssertionError("no error")

    def files_gzip() -> None:
        sbx.files.write("/home/user/z.txt", "z" * 10000, gzip=True)
        expect(sbx.files.read("/home/user/z.txt", gzip=True) == "z" * 10000, "gzip read differs")

    def sync_watch() -> None:
        sbx.files.make_dir("/home/user/w")
        handle = sbx.files.watch_dir("/home/user/w")
        sbx.files.write("/home/user/w/new.txt", "x")
        events: list[Any] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not events:
            events = handle.get_new_events()
            time.sleep(0.1)
        handle.stop()
        expect(
            any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE for e in events),
            repr(events),
        )

    def download(expiration: int | None) -> Callable[[], None]:
        def check() -> None:
            path = f"/home/user/dl-{expiration}.txt"
            sbx.files.write(path, "via url")
            url = sbx.download_url(path, use_signature_expiration=expiration)
            expect(("signature_expiration=" in url) == (expiration is not None), url)
            status, body, headers = fetch(url, headers={"Accept-Encoding": "gzip"})
            if headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            expect(status == 200, f"HTTP {status}: {body.decode(errors='replace').strip()}")
            expect(body == b"via url", repr(body))

        return check

    def upload(expiration: int | None) -> Callable[[], None]:
        def check() -> None:
            path = f"/home/user/up-{expiration}.txt"
            url = sbx.upload_url(path, use_signature_expiration=expiration)
            expect(("signature_expiration=" in url) == (expiration is not None), url)
            status, body, _ = fetch(
                url,
                method="POST",
                data=b"uploaded!",
                headers={"Content-Type": "application/octet-stream"},
            )
            expect(status == 200, f"HTTP {status}: {body.decode(errors='replace').strip()}")
            expect(sbx.files.read(path) == "uploaded!", "upload_url content")

        return check

    return [
        ("commands.run output", run_output),
        ("commands.run non-zero exit", run_failure),
        ("commands.run output arrives incrementally", incremental),
        ("background command, connect(pid), kill", background_connect_kill),
        ("commands stdin (send_stdin)", stdin),
        ("commands close_stdin", close_stdin),
        ("PTY create, send_stdin, resize, output", pty_session),
        ("files write/read text", files_text),
        ("files write/read 1 MiB binary", files_binary),
        ("files list, make_dir, rename, remove, exists", files_ops),
        ("files.read missing file → NotFound", files_missing),
        ("files gzip write/read", files_gzip),
        ("watch_dir (sync, polling)", sync_watch),
        ("download_url", download(None)),
        ("download_url with expiration", download(300)),
        ("upload_url", upload(None)),
        ("upload_url with expiration", upload(300)),
        ("is_running() while routed", sbx.is_running),
    ]


# -- async SDK ----------------------------------------------------------------------------------


async def async_checks() -> None:
    holder: list[Any] = []

    async def create() -> None:
        holder.append(await AsyncSandbox.create(template="base", **OPTS))

    await run_async_check("AsyncSandbox.create", create)
    if not holder:
        return
    sbx = holder[0]

    async def watch() -> None:
        await sbx.files.make_dir("/home/user/aw")
        events: list[Any] = []
        seen = asyncio.Event()

        def on_event(event: Any) -> None:
            events.append(event)
            if {"f.txt", "d/g.txt"} <= {e.name for e in events}:
                seen.set()

        handle = await sbx.files.watch_dir("/home/user/aw", on_event=on_event, recursive=True)
        await sbx.files.write("/home/user/aw/f.txt", "hello")
        await sbx.files.make_dir("/home/user/aw/d")
        await sbx.files.write("/home/user/aw/d/g.txt", "nested")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.wait(), 5)
        await handle.stop()
        names = {(e.name, e.type.value) for e in events}
        expect(("f.txt", "create") in names and ("d/g.txt", "create") in names, repr(names))

    async def command_timeout() -> None:
        started = time.monotonic()
        try:
            await sbx.commands.run("sleep 10", timeout=1)
        except Exception as exc:
            elapsed = time.monotonic() - started
            expect(elapsed < 5, f"took {elapsed:.1f}s: {describe(exc)}")
            expect("Timeout" in type(exc).__name__, describe(exc))
            return
        raise AssertionError("no timeout")

    await run_async_check("watch_dir (AsyncSandbox)", watch)
    await run_async_check("commands.run timeout (AsyncSandbox)", command_timeout)


# -- checks that need relay ---------------------------------------------------------------------


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


# -- main ---------------------------------------------------------------------------------------


def run_checks(checks: list[tuple[str, Callable[[], object]]]) -> None:
    for name, check in checks:
        run_check(name, check)


def main() -> None:
    emit({"info": {"sdk": SDK_VERSION, "form": FORM, "httpx": HTTPX_TRANSPORT, "opts": OPTS}})
    handles: dict[str, Any] = {}

    def create() -> None:
        handles["main"] = Sandbox.create(template="base", **OPTS)
        expect(handles["main"].sandbox_id == MAIN_ID, handles["main"].sandbox_id)
        emit({"info": {"envd_api_url": handles["main"].envd_api_url}})

    def connect() -> None:
        Sandbox.connect(MAIN_ID, **OPTS)

    def connect_handle_runs() -> None:
        result = connect_handle().commands.run("echo connected")
        expect(result.stdout == "connected\n", repr(result.stdout))

    run_check("Sandbox.create", create)
    run_check("Sandbox.connect", connect)
    run_check("envd calls on a connect() handle", connect_handle_runs)
    sbx = handles.get("main")
    if sbx is None:
        return
    run_checks(sandbox_checks(sbx))
    asyncio.run(async_checks())
    if not CONFIG.get("relay"):
        return
    run_checks(relay_checks(sbx))
    emit({"event": "remove-route", "sandbox_id": MAIN_ID})
    expect(sys.stdin.readline().strip() == "removed", "the caller did not remove the route")
    run_checks(after_removal_checks(sbx))


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        emit({"check": "scenario", "observed": describe(exc), "detail": traceback.format_exc()})
    sys.exit(0)
