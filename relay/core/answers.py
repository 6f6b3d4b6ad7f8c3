"""Render a :class:`Reject` as the HTTP answer relay gives itself (SPEC §5).

JSON ``{"code": <status>, "message": ...}`` with an *integer* code, as envd's ``jsonError``
and E2B's proxy answer: the SDK maps the answer by status and reads ``message``
(``e2b/envd/client_shared.py``); "was not found" and "port is not open" are substrings that
SDK 2.63 turns into SandboxNotRunning/SandboxUnreachable exceptions. A browser page load gets
a short HTML page instead.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from http import HTTPStatus

from relay.core.headers import index
from relay.core.model import Headers, Reject

JSON_TYPE = b"application/json; charset=utf-8"
HTML_TYPE = b"text/html; charset=utf-8"
# RFC 9110 §15.5.6: a 405 MUST list the methods the target supports. relay refuses only
# CONNECT (SPEC §1) and forwards the others; these are the ones envd allows (rs/cors in its
# main.go) and every E2B SDK uses.
ALLOWED_METHODS = b"GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: Headers
    body: bytes


def body_fields(reject: Reject) -> dict[str, object]:
    out: dict[str, object] = {"code": reject.status, "message": reject.message}
    if reject.sandbox_id is not None:
        out["sandboxId"] = reject.sandbox_id
    if reject.path is not None:
        out["path"] = reject.path
    if reject.port is not None:
        out["port"] = reject.port
    if reject.limit is not None:
        out["connectionLimit"] = reject.limit
    return out


def wants_html(fields: dict[bytes, list[bytes]]) -> bool:
    """A browser page load: ``Sec-Fetch-Mode: navigate`` and ``Accept`` preferring HTML."""
    mode = fields.get(b"sec-fetch-mode")
    if not mode or mode[0].strip().lower() != b"navigate":
        return False
    accept = b",".join(fields.get(b"accept", [])).lower()
    return _prefers_html(accept)


def _prefers_html(accept: bytes) -> bool:
    """``text/html`` has the highest q-value of the listed types (RFC 9110 §12.5.1)."""
    best_html, best_other = -1.0, -1.0
    for item in accept.split(b","):
        media, *params = (part.strip() for part in item.split(b";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition(b"=")
            if name.strip() == b"q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if media == b"text/html":
            best_html = max(best_html, q)
        elif media:
            best_other = max(best_other, q)
    return best_html > 0 and best_html >= best_other


# envd's CORS options (rs/cors in its main.go; e2b-protocol notes §5.1): the methods a
# preflight may ask for, and how long a browser may keep its answer.
ENVD_CORS_METHODS = frozenset({b"HEAD", b"GET", b"POST", b"PUT", b"PATCH", b"DELETE"})
ENVD_CORS_MAX_AGE = b"7200"
_PREFLIGHT_VARY = b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"


def envd_preflight(fields: dict[bytes, list[bytes]]) -> Answer:
    """A CORS preflight to envd's port that relay refused, answered as envd's rs/cors answers
    every preflight, before its token check and whatever the path: a browser accepts only a
    2xx preflight ("It does not have HTTP ok status"), so relay's 502 "The sandbox was not
    found" to it reached the JS SDK in a browser as "TypeError: Failed to fetch" (seen with
    headless Chromium). Answered so, the browser sends the actual request, which relay refuses
    with Access-Control-Allow-Origin (SPEC §5), and the page reads why. The answer is the one
    envd gives anyway, so relay allows nothing envd would not; E2B's newer proxy answers
    preflights on routing errors too (e2b-protocol notes §8.5).

    As rs/cors 1.11.1 decides (cors.go handlePreflight, isMethodAllowed): no allow field for
    an empty Origin; the requested method compared as sent (the Fetch standard upper-cases only
    the six standard methods, and matches Access-Control-Allow-Methods byte for byte), OPTIONS
    always allowed; the method's and the headers' fields echoed as they came. Found by review:
    relay upper-cased the method, allowing 'patch' where envd allows nothing, and refused
    OPTIONS, which envd allows."""
    out: list[tuple[bytes, bytes]] = [(b"Vary", _PREFLIGHT_VARY)]
    origin = fields.get(b"origin", [b""])[0].strip(b" \t")
    methods = [value.strip(b" \t") for value in fields.get(b"access-control-request-method", [])]
    method = methods[0] if methods else b""
    if origin and (method == b"OPTIONS" or method in ENVD_CORS_METHODS):
        out.append((b"Access-Control-Allow-Origin", b"*"))
        out.extend((b"Access-Control-Allow-Methods", value) for value in methods)
        requested = fields.get(b"access-control-request-headers", [])
        if requested and requested[0]:  # AllowedHeaders "*": whatever was asked for
            out.extend((b"Access-Control-Allow-Headers", value) for value in requested)
        out.append((b"Access-Control-Max-Age", ENVD_CORS_MAX_AGE))
    return Answer(204, tuple(out), b"")


def render(reject: Reject, request_headers: Headers = ()) -> Answer:
    fields = index(request_headers)
    if reject.envd_preflight:
        return envd_preflight(fields)
    out: list[tuple[bytes, bytes]] = []
    if wants_html(fields):
        title = html.escape(f"{reject.status} {_phrase(reject.status)}")
        body = (
            f"<!doctype html><html><head><meta charset=utf-8><title>{title}</title></head>"
            f"<body><h1>{title}</h1><p>{html.escape(reject.message)}</p></body></html>\n"
        ).encode()
        out.append((b"Content-Type", HTML_TYPE))
    else:
        body = json.dumps(body_fields(reject), separators=(",", ":")).encode()
        out.append((b"Content-Type", JSON_TYPE))
    out.append((b"X-Content-Type-Options", b"nosniff"))
    out.append((b"Cache-Control", b"no-store"))
    if reject.retry_after is not None:
        out.append((b"Retry-After", str(reject.retry_after).encode()))
    if reject.status == 405:
        out.append((b"Allow", ALLOWED_METHODS))
    if b"origin" in fields:
        out.append((b"Access-Control-Allow-Origin", b"*"))
        if reject.retry_after is not None:
            # Not a CORS-safelisted response field: a cross-origin page reads it only when
            # exposed (Fetch standard; seen with Chromium: headers.get("retry-after") was null).
            out.append((b"Access-Control-Expose-Headers", b"Retry-After"))
    return Answer(reject.status, tuple(out), body)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def serialise_response(
    status: int, reason: bytes, headers: Headers, *, version: bytes = b"HTTP/1.1"
) -> bytes:
    lines = [version + b" " + str(status).encode() + b" " + reason]
    lines.extend(name + b": " + value for name, value in headers)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def reason_phrase(status: int) -> bytes:
    return _phrase(status).encode()


def answer_bytes(
    answer: Answer,
    *,
    close: bool,
    head_only: bool = False,
    version: str = "1.1",
    date: bytes = b"",
) -> bytes:
    """One of relay's own answers as written to the client: the head, with Content-Length and,
    when the connection ends after it, ``Connection: close`` (RFC 9112 §9.6), then the body.

    ``head_only`` answers a HEAD request: the same fields, no content (RFC 9110 §9.3.2), since
    bytes after the head would be read as the next response on a kept-alive connection.
    ``version`` is the request's: an HTTP/1.0 client is told a kept connection is kept (found by
    review: relay kept it silently, and the client could wait for the close).
    ``date``: the Date field's value, which RFC 9110 §6.6.1 requires of an origin server with
    a clock in every 4xx; the adapter reads the clock (``relay.answer.http_date``)."""
    fields = answer.headers
    if answer.status != 204:  # a 204 has no Content-Length (RFC 9110 §8.6)
        fields = (*fields, (b"Content-Length", str(len(answer.body)).encode()))
    if date:
        fields = ((b"Date", date), *fields)
    if close:
        fields = (*fields, (b"Connection", b"close"))
    elif version == "1.0":  # an HTTP/1.0 connection persists only when both say so (RFC 9112 §9.3)
        fields = (*fields, (b"Connection", b"keep-alive"))
    head = serialise_response(answer.status, reason_phrase(answer.status), fields)
    return head if head_only else head + answer.body


_escape = json.encoder.encode_basestring_ascii


def log_members(
    sandbox_id: str | None, port: int | None, method: str | None, path: str | None
) -> str:
    """The request's members of an access-log line (SPEC §7), escaped for JSON.

    Made once per decision (``Forward.log_fields``): a remembered decision then costs an
    access-log line only the members that change per request (time, status, sizes)."""
    sandbox = "null" if sandbox_id is None else _escape(sandbox_id)
    number = "null" if port is None else str(port)
    verb = "null" if method is None else _escape(method)
    where = "null" if path is None else _logged_path(path)
    return f'"sandbox_id":{sandbox},"port":{number},"method":{verb},"path":{where}'


# A path is logged in at most this many JSON characters, so that a whole line stays within
# PIPE_BUF (4 KiB, the other members take ~400): workers sharing journald's pipe write their
# lines atomically only up to that size, and a longer one could be torn by another worker's
# (found by review). nginx logs to files, where the limit does not apply.
LOGGED_PATH_CHARS = 2048


def _logged_path(path: str) -> str:
    """``path`` escaped for JSON, cut to :data:`LOGGED_PATH_CHARS` with a "…" that shows it."""
    where = _escape(path)
    if len(where) <= LOGGED_PATH_CHARS:
        return where
    # Most paths escape one to one; one of bytes past ASCII takes 6 characters per byte.
    for keep in (LOGGED_PATH_CHARS - 16, LOGGED_PATH_CHARS // 6 - 4):
        where = _escape(path[:keep] + "…")
        if len(where) <= LOGGED_PATH_CHARS:
            break
    return where
