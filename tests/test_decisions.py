"""DecisionMemory is transparent: whatever it remembers, a fresh ``decide`` agrees.

A property over sequences of requests and clock steps: signed URLs that expire (in several
spellings of ``signature_expiration``), unexpiring and bad signatures, tokens and app ports,
asked again and again while the clock moves forward. At every step the remembered answer must
equal ``relay.core.decide`` for the same head at the same second (relay/decisions.py).
"""

from __future__ import annotations

import urllib.parse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.core.auth import file_signature
from relay.core.decide import FeedState, Settings, decide
from relay.core.model import RequestHead, Route
from relay.core.routes import RouteTable
from relay.decisions import DecisionMemory

SETTINGS = Settings(domains=("e2b.test",))
TABLE = RouteTable.of(
    {
        "sbx1": Route(sandbox_id="sbx1", address="10.0.0.5", envd_token="tok"),
        "app1": Route(
            sandbox_id="app1", address="10.0.0.6", traffic_token="ttok", max_connections=0
        ),
    }
)
FEED = FeedState(ready=True)
T0 = 1_800_000_000


def _signed(exp: int | None, exp_name: str = "signature_expiration", token: str = "tok") -> bytes:
    signature = urllib.parse.quote(file_signature("/f", "read", "u", token, exp), safe="")
    target = f"/files?path=%2Ff&username=u&signature={signature}"
    if exp is not None:
        target += f"&{exp_name}={exp}"
    return target.encode()


def _head(target: bytes, host: bytes, *extra: tuple[bytes, bytes]) -> RequestHead:
    return RequestHead(
        method=b"GET", target=target, version="1.1", headers=((b"Host", host), *extra), peer="p"
    )


ENVD = b"49983-sbx1.e2b.test"
HEADS = [
    _head(_signed(T0 + 3), ENVD),
    _head(_signed(T0 + 3, "signature%5Fexpiration"), ENVD),
    _head(_signed(T0 + 3, "SIGNATURE_EXPIRATION"), ENVD),  # not the parameter: unsigned exp
    _head(_signed(T0 + 6), ENVD),
    _head(_signed(T0), ENVD),
    _head(_signed(None), ENVD),
    _head(_signed(T0 + 3, token="wrong"), ENVD),
    _head(_signed(T0 + 3) + b"&signature_expiration=1", ENVD),  # repeated: refused
    _head(b"/health", ENVD, (b"X-Access-Token", b"tok")),
    _head(b"/x?q=%41", b"8080-app1.e2b.test", (b"E2b-Traffic-Access-Token", b"ttok")),
    _head(b"/x", b"8080-app1.e2b.test"),
]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(HEADS) - 1), st.integers(0, 2)), min_size=1, max_size=40)
)
def test_remembered_decisions_equal_fresh_ones(steps: list[tuple[int, int]]) -> None:
    memory = DecisionMemory()
    clock = [float(T0)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("relay.decisions.time.time", lambda: clock[0])
        for index, advance in steps:
            clock[0] += advance
            head = HEADS[index]
            remembered = memory.decide(head, TABLE, SETTINGS, FEED, {})
            fresh = decide(head, TABLE, SETTINGS, feed=FEED, now=int(clock[0]), inflight={})
            assert remembered == fresh, (index, clock[0] - T0)
