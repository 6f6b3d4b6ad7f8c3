"""Message boundaries inside relayed byte streams, so relay can end a stream cleanly.

relay passes stream bodies through as they arrive, but when a stream is cut (the route was
revoked, the upstream broke, the relay is draining) it must end the stream in a way the peer
understands:

* a Connect server stream (``application/connect+json``) ends with an end-of-stream envelope
  ``{"error":{"code":"unavailable",...}}``, the text E2B's own proxy uses
  (e2b-dev/runtime ``serveStream``); SDKs read it as "sandbox unavailable" instead of a torn
  body. That envelope can only follow a *whole* envelope, so an incomplete envelope is held
  back until its last byte arrives (envd writes each event in one write, so in practice
  nothing waits); an envelope larger than ``hold_limit`` streams through unheld.
* a WebSocket gets a Close frame (RFC 6455 §5.5.1), which may only start at a frame boundary;
  control frames may sit between the fragments of a message (§5.4), so any boundary will do.

Envelope: ``flags:1 | length:4 (big-endian) | payload`` (connectrpc ``_envelope.py``);
flag ``0x02`` marks the end of the stream.
"""

from __future__ import annotations

import json

END_STREAM_FLAG = 0x02
DEFAULT_HOLD_LIMIT = 256 * 1024
# Envelopes followed per read at most, as MAX_FRAMES_PER_READ for WebSockets: a guest
# streaming empty envelopes (5 bytes each) would otherwise cost a Python loop pass per
# envelope, ~20 ms per 256 KiB read, and stall every other client. Past it the stream is no
# longer followed: passed on as it comes, and cut without an end-of-stream envelope.
MAX_ENVELOPES_PER_READ = 4096


def end_stream_frame(sandbox_id: str) -> bytes:
    """The end-of-stream envelope a cut Connect stream ends with (SPEC §3, Revocation)."""
    payload = json.dumps(
        {
            "error": {
                "code": "unavailable",
                "message": f"the connection to sandbox {sandbox_id} ended before the stream "
                "completed",
            }
        },
        separators=(",", ":"),
    ).encode()
    return bytes([END_STREAM_FLAG]) + len(payload).to_bytes(4, "big") + payload


class EnvelopeTracker:
    """Splits a Connect stream body so that only whole envelopes are released."""

    __slots__ = ("_held", "_hold_limit", "_lost", "_more", "_skip", "_wanted", "ended")

    def __init__(self, hold_limit: int = DEFAULT_HOLD_LIMIT) -> None:
        self._held = b""
        # Later pieces of the held envelope, and how many bytes it still lacks (0: unknown,
        # its 5-byte prefix not whole yet). They are joined once, when it completes: joined
        # at every piece, an envelope of 256 KiB sent as 1-byte chunks cost ~1.5 s of CPU, the
        # held bytes copied again and again (found by review).
        self._more: list[bytes] = []
        self._wanted = 0
        self._skip = 0  # bytes of an oversized envelope still to pass through unheld
        self._hold_limit = hold_limit
        self._lost = False  # no longer followed (MAX_ENVELOPES_PER_READ)
        self.ended = False  # the upstream's own end-of-stream envelope was seen

    @property
    def at_boundary(self) -> bool:
        """Whether the client has received only whole envelopes.

        Held bytes were never released, so they do not count: a stream cut while an envelope
        is held ends cleanly, the partial envelope dropped. Only an oversized envelope that is
        passing through unheld leaves the client mid-envelope.
        """
        return not self._skip and not self._lost

    @property
    def following(self) -> bool:
        """Envelope boundaries are still followed (not past MAX_ENVELOPES_PER_READ in a read)."""
        return not self._lost

    @property
    def holding(self) -> int:
        return len(self._held) + sum(map(len, self._more))

    def rest(self) -> bytes:
        """At the stream's clean end: what is still held (not a whole envelope, so the
        upstream's own malformed ending), released as it came (SPEC §4)."""
        held = b"".join((self._held, *self._more)) if self._more else self._held
        self._held, self._more, self._wanted = b"", [], 0
        return held

    def whole(self, data: bytes, start: int, end: int) -> bool:
        """Whether ``data[start:end]`` is one whole envelope and nothing is held: what
        :meth:`feed` would release as it is (the usual stream event). The caller then passes
        it on itself; False leaves the tracker as it was, for :meth:`feed`."""
        if self._held or self._skip or self._lost or end - start < 5:
            return False
        size = (data[start + 1] << 24) | (data[start + 2] << 16) | (data[start + 3] << 8)
        if end - start != 5 + (size | data[start + 4]):
            return False
        if data[start] & END_STREAM_FLAG:
            self.ended = True
        return True

    def feed(self, data: bytes) -> bytes:
        """Bytes that may be released now; the rest is held until its envelope completes."""
        if self._lost:
            return data
        released = b""
        if self._skip:
            take = min(self._skip, len(data))
            released, data = data[:take], data[take:]
            self._skip -= take
            if not data:
                return released
        if self._held:
            if len(data) < self._wanted:  # the held envelope is not whole yet: no join
                self._more.append(data)
                self._wanted -= len(data)
                return released
            buf = b"".join((self._held, *self._more, data))
            self._more, self._wanted = [], 0
        else:
            buf = data
        pos, n = 0, len(buf)
        envelopes = 0
        while n - pos >= 5:
            envelopes += 1
            if envelopes > MAX_ENVELOPES_PER_READ:
                self._lost = True
                self._held = b""
                return released + buf
            # The 4-byte big-endian length by hand: int.from_bytes (a slice, the "big"
            # argument parsed) cost ~15 µs on a core that was idle, where a stream's events
            # arrive (bench.micro --cold-ms; bench/README.md, "A ninth host").
            total = 5 + (
                (buf[pos + 1] << 24) | (buf[pos + 2] << 16) | (buf[pos + 3] << 8) | buf[pos + 4]
            )
            if n - pos >= total:
                if buf[pos] & END_STREAM_FLAG:
                    self.ended = True
                pos += total
                continue
            if total > self._hold_limit:
                if buf[pos] & END_STREAM_FLAG:
                    self.ended = True  # passed through unheld, but the stream's end all the same
                self._skip = total - (n - pos)
                pos = n
            break
        self._held = buf[pos:]
        if n - pos >= 5:  # held: an envelope whose length is known, and under the limit
            self._wanted = total - (n - pos)
        if not released:
            return buf[:pos] if pos < n else buf
        return released + buf[:pos]


