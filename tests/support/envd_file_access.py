"""What every request to envd's ``/files`` passes first: parameter binding, signed-URL checks and
envd's two error answer shapes.

Sources: envd ``internal/api/{auth,error}.go`` and the generated parameter binding in
``api.gen.go`` (Go's ``url.ParseQuery`` and ``strconv.ParseInt`` underneath).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote_plus

from aiohttp import web

from tests.support import go_json

READ, WRITE = "read", "write"  # auth.go SigningReadOperation / SigningWriteOperation

# -- answers ------------------------------------------------------------------------------------


def json_error(status: int, message: str) -> web.Response:
    """error.go:9-21 jsonError: int code, Go's JSON Encoder (HTML-escaped, newline), nosniff."""
    return web.Response(
        status=status,
        body=go_json.encode({"code": status, "message": message}),
        headers={
            "Content-Type": "application/json; charset=utf-8",
            "X-Content-Type-Options": "nosniff",
        },
    )


def text_error(status: int, message: str) -> web.Response:
    """Go's http.Error: text/plain, nosniff, trailing newline (parameter binding errors)."""
    return web.Response(
        status=status,
        body=(message + "\n").encode(),
        headers={
            "Content-Type": "text/plain; charset=utf-8",
            "X-Content-Type-Options": "nosniff",
        },
    )


class HttpFailure(Exception):
    """An early answer from inside a handler step."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


# -- parameters and signatures ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class FileParams:
    path: str | None
    username: str | None
    signature: str | None
    signature_expiration: int | None


def bind_file_params(raw_query: str) -> FileParams:
    """api.gen.go binding: each parameter at most once; signature_expiration an integer."""
    query = go_url_query(raw_query)
    values: dict[str, str | None] = {}
    for name in ("path", "username", "signature", "signature_expiration"):
        found = query.get(name)
        if found is not None and len(found) != 1:
            raise HttpFailure(
                text_error(
                    400,
                    f"Invalid format for parameter {name}: "
                    f"multiple values for single value parameter '{name}'",
                )
            )
        values[name] = found[0] if found else None
    expiration = values["signature_expiration"]
    return FileParams(
        path=values["path"],
        username=values["username"],
        signature=values["signature"],
        signature_expiration=None if expiration is None else _parse_go_int64(expiration),
    )


_GO_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def go_url_query(raw_query: str) -> dict[str, list[str]]:
    """Go's ``url.ParseQuery`` as ``r.URL.Query()`` gives it to envd's parameter binding.

    Pairs are split on ``&`` only; a pair holding a ``;`` (Go >= 1.17) or a malformed escape
    (``%`` not followed by two hex digits, in its key or value) is dropped, not kept; ``+`` is
    a space; blank values are kept. Python's ``parse_qs`` keeps both kinds of pair, so a
    repeated ``path`` that envd reads as one value was a 400 here.
    """
    query: dict[str, list[str]] = {}
    for segment in raw_query.split("&"):
        if not segment or ";" in segment:
            continue
        key, _, value = segment.partition("=")
        if _GO_ESCAPE.search(key) or _GO_ESCAPE.search(value):
            continue
        query.setdefault(unquote_plus(key, errors="surrogateescape"), []).append(
            unquote_plus(value, errors="surrogateescape")
        )
    return query


def _parse_go_int64(text: str) -> int:
    # strconv.ParseInt(s, 10, 64) via the runtime's BindStringToObject.
    if re.fullmatch(r"[+-]?[0-9]+", text):
        value = int(text)
        if -(2**63) <= value < 2**63:
            return value
        reason = "value out of range"
    else:
        reason = "invalid syntax"
    raise HttpFailure(
        text_error(
            400,
            "Invalid format for parameter signature_expiration: error binding string parameter: "
            f'strconv.ParseInt: parsing "{text}": {reason}',
        )
    )


def sign(path: str, operation: str, username: str, token: str, expiration: int | None) -> str:
    """auth.go generateSignature: "v1_" + base64 (std, unpadded) of sha256 of the joined parts."""
    parts = [path, operation, username, token]
    if expiration is not None:
        parts.append(str(expiration))
    # Go hashes the query's bytes as decoded, UTF-8 or not (go_url_query keeps them).
    digest = hashlib.sha256(":".join(parts).encode("utf-8", "surrogateescape")).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def validate_signing(
    token: str | None,
    header_token: str,
    params: FileParams,
    operation: str,
    now: Callable[[], float] = time.time,
) -> str | None:
    """auth.go validateSigning: None when allowed, else the error text (answered as 401)."""
    if token is None:
        return None
    if header_token:
        if hmac.compare_digest(header_token.encode(), token.encode()):
            return None
        return "access token present in header but does not match"
    if params.signature is None:
        return "missing signature query parameter"
    expected = sign(
        params.path or "", operation, params.username or "", token, params.signature_expiration
    )
    if not hmac.compare_digest(expected.encode(), params.signature.encode()):
        return "invalid signature"
    if params.signature_expiration is not None and params.signature_expiration < int(now()):
        return "signature is already expired"
    return None
