"""envd's CORS layer for the fake: rs/cors v1.11.1 with the options of envd's ``main.go``
``withCORS`` (main.go:134-155): every origin, methods HEAD/GET/POST/PUT/PATCH/DELETE, every
request header, MaxAge two hours, and as exposed headers connectrpc.com/cors v0.1.0's
``ExposedHeaders()`` (cors.go:60-66: the three gRPC-web ones) plus Location, Cache-Control and
X-Content-Type-Options.
"""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict

# Joined as rs/cors New does (cors.go:226-228: canonical names, ", ").
EXPOSED = (
    "Grpc-Status, Grpc-Message, Grpc-Status-Details-Bin, "
    "Location, Cache-Control, X-Content-Type-Options"
)
# isMethodAllowed (cors.go:485-500): envd's list, and OPTIONS always.
_METHODS = frozenset({"HEAD", "GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_MAX_AGE = "7200"  # main.go maxAge = 2 * time.Hour


def is_preflight(request: web.BaseRequest) -> bool:
    """cors.go:274: OPTIONS with a (first) Access-Control-Request-Method that is not empty;
    answered before the token check, with or without an Origin, whatever the path."""
    return request.method == "OPTIONS" and bool(
        request.headers.get("Access-Control-Request-Method")
    )


def actual_fields(request: web.BaseRequest) -> list[tuple[str, str]]:
    """handleActualRequest (cors.go:400-444): ``Vary: Origin`` always (set before the handler
    runs, so a handler's own ``Vary``, as /files download sets it, replaces it), the allow and
    expose fields only with an Origin and a method rs/cors allows."""
    if not request.headers.get("Origin") or request.method not in _METHODS:
        return [("Vary", "Origin")]
    return [
        ("Vary", "Origin"),
        ("Access-Control-Allow-Origin", "*"),
        ("Access-Control-Expose-Headers", EXPOSED),
    ]


def preflight(request: web.BaseRequest) -> web.Response:
    """handlePreflight (cors.go:329-397), then 204 (optionsSuccessStatus): the allow fields
    only with an Origin and a requested method allowed as sent (case-sensitive); the requested
    method and headers are echoed, every field of them."""
    headers: list[tuple[str, str]] = [
        ("Vary", "Origin, Access-Control-Request-Method, Access-Control-Request-Headers")
    ]
    method = request.headers.get("Access-Control-Request-Method", "")
    if request.headers.get("Origin") and method in _METHODS:
        headers.append(("Access-Control-Allow-Origin", "*"))
        headers.extend(
            ("Access-Control-Allow-Methods", value)
            for value in request.headers.getall("Access-Control-Request-Method")
        )
        requested = request.headers.getall("Access-Control-Request-Headers", [])
        if requested and requested[0]:
            headers.extend(("Access-Control-Allow-Headers", value) for value in requested)
        headers.append(("Access-Control-Max-Age", _MAX_AGE))
    return web.Response(status=204, headers=CIMultiDict(headers))
