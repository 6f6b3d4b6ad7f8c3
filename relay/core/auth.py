"""Credentials: envd access tokens, traffic tokens and v1 file-URL signatures (SPEC §2).

The signature scheme is envd's (infra ``packages/envd/internal/api/auth.go``) and the SDK's
(``e2b/sandbox/signature.py``)::

    "v1_" + base64_std_unpadded(sha256("<path>:<op>:<username>:<token>[:<exp>]"))

``path`` and ``username`` are the *decoded* query values (``""`` when absent), ``op`` is
``read`` for GET and ``write`` for POST, and ``:<exp>`` is present iff the URL carries
``signature_expiration``. Query values are decoded as Go's ``url.Query()`` decodes them, so
``+`` is a space and a pair with a malformed escape or a ``;`` is not a pair at all.

All comparisons are constant-time (``hmac.compare_digest``), as envd's
``subtle.ConstantTimeCompare`` is. The clock is an argument: nothing here reads time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass

from relay.core.model import Reason, Reject, Route
from relay.core.policy import percent_decode

SIGNED_PARAMS = frozenset({b"path", b"username", b"signature", b"signature_expiration"})
STRIPPED_PARAMS = frozenset({b"signature", b"signature_expiration"})
_EXPIRATION = re.compile(rb"[0-9]{1,19}")
# A name without the brackets and spaces around it and what follows its first bracket.
_CREDENTIAL_NAME = re.compile(rb"[\[\] ]*([^\[\]]*)")
_INT64_MAX = 2**63 - 1

UNAUTHORIZED = Reject(reason=Reason.ENVD_UNAUTHORIZED)


def file_signature(
    path: str | bytes, operation: str, username: str | bytes, token: str, expiration: int | None
) -> str:
    """The SDK's ``get_signature`` given an absolute expiration (None = never expires)."""
    parts = [
        path.encode() if isinstance(path, str) else path,
        operation.encode(),
        username.encode() if isinstance(username, str) else username,
        token.encode(),
    ]
    if expiration is not None:
        parts.append(str(expiration).encode())
    digest = hashlib.sha256(b":".join(parts)).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def go_query_unescape(raw: bytes) -> bytes | None:
    """Go's ``url.QueryUnescape``: ``+`` is a space, ``%XX`` must be hex; None if malformed."""
    return percent_decode(raw, plus_is_space=True)


def go_parse_query(raw: bytes) -> list[tuple[bytes, bytes]]:
    """Go's ``url.ParseQuery`` as ``Request.URL.Query()`` sees it (bad pairs dropped)."""
    pairs: list[tuple[bytes, bytes]] = []
    for segment in raw.split(b"&"):
        if not segment or b";" in segment:
            continue  # Go >= 1.17 rejects ';' separators; Query() drops the pair
        key, _, value = segment.partition(b"=")
        dkey, dvalue = go_query_unescape(key), go_query_unescape(value)
        if dkey is None or dvalue is None:
            continue
        pairs.append((dkey, dvalue))
    return pairs


def signed_params(raw: bytes) -> dict[bytes, list[bytes]]:
    """The four signed parameters as ``go_parse_query`` would give them, in order.

    Only those pairs have their value decoded: a query's other values do not matter here.
    """
    params: dict[bytes, list[bytes]] = {}
    for segment in raw.split(b"&"):
        if not segment or b";" in segment:
            continue  # Go >= 1.17 rejects ';' separators; Query() drops the pair
        key, _, value = segment.partition(b"=")
        if b"%" in key or b"+" in key:
            decoded_key = go_query_unescape(key)
            if decoded_key is None:
                continue
            key = decoded_key
        if key not in SIGNED_PARAMS:
            continue
        decoded = go_query_unescape(value)
        if decoded is not None:  # a malformed escape drops the pair, as in Go
            params.setdefault(key, []).append(decoded)
    return params


def strip_signature_params(raw_query: bytes) -> bytes:
    """Remove ``signature`` and ``signature_expiration`` pairs, keeping the rest in order.

    Matching is lenient on purpose, so that no spelling of a credential that an upstream's
    query parser reads as one can slip past the strip (:func:`_names_a_credential`). A pair
    is an ``&``-separated segment, as for Go; one whose ``;``-separated part names a
    credential is dropped whole, never cut at the ``;``: Go >= 1.17 ignored the whole segment
    when relay verified the URL (``signed_params``), and ``username=root;signature=x`` cut
    to ``username=root`` would hand envd, which runs without a token in strip mode, a
    username the signature never covered.
    """
    kept = []
    for segment in raw_query.split(b"&"):
        if b";" in segment:
            if any(_names_a_credential(part) for part in segment.split(b";")):
                continue
        elif _names_a_credential(segment):
            continue
        kept.append(segment)
    return b"&".join(kept)


