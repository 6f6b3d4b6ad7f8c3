"""Which of envd's handlers a request reaches, decided the way envd decides it.

Three readings of the request target take part, each from a different layer of envd:

- Go's ``net/http`` parses the target with ``url.ParseRequestURI``: ``URL.Path`` is the
  percent-decoded path, not cleaned (``//health`` and ``/x/../health`` stay as sent), with no
  fragment split off; ``URL.RawPath`` is the path as sent when that differs from Go's own
  escaping of ``Path`` (``url.setPath``), else empty. A ``%`` not followed by two hex digits
  fails the parse: net/http answers 400 before any handler runs.
- envd's token middleware (``internal/api/auth.go:50``) compares ``Method + URL.Path``, the
  decoded path, with its allow list: ``GET /%68ealth`` needs no token there.
- chi v5.2.4 routes on ``RawPath`` when set, else ``Path`` (``mux.go:446-456`` ``routeHTTP``),
  matching its patterns exactly: ``/%68ealth``, ``//health``, ``/x/../health`` and
  ``/health/`` are all 404. The Connect services are mounted (``Mount`` of
  ``/process.Process/``: the pattern ``/process.Process/*``, every method), and the generated
  Connect handler then switches on the decoded ``URL.Path`` (``process.connect.go``), so
  ``/process.Process/%4Cist`` is ``List`` while ``/%70rocess.Process/List`` is 404.

An unknown method is 405 on every path (``mux.go:462-465``); a known path with another
method is 405 with one ``Allow`` field per registered method (``mux.go:520-527``; chi lists
them in Go map order, which varies: compare them as a set).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# chi tree.go methodMap: the methods chi routes at all.
CHI_METHODS = frozenset(
    {"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"}
)
# chi Mount prefixes of the Connect services (process/service.go, filesystem/service.go Handle).
CONNECT_MOUNTS = ("/process.Process/", "/filesystem.Filesystem/")
# The static routes: api.gen.go HandlerWithOptions (api.gen.go:921-955) and main.go's
# ``m.Post("/upgrade", ...)``, each path with its methods in registration order.
STATIC_ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET",),
    "/metrics": ("GET",),
    "/init": ("POST",),
    "/freeze": ("POST",),
    "/unfreeze": ("POST",),
    "/collapse": ("POST",),
    "/fsfreeze": ("POST",),
    "/fsthaw": ("POST",),
    "/envs": ("GET",),
    "/files": ("GET", "POST"),
    "/files/compose": ("POST",),
    "/upgrade": ("POST",),
}

# Go's shouldEscape(c, encodePath) is false for these bytes: unreserved ones and the reserved
# ones allowed in a path ("$&+,/:;=@"); everything else is escaped, as %XX in upper case.
_PATH_SAFE = frozenset(
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~$&+,/:;=@"
)
_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")


@dataclass(frozen=True, slots=True)
class GoPath:
    path: str  # URL.Path: decoded (bytes kept as surrogate escapes)
    raw_path: str  # URL.RawPath: "" when Go's escaping of Path gives the path as sent

    @property
    def route_path(self) -> str:
        """What chi matches its patterns against (mux.go:446-456)."""
        return self.raw_path or self.path or "/"


def parse_target(target: str) -> GoPath | None:
    """``url.ParseRequestURI(target)``'s path; None when Go refuses it (net/http: 400).

    ``target`` is the request target as sent (aiohttp's ``raw_path``): origin form
    (``/p?q``) or absolute form (``http://h/p?q``).
    """
    sent = target.encode("utf-8", "surrogateescape")
    sent = sent.partition(b"?")[0]  # url.parse cuts the query first; '#' stays in the path
    if not sent.startswith(b"/"):
        scheme, sep, rest = sent.partition(b"://")
        if not sep or not scheme:
            return None  # "invalid URI for request"
        slash = rest.find(b"/")
        sent = b"" if slash < 0 else rest[slash:]
    if _BAD_ESCAPE.search(sent):
        return None  # url.unescape: EscapeError
    decoded = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), sent)
    escaped = b"".join(
        bytes([byte]) if byte in _PATH_SAFE else b"%%%02X" % byte for byte in decoded
    )
    raw_path = "" if escaped == sent else sent.decode("utf-8", "surrogateescape")
    return GoPath(path=decoded.decode("utf-8", "surrogateescape"), raw_path=raw_path)


@dataclass(frozen=True, slots=True)
class Route:
    """chi's outcome: a Connect mount (the decoded path picks the procedure), a static
    route's path, or an answer of chi's own (404, or 405 with these Allow values)."""

    mount: bool = False
    static: str | None = None
    status: int = 0
    allow: tuple[str, ...] = ()


def route(method: str, target: GoPath) -> Route:
    """chi ``routeHTTP`` over envd's route tree."""
    if method not in CHI_METHODS:
        return Route(status=405)
    path = target.route_path
    if path.startswith(CONNECT_MOUNTS):
        return Route(mount=True)
    methods = STATIC_ROUTES.get(path)
    if methods is None:
        return Route(status=404)
    if method not in methods:
        return Route(status=405, allow=methods)
    return Route(static=path)
