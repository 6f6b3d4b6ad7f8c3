"""What ``fuzz_upstream`` checks on what reaches the client: a strict llhttp reading of the
responses (``Message``, ``responses``), the Connect end-of-stream rule (SPEC §3), and the
checks of the client's bytes against what each exchange's upstream sent (``check_client``),
through a WebSocket splice (``check_splice``). The invariants are listed in fuzz_upstream.py.

The harness imports it within ``atheris.instrument_imports(include=["relay"])``, after
``fakes``, which first imports (and so instruments) the relay modules named here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import httptools
from invariants import frame_ends

from relay.core.streams import CLOSE_GOING_AWAY, close_frame

if TYPE_CHECKING:
    from relay.forward import Exchange


class Message:
    """One response as a strict llhttp parser reads it, fed a byte at a time so that where
    it ends is known."""

    def __init__(self, head_only: bool, *, ours: bool = True) -> None:
        self.ours = ours  # relay wrote it: a parse error is a crash (else: the guest's error)
        self.error = False
        self.parser = httptools.HttpResponseParser(self)
        if not ours:
            # The upstream's bytes, read as relay reads them: a bare LF ends a line
            # (relay.response, RFC 9112 §2.2); relay's own output must not have one.
            self.parser.set_dangerous_leniencies(lenient_optional_cr_before_lf=True)
        self.head_only = head_only
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.head_done = False
        self.complete = False
        self.upgrade = False

    def on_header(self, name: bytes, value: bytes) -> None:
        # The first of repeated fields, as relay (and Go's Header.Get) reads them.
        self.headers.setdefault(name.lower(), value)

    def on_headers_complete(self) -> None:
        self.head_done = True
        self.status = self.parser.get_status_code()
        if self.head_only and self.status >= 200:
            self.complete = True  # an answer to HEAD ends at its head (RFC 9110 §9.3.2)

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True

    def read(self, data: bytes, pos: int) -> int:
        """Feed from ``pos`` until the message completes; returns where it ended, or
        len(data) if it did not. A parse error is a crash (relay wrote a broken message)."""
        view = memoryview(data)
        while pos < len(data):
            try:
                self.parser.feed_data(view[pos : pos + 1])
            except httptools.HttpParserUpgrade:
                self.upgrade = True
                return pos + 1
            except httptools.HttpParserError:
                if self.ours:
                    raise
                self.error = True
                return len(data)
            pos += 1
            if self.complete:
                return pos
        return pos

    @property
    def chunked(self) -> bool:
        return b"chunked" in self.headers.get(b"transfer-encoding", b"").lower()

    @property
    def connect_stream(self) -> bool:
        """What relay follows as a Connect server stream (relay.core.responses)."""
        kind = self.headers.get(b"content-type", b"").lower()
        return self.chunked and kind.startswith(b"application/connect+json")

    @property
    def close_delimited(self) -> bool:
        return (
            b"transfer-encoding" not in self.headers
            and b"content-length" not in self.headers
            and not self.head_only
            and self.status not in (204, 304)
        )


def responses(
    data: bytes, head_only: bool, *, one: bool = False, ours: bool = True
) -> tuple[list[Message], int]:
    """The messages (interim and final) at the start of ``data``, the last one possibly
    incomplete, and where they end; ``one``: up to the first final one. A final answer to
    HEAD is read as its head only. After a 101, the rest is not HTTP."""
    out: list[Message] = []
    pos = 0
    while pos < len(data):
        message = Message(head_only, ours=ours)
        pos = message.read(data, pos)
        out.append(message)
        if message.upgrade or message.status == 101 or not message.complete:
            break
        if one and message.status >= 200:
            break
    return out, pos


def envelopes_end(body: bytes) -> bool:
    """Whether a Connect body is whole envelopes up to an end-of-stream one (SPEC §3)."""
    pos = 0
    while len(body) - pos >= 5:
        size = int.from_bytes(body[pos + 1 : pos + 5], "big")
        if len(body) - pos < 5 + size:
            return False
        if body[pos] & 0x02:
            return True
        pos += 5 + size
    return False


def check_client(
    out: bytes,
    methods: list[bytes],
    closed: bool,
    by_exchange: Iterable[tuple[Exchange, bytearray]],
    spliced: bytes,
) -> None:
    """The client's bytes ``out`` against ``methods``, the requests sent, and ``by_exchange``,
    what each exchange's upstream sent while it owned the connection (``spliced``: what one
    sent after its 101 was spliced)."""
    exchanges = {
        int(ex.head.target.rstrip(b"/").split(b"/")[-1].lstrip(b"ghpwS")): (ex, bytes(sent))
        for ex, sent in by_exchange
    }
    pos = 0
    for i, method in enumerate(methods):
        if pos >= len(out):
            break
        head_only = method == b"HEAD"
        messages, consumed = responses(out[pos:], head_only, one=True)
        upstream = exchanges.get(i)
        theirs = (
            responses(upstream[1], head_only, one=True, ours=False)[0]
            if upstream is not None
            else []
        )
        interims_sent = sum(1 for m in theirs if m.head_done and 100 <= m.status < 200)
        finals = [m for m in messages if m.status >= 200 or m.upgrade]
        interims = [m for m in messages if m.head_done and 100 <= m.status < 200]
        assert len(interims) <= interims_sent, ("a 1xx the upstream did not send", i)
        pos += consumed
        last = messages[-1]
        if last.upgrade or last.status == 101:
            assert method == b"WS", ("a 101 to a request that asked for no upgrade", i)
            assert upstream is not None
            check_splice(out[pos:], upstream[1] + spliced)
            return  # the rest is WebSocket frames
        if not last.complete:
            # Cut: visibly, on a connection that is closed; and nothing after it.
            assert closed, ("a response left incomplete on an open connection", i)
            assert last.head_done, ("a response head cut short", i, out)
            assert pos == len(out)
            return
        assert len(finals) == 1, (i, out)
        final = finals[0]
        if (
            upstream is not None
            and not upstream[0].reason.startswith(("upstream:", "internal"))
            and theirs
        ):
            their_final = next((m for m in theirs if m.head_done and m.status >= 200), None)
            if their_final is not None and their_final.status == final.status:
                body, origin = bytes(final.body), bytes(their_final.body)
                if not origin.startswith(body):
                    # Only relay's own end of a Connect stream may follow the upstream's bytes
                    # (relay follows any chunked connect+json response, whatever the request).
                    assert final.connect_stream, (i, body, origin)
                    assert _own_end(body, origin), (i, body, origin)
            tracker = upstream[0]._tracker
            if (
                final.connect_stream
                and (their_final is None or not their_final.complete)
                # A stream no longer followed has its end taken on trust (relay.upstream_side)
                and (tracker is None or tracker.following)
            ):
                assert envelopes_end(bytes(final.body)), ("a cut stream without its end", i)
    assert not out[pos:].strip(b"\r\n") or pos >= len(out), ("bytes after the responses", out[pos:])


def check_splice(relayed: bytes, theirs: bytes) -> None:
    """After a 101 the client gets what the upstream sent after it, as it came, and at most a
    Close frame of relay's own (a revocation), at a frame boundary (RFC 6455 §5.5.1)."""
    messages, pos = responses(theirs, head_only=False, ours=False)
    assert messages, theirs
    assert messages[-1].upgrade, ("spliced, but the upstream's 101 was not one", theirs)
    after = theirs[pos:]
    if after.startswith(relayed):
        return
    going_away = close_frame(CLOSE_GOING_AWAY)
    assert relayed.endswith(going_away), ("bytes the upstream did not send", relayed, after)
    frames = relayed[: -len(going_away)]
    assert after.startswith(frames), (relayed, after)
    assert len(frames) in frame_ends(after), ("a Close frame inside a frame", relayed, after)


def _own_end(body: bytes, origin: bytes) -> bool:
    """``body`` is a prefix of ``origin`` and then one "unavailable" end-of-stream envelope."""
    for k in range(len(body) - 5, -1, -1):
        if (
            body[k] == 0x02
            and int.from_bytes(body[k + 1 : k + 5], "big") == len(body) - k - 5
            and origin.startswith(body[:k])
            and b"unavailable" in body[k:]
        ):
            return True
    return False
