"""Plain HTTP clients for the SDK scenario: what a browser or curl would do with the URLs the
SDK builds (urllib through ``HTTPS_PROXY``, and a raw socket for WebSocket, RFC 6455).

Runs in the SDK's virtualenv like the scenario: only the standard library.
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import ssl
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from tests.support.sdk_scenario_run import FORM, PROXY, expect


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
