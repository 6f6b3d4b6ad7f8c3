"""The Connect helpers: envelopes, the incremental decoder, the raw client's framing checks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.connect import (
    FLAG_END_STREAM,
    ConnectError,
    EnvelopeDecoder,
    decode_single_envelope,
    end_stream_envelope,
    envelope,
)


def test_envelope_layout() -> None:
    frame = envelope({"a": 1})
    assert frame == b"\x00\x00\x00\x00\x07" + b'{"a":1}'


def test_end_stream_envelopes() -> None:
    assert end_stream_envelope() == b"\x02\x00\x00\x00\x02{}"
    error = end_stream_envelope(ConnectError("unavailable", "gone"))
    assert error[0] == FLAG_END_STREAM
    assert json.loads(error[5:]) == {"error": {"code": "unavailable", "message": "gone"}}


def test_connect_error_rejects_unknown_codes() -> None:
    with pytest.raises(ValueError, match="not a Connect code"):
        ConnectError("teapot", "no")


@pytest.mark.parametrize(
    ("code", "status"),
    [("not_found", 404), ("unauthenticated", 401), ("unavailable", 503), ("canceled", 499)],
)
def test_connect_error_status(code: str, status: int) -> None:
    assert ConnectError(code, "x").http_status == status


@given(
    payloads=st.lists(st.dictionaries(st.text(max_size=5), st.integers()), max_size=5),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
)
def test_decoder_is_independent_of_how_bytes_are_split(
    payloads: list[dict[str, int]], cuts: list[int]
) -> None:
    stream = b"".join(envelope(p) for p in payloads) + end_stream_envelope()
    decoder = EnvelopeDecoder()
    frames = []
    previous = 0
    for cut in [*sorted(c for c in cuts if c < len(stream)), len(stream)]:
        frames += decoder.feed(stream[previous:cut])
        previous = cut
    assert [json.loads(raw) for _, raw in frames] == [*payloads, {}]
    assert [flags for flags, _ in frames] == [0] * len(payloads) + [FLAG_END_STREAM]
    assert decoder.pending == 0


def test_single_envelope_request() -> None:
    assert decode_single_envelope(envelope({"x": 1})) == (0, {"x": 1})
    with pytest.raises(ConnectError, match="exactly one"):
        decode_single_envelope(envelope({}) + envelope({}))
    with pytest.raises(ConnectError, match="exactly one"):
        decode_single_envelope(envelope({"x": 1})[:-1])