def _names_a_credential(pair: bytes) -> bool:
    """Whether a query parser would read ``pair`` as a signature parameter.

    Besides Go's spelling (the name decoded once): any letter case; ``;`` as a separator
    (W3C's HTML 4.01 §B.2.2 suggested it; Rails' ``ActionDispatch::QueryParser``, Rack 2,
    Perl's CGI and Go < 1.17 split on it); brackets (``signature[]`` and ``signature[x]`` are
    ``signature`` to Rails' ``normalize_params`` and PHP, ``[signature]`` to Rails) and
    spaces around the name (PHP drops leading ones). A malformed escape leaves the raw name.
    """
    name = pair.partition(b"=")[0]
    if name.isalnum():
        # No escape, "+", bracket or space: read as it is. Most names (path, username,
        # signature): this runs per pair of a query with a "%" in it, in strip mode (most of
        # envd's), and the general way below cost a signed URL's strip 2.5 times the time.
        return name.lower() in STRIPPED_PARAMS
    decoded = go_query_unescape(name)
    match = _CREDENTIAL_NAME.match(decoded if decoded is not None else name)
    return match is not None and match.group(1).strip(b" ").lower() in STRIPPED_PARAMS


def tokens_equal(given: bytes, expected: str) -> bool:
    """A header's token against the route's. llhttp passes a field value on with the spaces and
    tabs after it, which are not part of the value (RFC 9110 §5.5) and which Go's textproto
    (envd, E2B's proxy) trims: a right token followed by them was refused (found by review)."""
    return hmac.compare_digest(given.rstrip(b" \t"), expected.encode("latin-1", "replace"))


@dataclass(slots=True, kw_only=True)
class EnvdRequest:
    """What the envd credential check looks at."""

    method: bytes
    clean_path: str
    raw_query: bytes | None
    access_token: bytes | None  # the X-Access-Token value, when the header is present
    preflight: bool = False  # a CORS preflight (OPTIONS with Access-Control-Request-Method)


def check_envd(request: EnvdRequest, route: Route, now: int) -> Reject | None:
    """None when the request may reach envd (SPEC §2, envd port)."""
    return envd_verdict(request, route, now)[0]


def envd_verdict(request: EnvdRequest, route: Route, now: int) -> tuple[Reject | None, int | None]:
    """``check_envd`` and, for a request it admits, until when it holds.

    The second value is the signed URL's ``signature_expiration`` when the request was admitted
    by such a signature: the last Unix second at which the same request is still admitted.
    None when the answer does not depend on the clock (a token, an unexpiring signature, a
    refusal other than an expired signature's). ``Relay.decide`` remembers a decision until then.
    """
    if route.insecure or route.envd_token is None:
        return None, None
    if request.access_token is not None:
        # A present header must match and never falls back to a signature: envd does the
        # same (``validateSigning``: "access token present in header but does not match").
        ok = tokens_equal(request.access_token, route.envd_token)
        return (None if ok else UNAUTHORIZED), None
    if request.method == b"GET" and request.clean_path == "/health":
        return None, None
    if request.preflight:
        # A browser sends no credential on a CORS preflight (Fetch: only safelisted fields),
        # and envd answers it before its token check: rs/cors wraps WithAuthorization (envd's
        # main.go) and never passes a preflight on to a handler. Refused here, it blocked every
        # envd call of the JS SDK in a browser, whose X-Access-Token and Connect content type
        # make each one preflighted (found by review).
        return None, None
    signed_route = request.clean_path == "/files" and request.method in (b"GET", b"POST")
    if signed_route and request.raw_query is not None:
        return check_signature(request, route.envd_token, now)
    return UNAUTHORIZED, None


def check_signature(request: EnvdRequest, token: str, now: int) -> tuple[Reject | None, int | None]:
    """A v1 file-URL signature: (refusal or None, the expiration it was admitted until)."""
    params = signed_params(request.raw_query or b"")
    if any(len(values) > 1 for values in params.values()):
        # Go's Query().Get takes the first value, a verifier in front of it could take another:
        # a repeated signed parameter is never accepted.
        return UNAUTHORIZED, None
    signature = params.get(b"signature")
    if signature is None:
        return UNAUTHORIZED, None
    expiration: int | None = None
    if b"signature_expiration" in params:
        raw_exp = params[b"signature_expiration"][0]
        if _EXPIRATION.fullmatch(raw_exp) is None or int(raw_exp) > _INT64_MAX:
            bad = Reject(
                reason=Reason.BAD_EXPIRATION,
                detail="Invalid format for parameter signature_expiration: expected an integer",
            )
            return bad, None
        expiration = int(raw_exp)
    operation = "read" if request.method == b"GET" else "write"
    expected = file_signature(
        params.get(b"path", [b""])[0],
        operation,
        params.get(b"username", [b""])[0],
        token,
        expiration,
    )
    if not hmac.compare_digest(signature[0], expected.encode()):
        return UNAUTHORIZED, None
    # Checked after the signature, and ``exp == now`` is still valid (envd ``validateSigning``).
    if expiration is not None and expiration < now:
        return UNAUTHORIZED, None
    return None, expiration


def check_traffic(token_values: list[bytes] | None, route: Route) -> Reject | None:
    """Application ports: the route's traffic token, when it has one (SPEC §2)."""
    if route.traffic_token is None:
        return None
    # An empty field is no token, as E2B's proxy reads it (Go's Header.Get gives "" for both,
    # and "" is "missing"); llhttp leaves the spaces and tabs after a value on it.
    if not token_values or not token_values[0].strip(b" \t"):
        return Reject(reason=Reason.TRAFFIC_TOKEN_MISSING, sandbox_id=route.sandbox_id)
    if not tokens_equal(token_values[0], route.traffic_token):
        return Reject(reason=Reason.TRAFFIC_TOKEN_INVALID, sandbox_id=route.sandbox_id)
    return None
