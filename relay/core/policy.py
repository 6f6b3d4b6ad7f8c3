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
import re
import urllib.parse
from dataclasses import dataclass

from relay.core.model import Reason, Reject

# envd's ``x-internal`` operations (infra ``spec/envd.yaml`` → ``internal_routes.gen.go``)
# plus ``/upgrade``, added by hand in ``internal_routes.go``. Case-sensitive, like envd's chi
# router: ``/INIT`` is not ``/init``.
CONTROL_PATHS = frozenset(
    {"/init", "/freeze", "/unfreeze", "/collapse", "/fsfreeze", "/fsthaw", "/upgrade"}
)

_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")


@dataclass(slots=True)
class SplitTarget:
    """An origin-form request target split into its raw path and query."""

    raw_path: bytes
    raw_query: bytes | None  # None when there is no ``?``
    clean_path: str  # decoded once, then cleaned like Go's path.Clean


def percent_decode(raw: bytes, *, plus_is_space: bool = False) -> bytes | None:
    """Decode ``%XX`` escapes once, strictly, as Go's ``net/url`` does; None if malformed.

    ``plus_is_space`` is the query rule (``url.QueryUnescape``); in a path ``+`` stays ``+``
    (``url.PathUnescape``, RFC 3986 §3.3). A malformed escape is checked by one regex and
    the decoding left to ``urllib``, both in C for the common case.
    """
    if plus_is_space:
        raw = raw.replace(b"+", b" ")  # before decoding, so that %2B stays a plus
    if b"%" not in raw:
        return raw
    if _BAD_ESCAPE.search(raw) is not None:
        return None
    return urllib.parse.unquote_to_bytes(raw)


def percent_decode_path(raw: bytes) -> bytes | None:
    """Go's ``url.PathUnescape``."""
    return percent_decode(raw)


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


# Targets longer than this are split every time, never remembered: an entry holds the target
# and about one more copy of it (raw path and query, cleaned path), measured ~2.4 KB at most,
# so the 2,048 remembered targets hold at most ~5 MiB. Targets of any length (up to
# ``listen.max_header_bytes``, 16 KiB by default) could hold ~75 MiB. SDK targets are short
# (a signed ``/files`` URL is ~200 B).
TARGET_MEMO_BYTES = 1024


def split_target(target: bytes) -> SplitTarget | Reject:
    """Refuse request targets relay will not forward; split the rest (SPEC §1, §5a).

    Memoised (bounded, see ``TARGET_MEMO_BYTES``): a relay sees the same few request targets
    over and over (``/health``, ``/process.Process/Start``, an app's routes), and the result
    is never mutated.

    Only origin-form is accepted (RFC 9112 §3.2.1): absolute-form is for forward proxies and
    asterisk-form for server-wide OPTIONS, neither of which is a sandbox request.
    """
    if len(target) > TARGET_MEMO_BYTES:
        return _split_target(target)
    return _remembered_split(target)


def _split_target(target: bytes) -> SplitTarget | Reject:
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


_remembered_split = functools.lru_cache(maxsize=2048)(_split_target)


def is_control_path(cleaned: str) -> bool:
    return cleaned in CONTROL_PATHS


# -- the first bytes on a TLS listener (relay.handshake) -----------------------------------------
# The longest method told from its space: registered methods have at most 17 characters
# (UPDATEREDIRECTREF, IANA's HTTP Method Registry), all capital letters and "-".
METHOD_MAX = 20
_METHOD_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ-")
_CAPITALS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def plain_http_request(first: bytes) -> bool | None:
    """Whether a TLS listener's first bytes begin a plain HTTP/1.x request line (RFC 9112
    §3: a method, then a space): True to answer it, False to leave them to the handshake,
    None when too few have come to tell.

    A TLS client's first byte is 0x16, a handshake record's type (RFC 8446 §5.1; an SSLv2
    hello's has its high bit set), never a capital letter, so it is told at that byte. Only
    a method of capitals and "-" counts, not any RFC 9110 token: an SSH banner
    (``SSH-2.0-…`` then a space) and other protocols keep the handshake's failure, as
    before, and a client that sends a letter and stops is waited for no longer than the
    handshake's own timeout, with at most METHOD_MAX + 1 bytes held.
    """
    for at, byte in enumerate(first[: METHOD_MAX + 1]):
        if byte == 0x20:
            return at > 0
        if byte not in (_METHOD_CHARS if at else _CAPITALS):
            return False
    return None if len(first) <= METHOD_MAX else False