# --- WebSocket (RFC 6455 §5.2) ----------------------------------------------------------

CLOSE_GOING_AWAY = 1001
# Frame headers followed per read at most. Each costs a pass of a Python loop (~0.4 µs): a
# peer sending empty frames (2-6 bytes each) made one 256 KiB read cost ~56 ms and stalled the
# event loop, every other client with it, for as long as it kept sending (found by review).
# Past this many frames in one read a direction stops being followed: relay no longer knows
# its boundaries, so when it has to end the connection it closes it without a Close frame
# that way (at_boundary False), as it does for a connection cut mid-frame.
MAX_FRAMES_PER_READ = 4096


class FrameTracker:
    """Follows WebSocket frame boundaries in one direction without buffering payloads."""

    __slots__ = ("_header", "_lost", "_remaining")

    def __init__(self) -> None:
        self._header = b""  # an incomplete frame header
        self._remaining = 0  # payload bytes of the current frame not yet seen
        self._lost = False  # no longer followed (MAX_FRAMES_PER_READ)

    @property
    def at_boundary(self) -> bool:
        return not self._header and not self._remaining and not self._lost

    def feed(self, data: bytes) -> None:
        if self._lost:
            return
        pos, n = 0, len(data)
        frames = 0
        while pos < n:
            if self._remaining:
                step = min(self._remaining, n - pos)
                self._remaining -= step
                pos += step
                continue
            frames += 1
            if frames > MAX_FRAMES_PER_READ:
                self._lost = True
                return
            header = self._header + data[pos : pos + 14]
            size = _header_size(header)
            if size is None or len(header) < size:
                self._header = header
                return
            used = size - len(self._header)
            self._header = b""
            pos += used
            self._remaining = _payload_length(header)


def _header_size(header: bytes) -> int | None:
    if len(header) < 2:
        return None
    length7 = header[1] & 0x7F
    extended = 2 if length7 == 126 else 8 if length7 == 127 else 0
    return 2 + extended + (4 if header[1] & 0x80 else 0)


def _payload_length(header: bytes) -> int:
    length7 = header[1] & 0x7F
    if length7 == 126:
        return int.from_bytes(header[2:4], "big")
    if length7 == 127:
        return int.from_bytes(header[2:10], "big")
    return length7


def close_frame(code: int, reason: str = "", mask: bytes | None = None) -> bytes:
    """A Close frame; ``mask`` (4 bytes) is required towards a server (RFC 6455 §5.3)."""
    payload = code.to_bytes(2, "big") + reason.encode()[:123]
    if mask is None:
        return bytes([0x88, len(payload)]) + payload
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x88, 0x80 | len(payload)]) + mask + masked
