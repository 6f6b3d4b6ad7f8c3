"""WebSocket pass-through: after the 101, relay splices the two connections' bytes.

relay does not decode or re-encode frames: data, pings and Close frames (with their codes,
RFC 6455 §7.4) flow both ways exactly as the peers wrote them, at the cost of two socket
buffers and no per-message work, the way nginx and Go's ``httputil.ReverseProxy`` relay
upgraded connections. Frame *boundaries* are followed in each direction
(:class:`~relay.core.streams.FrameTracker`), so that when relay itself has to end the
connection (route revoked, drain) it can send a proper Close frame (1001 "going away") to
both peers instead of just dropping the TCP connections.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from relay.core.model import Forward, Reason
from relay.core.streams import CLOSE_GOING_AWAY, FrameTracker, close_frame
from relay.flow import PAUSE_UPSTREAM_FULL

if TYPE_CHECKING:
    from relay.flow import Client
    from relay.upstream_conn import UpstreamConnection


class Splice:
    """Both directions of one upgraded connection (also the upstream's :class:`Owner`)."""

    __slots__ = (
        "_closed",
        "_pending",
        "_to_client",
        "_to_upstream",
        "bytes_in",
        "bytes_out",
        "client",
        "decision",
        "reason",
        "started_at",
        "upstream",
    )

    def __init__(
        self,
        client: Client,
        upstream: UpstreamConnection,
        decision: Forward,
        client_tail: bytes,
        upstream_tail: bytes,
    ) -> None:
        self.client = client
        self.upstream = upstream
        self.decision = decision
        self._to_client = FrameTracker()
        self._to_upstream = FrameTracker()
        self._closed = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.reason = ""
        self.started_at = time.monotonic()
        self._pending = (client_tail, upstream_tail)

    @property
    def sandbox_id(self) -> str | None:
        target = self.decision.target
        return target.sandbox_id if target is not None else None

    def start(self) -> None:
        self.upstream.owner = self
        self.client.start_splice(self)
        self.client.relay.register(self)
        client_tail, upstream_tail = self._pending
        self._pending = (b"", b"")
        if client_tail:
            self.client_data(client_tail)
        if upstream_tail:
            self.upstream_data(upstream_tail)
        self.client.resume_all()  # the handshake's pauses (upgrade, dial) are over...
        if self.upstream.write_paused:
            # ...but not a full upstream buffer (the client's tail may have filled it, and
            # the transport will not say pause_writing twice): keep the client unread.
            self.client.pause(PAUSE_UPSTREAM_FULL)
        if self.client.write_paused:
            self.upstream.pause_reading()

    # -- client → upstream
    # Each side writes first and tracks frame boundaries after: on an idle core every line
    # before the write is latency (bench/README.md, "cold requests"); nothing can run in
    # between, so a revocation still sees the boundary after this chunk.
    def client_data(self, data: bytes) -> None:
        if self._closed:
            return
        self.upstream.write(data)
        self.bytes_in += len(data)
        self._to_upstream.feed(data)

    def client_lost(self) -> None:
        self.reason = self.reason or "client_closed"
        self._end()

    def client_pause_writing(self) -> None:
        self.upstream.pause_reading()

    def client_resume_writing(self) -> None:
        self.upstream.resume_reading()

    # -- upstream → client (Owner protocol)
    def upstream_data(self, data: bytes) -> None:
        if self._closed:
            return
        self.client.write(data)
        self.bytes_out += len(data)
        self._to_client.feed(data)

    def upstream_eof(self) -> None:
        self.reason = self.reason or "upstream_closed"
        self._end()

    def upstream_lost(self, exc: Exception | None) -> None:
        self.reason = self.reason or ("upstream_reset" if exc else "upstream_closed")
        self._end()

    def upstream_pause_writing(self) -> None:
        self.client.pause(PAUSE_UPSTREAM_FULL)

    def upstream_resume_writing(self) -> None:
        self.client.resume(PAUSE_UPSTREAM_FULL)

    # -- ending
    def revoke(self, answer: Reason) -> bool:
        """Ended with 1001 whatever ``answer`` (the splice's response started long ago)."""
        if self._closed:
            return False
        self.reason = "draining" if answer is Reason.DRAINING else "revoked"
        self.going_away()
        return True

    def going_away(self) -> None:
        """Close both sides with 1001 where a frame boundary allows it (RFC 6455 §7.4.1)."""
        if self._closed:
            return
        if self._to_client.at_boundary:
            self.client.write(close_frame(CLOSE_GOING_AWAY))
        if self._to_upstream.at_boundary:
            self.upstream.write(close_frame(CLOSE_GOING_AWAY, mask=os.urandom(4)))
        self._end()

    def _end(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.upstream.owner = None
        self.upstream.close()
        self.client.close()
        relay = self.client.relay
        relay.unregister(self)
        relay.observer.splice_done(self)
