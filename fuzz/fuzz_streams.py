"""atheris: relay.core.streams' trackers give the same boundaries however a stream is read.

relay ends a cut Connect stream with an end-of-stream envelope, and a cut WebSocket with a
Close frame, only at a boundary its tracker reports (SPEC §3, RFC 6455 §5.5.1). An upstream
(a hostile guest) chooses how its bytes are split into reads, so the trackers must report the
same boundaries for the same bytes split at any points as fed whole, and those boundaries
must be the ones an independent parser finds.

Input: ``mode | cuts | n cut positions (2 bytes each) | stream``. ``mode`` bit 0: WebSocket
frames, else Connect envelopes; bit 1: a read that is one whole envelope goes through
``EnvelopeTracker.whole`` first, as ``relay.respond`` passes a whole chunk; bits 2-3: the hold
limit (small, so that oversized envelopes pass through unheld).

    fuzz/.venv/bin/python fuzz/fuzz_streams.py -max_total_time=60 fuzz/corpus/streams \
        fuzz/seeds-streams
"""

from __future__ import annotations

import itertools
import sys

import atheris

with atheris.instrument_imports(include=["relay"]):
    from relay.core.streams import END_STREAM_FLAG, EnvelopeTracker, FrameTracker

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from invariants import frame_ends

HOLD_LIMITS = (16, 64, 1024, 256 * 1024)


def envelope_ends(data: bytes) -> tuple[list[int], bool]:
    """Where whole envelopes end (0 included), and whether an end-of-stream one is whole."""
    ends, pos, ended = [0], 0, False
    while len(data) - pos >= 5:
        end = pos + 5 + int.from_bytes(data[pos + 1 : pos + 5], "big")
        if end > len(data):
            break
        ended = ended or bool(data[pos] & END_STREAM_FLAG)
        ends.append(end)
        pos = end
    return ends, ended


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def check_envelopes(stream: bytes, cuts: list[int], hold: int, via_whole: bool) -> None:
    whole = EnvelopeTracker(hold)
    released_whole = whole.feed(stream)
    ends, ended = envelope_ends(stream)
    tracker = EnvelopeTracker(hold)
    released = b""
    for piece in pieces(stream, cuts):
        if via_whole and tracker.whole(piece, 0, len(piece)):
            released += piece  # passed on as it came (relay.respond._whole_chunk)
        else:
            released += tracker.feed(piece)
        assert stream.startswith(released), "released bytes the stream did not have"
        if tracker.at_boundary:
            # A clean end may follow: only whole envelopes reached the client.
            assert len(released) in ends, (len(released), ends)
    assert released == released_whole, (released, released_whole)
    assert tracker.at_boundary == whole.at_boundary
    assert tracker.ended == whole.ended
    rest = tracker.rest()
    assert released + rest == stream, "bytes lost or invented"
    assert rest == whole.rest()
    if ended:
        assert tracker.ended, "a whole end-of-stream envelope went unseen"
    if tracker.ended and tracker.at_boundary:
        assert ended, "an end taken for one at a boundary, the envelope not whole"


def check_frames(stream: bytes, cuts: list[int]) -> None:
    ends = frame_ends(stream)
    whole = FrameTracker()
    whole.feed(stream)
    assert whole.at_boundary == (len(stream) in ends), (whole.at_boundary, len(stream), ends)
    tracker = FrameTracker()
    seen = 0
    for piece in pieces(stream, cuts):
        tracker.feed(piece)
        seen += len(piece)
        assert tracker.at_boundary == (seen in ends), (seen, sorted(ends))


def test_one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    mode, count = data[0], data[1] % 16
    cut_bytes = data[2 : 2 + 2 * count]
    cuts = [int.from_bytes(cut_bytes[i : i + 2], "big") for i in range(0, len(cut_bytes), 2)]
    stream = data[2 + 2 * count :]
    if mode & 1:
        check_frames(stream, cuts)
    else:
        check_envelopes(stream, cuts, HOLD_LIMITS[(mode >> 2) & 3], bool(mode & 2))


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
