"""What relay never lets through, whatever the route table says (SPEC §2, §5a).

These checks run before the route lookup so that their answers reveal nothing about which
sandboxes exist. The path rules mirror how envd will read the path: Go's ``net/url`` decodes
percent-escapes once and E2B's proxy matches control paths after ``path.Clean``
(infra ``orchestrator/pkg/proxy`` ``envd.IsInternalPath``), so relay does the same and more:
encodings that different servers decode differently (``%2f``, ``%5c``, backslash, NUL) are
refused outright rather than guessed at.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from relay.core.model import Reason, Reject

# envd's ``x-internal`` operations (infra ``spec/envd.yaml`` → ``internal_routes.gen.go``)
# plus ``/upgrade``, added by hand in ``internal_routes.go``. Case-sensitive, like envd's chi
# router: ``/INIT`` is not ``/init``.
CONTROL_PATHS = frozenset(
    {"/init", "/freeze", "/unfreeze", "/collapse", "/fsfreeze", "/fsthaw", "/upgrade"}
)

_HEX = frozenset(b"0123456789abcdefABCDEF")


@dataclass(slots=True)
class SplitTarget:
    """An origin-form request target split into its raw path and query."""

    raw_path: bytes
    raw_query: bytes | None  # None when there is no ``?``
    clean_path: str  # decoded once, then cleaned like Go's path.Clean


def percent_decode_path(raw: bytes) -> bytes | None:
    """Decode ``%XX`` escapes once, as Go's ``url.PathUnescape`` does; None if malformed.

    ``+`` stays ``+`` in a path (RFC 3986 §3.3); only the query treats it as a space.
    """
    if b"%" not in raw:
        return raw
    out = bytearray()
    i = 0
    n = len(raw)
    while i < n:
        c = raw[i]
        if c == 0x25:  # '%'
            if i + 2 >= n:
                return None
            h1, h2 = raw[i + 1], raw[i + 2]
            if h1 not in _HEX or h2 not in _HEX:
                return None
            out.append(int(raw[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(c)
            i += 1
    return bytes(out)


def clean_path(path: str) -> str:
    """Go's ``path.Clean`` for a rooted path (https://pkg.go.dev/path#Clean).

    Unlike ``posixpath.normpath`` it collapses a leading ``//`` (POSIX keeps it), which matters
    here: ``//init`` must be seen as ``/init``.
    """
    out: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if out:
                out.pop()
            continue
        out.append(segment)
    return "/" + "/".join(out)


@functools.lru_cache(maxsize=2048)
def split_target(target: bytes) -> SplitTarget | Reject:
    """Refuse request targets relay will not forward; split the rest (SPEC §1, §5a).

    Memoised (bounded): a relay sees the same few request targets over and over (``/health``,
    ``/process.Process/Start``, an app's routes), and the result is never mutated.

    Only origin-form is accepted (RFC 9112 §3.2.1): absolute-form is for forward proxies and
    asterisk-form for server-wide OPTIONS, neither of which is a sandbox request.
    """
    if not target.startswith(b"/"):
        return Reject(reason=Reason.BAD_TARGET_FORM)
    raw_path, sep, raw_query = target.partition(b"?")
    if (
        b"%" not in target
        and b"#" not in target
        and b"\\" not in raw_path
        and b"\x00" not in target
        and b"/." not in raw_path
        and b"//" not in raw_path
        and (len(raw_path) == 1 or not raw_path.endswith(b"/"))
    ):
        # Fast path, the common case: nothing to decode and already clean.
        return SplitTarget(raw_path, raw_query if sep else None, raw_path.decode("latin-1"))
    if b"#" in target:
        return Reject(reason=Reason.BAD_PATH, detail="The request target must not contain '#'")
    lowered = raw_path.lower()
    if b"%2f" in lowered or b"%5c" in lowered or b"\\" in raw_path:
        return Reject(
            reason=Reason.BAD_PATH,
            detail="The request path must not contain an encoded slash or a backslash",
        )
    if b"\x00" in target or b"%00" in target:
        return Reject(reason=Reason.BAD_PATH, detail="The request target must not contain NUL")
    decoded = percent_decode_path(raw_path)
    if decoded is None:
        return Reject(reason=Reason.BAD_PATH, detail="The request path has a malformed escape")
    # latin-1 maps every byte to one code point, so cleaning cannot fail or merge bytes.
    cleaned = clean_path(decoded.decode("latin-1"))
    return SplitTarget(raw_path=raw_path, raw_query=raw_query if sep else None, clean_path=cleaned)


def is_control_path(cleaned: str) -> bool:
    return cleaned in CONTROL_PATHS
