"""relay/core/failures.py: the answer for each upstream failure, as a table."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from relay.core import failures
from relay.core.model import Decision, Forward, Framing, Kind, Reason, Reject, Route, Target


def forward(kind: Kind) -> Forward:
    managed = kind is Kind.MANAGEMENT
    return Forward(
        kind=kind,
        target=None if managed else Target(sandbox_id="sbx", port=3000),
        route=None if managed else Route(sandbox_id="sbx", address="10.0.0.2"),
        method=b"GET",
        path=b"/",
        headers=(),
        framing=Framing.NONE,
        content_length=0,
        wire=b"GET / HTTP/1.1\r\n\r\n",
    )


APP = forward(Kind.APP)
API = forward(Kind.MANAGEMENT)
CLOSED = "The sandbox closed the connection before answering"


@pytest.mark.parametrize(
    ("failure", "decision", "expected"),
    [
        pytest.param(
            failures.unreachable,
            APP,
            Reject(reason=Reason.PORT_CLOSED, sandbox_id="sbx", port=3000),
            id="unreachable-sandbox",
        ),
        pytest.param(
            failures.unreachable,
            API,
            Reject(reason=Reason.MANAGEMENT_UNAVAILABLE),
            id="unreachable-management",
        ),
        pytest.param(
            partial(failures.unreachable, exhausted=True),
            APP,
            Reject(reason=Reason.OVERLOADED, sandbox_id="sbx", retry_after=1),
            id="exhausted-sandbox",
        ),
        pytest.param(
            partial(failures.unreachable, exhausted=True),
            API,
            Reject(reason=Reason.OVERLOADED, retry_after=1),
            id="exhausted-management",
        ),
        pytest.param(
            failures.closed_early,
            APP,
            Reject(reason=Reason.UPSTREAM_ERROR, detail=CLOSED, sandbox_id="sbx"),
            id="closed-sandbox",
        ),
        pytest.param(
            failures.closed_early,
            API,
            Reject(reason=Reason.MANAGEMENT_UNAVAILABLE),
            id="closed-management",
        ),
        pytest.param(
            failures.closed_early,
            None,
            Reject(reason=Reason.UPSTREAM_ERROR, detail=CLOSED),
            id="closed-undecided",
        ),
        pytest.param(
            failures.malformed,
            APP,
            Reject(reason=Reason.UPSTREAM_ERROR, sandbox_id="sbx"),
            id="malformed-sandbox",
        ),
        pytest.param(
            failures.malformed,
            API,
            Reject(reason=Reason.UPSTREAM_ERROR),
            id="malformed-management",
        ),
        pytest.param(
            partial(failures.revoked, answer=Reason.NOT_FOUND),
            APP,
            Reject(reason=Reason.NOT_FOUND, sandbox_id="sbx"),
            id="revoked-removed",
        ),
        pytest.param(
            partial(failures.revoked, answer=Reason.ROUTE_CHANGED),
            APP,
            Reject(reason=Reason.ROUTE_CHANGED, sandbox_id="sbx"),
            id="revoked-changed",
        ),
        pytest.param(
            partial(failures.revoked, answer=Reason.NOT_FOUND),
            Reject(reason=Reason.STALE),
            Reject(reason=Reason.NOT_FOUND),
            id="revoked-refused",
        ),
    ],
)
def test_failure_answers(
    failure: Callable[[Any], Reject], decision: Decision | None, expected: Reject
) -> None:
    assert failure(decision) == expected


@pytest.mark.parametrize("exhausted", [False, True])
def test_an_envd_preflight_relay_cannot_dial_for_keeps_envds_204(exhausted: bool) -> None:
    """A CORS preflight to envd that relay answers itself gets the 204 envd's rs/cors would
    give (README, "CORS preflights"), whether the port was closed or relay had no descriptor
    for the dial: a browser takes only a 2xx preflight, and reads the real request's answer."""
    preflight = forward(Kind.ENVD)
    preflight.envd_preflight = True
    assert failures.unreachable(preflight, exhausted=exhausted).envd_preflight
