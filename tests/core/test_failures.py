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
