"""Stream boundaries: Connect envelopes and WebSocket frames (relay.core.streams)."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from relay.core.streams import (
    MAX_ENVELOPES_PER_READ,
    MAX_FRAMES_PER_READ,
    EnvelopeTracker,
    FrameTracker,
    close_frame,
    end_stream_frame,
)


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return bytes([flags]) + len(payload).to_bytes(4, "big") + payload


def test_end_stream_frame_is_a_connect_end_envelope() -> None:
    frame = end_stream_frame("abc")
    assert frame[0] == 0x02
    body = json.loads(frame[5:])
    assert int.from_bytes(frame[1:5], "big") == len(frame) - 5
    assert body == {
        "error": {
            "code": "unavailable",
            "message": "the connection to sandbox abc ended before the stream completed",
        }
    }


@given(
    payloads=st.lists(st.binary(max_size=40), max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=6),
)
def test_envelopes_are_released_whole_and_in_order(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(envelope(p) for p in payloads)
    points = sorted({c for c in cuts if c < len(stream)} | {0, len(stream)})
    tracker = EnvelopeTracker()
    released = b""
    for a, b in itertools.pairwise(points):
        released += tracker.feed(stream[a:b])
        # whatever was released so far is a whole number of envelopes
        pos = 0
        while pos < len(released):
            pos += 5 + int.from_bytes(released[pos + 1 : pos + 5], "big")
        assert pos == len(released)
    assert released == stream
    assert tracker.at_boundary


def test_large_envelope_streams_through() -> None:
    tracker = EnvelopeTracker(hold_limit=16)
    big = envelope(b"x" * 100)
    boundaries = []
    assert tracker.feed(big[:50]) == big[:50]
    boundaries.append(tracker.at_boundary)
    assert tracker.feed(big[50:] + envelope(b"y")[:3]) == big[50:]
    boundaries.append(tracker.at_boundary)  # the 3 held bytes of "y" were not released
    assert tracker.holding == 3
    assert tracker.feed(envelope(b"y")[3:]) == envelope(b"y")
    boundaries.append(tracker.at_boundary)
    assert boundaries == [False, True, True]


def test_held_bytes_were_never_released() -> None:
    tracker = EnvelopeTracker(hold_limit=16)
    assert tracker.feed(envelope(b"a") + envelope(b"b")[:4]) == envelope(b"a")
    assert tracker.holding == 4  # the stream is mid-envelope...
    assert tracker.at_boundary  # ...but what was released is whole envelopes
    big = envelope(b"x" * 100)
    tracker = EnvelopeTracker(hold_limit=16)
    assert tracker.feed(big[:50]) == big[:50]
    assert not tracker.at_boundary  # an oversized envelope is partly out


def test_upstream_end_frame_is_noticed() -> None:
    tracker = EnvelopeTracker()
    tracker.feed(envelope(b"{}", flags=2))
    assert tracker.ended


def test_an_oversized_end_frame_is_noticed_too() -> None:
    """Passed through unheld, it is still the stream's end: a cut after it must not add a
    second end-of-stream envelope (the Connect protocol allows one, last)."""
    for split in (5, 6, 50):
        tracker = EnvelopeTracker(hold_limit=16)
        end = envelope(b"e" * 100, flags=2)
        assert tracker.feed(end[:split]) + tracker.feed(end[split:]) == end
        assert tracker.ended
        assert tracker.at_boundary


def test_rest_is_what_a_clean_end_finds_held() -> None:
    tracker = EnvelopeTracker()
    assert tracker.feed(b"{}") == b""  # not a whole envelope: held
    assert tracker.rest() == b"{}"
    assert tracker.holding == 0


def ws_frame(payload: bytes, mask: bool) -> bytes:
    n = len(payload)
    if n < 126:
        head = bytes([0x82, (0x80 if mask else 0) | n])
    elif n < 65536:
        head = bytes([0x82, (0x80 if mask else 0) | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x82, (0x80 if mask else 0) | 127]) + n.to_bytes(8, "big")
    return head + (b"abcd" if mask else b"") + payload


@given(
    sizes=st.lists(st.sampled_from([0, 1, 125, 126, 300, 65535, 65536]), max_size=5),
    mask=st.booleans(),
    step=st.integers(min_value=1, max_value=70000),
)
def test_frame_tracker_finds_boundaries(sizes: list[int], mask: bool, step: int) -> None:
    stream = b"".join(ws_frame(b"p" * n, mask) for n in sizes)
    tracker = FrameTracker()
    for i in range(0, len(stream), step):
        tracker.feed(stream[i : i + step])
    assert tracker.at_boundary
    if stream:
        tracker.feed(stream[:1])
        assert not tracker.at_boundary


def test_a_flood_of_tiny_frames_is_no_longer_followed() -> None:
    """Found by review: empty frames cost a loop pass each, and a 256 KiB read of them
    stalled relay for ~56 ms. Past MAX_FRAMES_PER_READ frames in one read, the direction is
    no longer followed (its boundary is unknown: no Close frame that way), for good."""
    tracker = FrameTracker()
    empty = ws_frame(b"", mask=True)
    seen = []
    for frames in (MAX_FRAMES_PER_READ, MAX_FRAMES_PER_READ + 1):
        tracker.feed(empty * frames)
        seen.append(tracker.at_boundary)
    tracker.feed(ws_frame(b"x", mask=False))
    seen.append(tracker.at_boundary)
    assert seen == [True, False, False]  # as many as allowed are still followed


def test_a_flood_of_tiny_envelopes_is_no_longer_followed() -> None:
    """As for WebSocket frames: past MAX_ENVELOPES_PER_READ envelopes in one read a Connect
    stream is passed on as it comes (what was held included) and cut without an
    end-of-stream envelope."""
    empty = b"\x00\x00\x00\x00\x00"
    tracker = EnvelopeTracker()
    allowed = empty * MAX_ENVELOPES_PER_READ
    assert tracker.feed(allowed + empty[:2]) == allowed
    assert tracker.holding == 2
    flood = empty[2:] + empty * MAX_ENVELOPES_PER_READ + b"\x00\x00"
    assert tracker.feed(flood) == empty[:2] + flood
    assert not tracker.at_boundary
    assert tracker.holding == 0
    assert tracker.feed(b"\x02\x00") == b"\x02\x00"  # passed on, not followed
    assert not tracker.whole(empty, 0, 5)
    assert not tracker.ended


def test_close_frames() -> None:
    assert close_frame(1001) == b"\x88\x02\x03\xe9"
    masked = close_frame(1001, mask=b"\x01\x02\x03\x04")
    assert masked[:2] == b"\x88\x82"
    assert bytes(b ^ k for b, k in zip(masked[6:], b"\x01\x02", strict=True)) == b"\x03\xe9"


def test_every_byte_of_an_envelope_length_counts() -> None:
    """A length of 0x01020304 (each of its four bytes non-zero) passes through unheld and is
    followed to its exact end: the next envelope is held from its first byte."""
    tracker = EnvelopeTracker(hold_limit=16)
    length = 0x01020304
    assert tracker.feed(b"\x00\x01\x02\x03\x04" + b"x" * 10) == b"\x00\x01\x02\x03\x04" + b"x" * 10
    rest = b"y" * (length - 10)
    assert tracker.feed(rest) == rest
    assert tracker.at_boundary
    assert tracker.feed(envelope(b"z")[:3]) == b""
    assert tracker.holding == 3


def test_an_envelope_in_pieces_is_held_whole_and_released_once() -> None:
    """Pieces of a held envelope are kept apart and joined once, when it completes (found by
    review: joined at every piece, 256 KiB in 1-byte chunks cost ~2.5 s of CPU here, 0.1 s
    now); what is held is counted and released the same either way."""
    whole = envelope(b"y" * 1000)
    tracker = EnvelopeTracker()
    for i, byte in enumerate(whole[:-1]):
        assert tracker.feed(bytes([byte])) == b""
        assert tracker.holding == i + 1
    assert tracker.feed(whole[-1:] + whole[:3]) == whole  # and the next one's first bytes
    assert tracker.holding == 3
    cut = EnvelopeTracker()
    for byte in whole[:700]:
        cut.feed(bytes([byte]))
    assert cut.rest() == whole[:700]
    assert cut.holding == 0
    assert cut.feed(whole) == whole
