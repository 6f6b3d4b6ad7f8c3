"""What relay answers when a forwarded request's upstream fails (SPEC §5).

Each function maps one kind of failure, given the request's decision, to the :class:`Reject`
relay answers with if the final response has not started yet (``relay.forward`` decides how
a started response ends instead). These answers come after the route lookup, so they name the
sandbox (``sandboxId``).

| failure                                 | sandbox              | management upstream        |
|-----------------------------------------|----------------------|----------------------------|
| no connection (refused, timed out)      | 502 port_closed      | 502 management_unavailable |
| relay's limits (EMFILE, no local port)  | 503 overloaded       | 503 overloaded             |
| closed before the response head         | 502 upstream_error   | 502 management_unavailable |
| a response that cannot be relayed       | 502 upstream_error   | 502 upstream_error         |
| the route was removed (SPEC §3)         | 502 not_found        |                            |
| the route changed (SPEC §3)             | 502 route_changed    |                            |
| relay stops (drain, stop)               | 503 draining         | 503 draining               |
"""

from __future__ import annotations

from relay.core.model import Decision, Forward, Kind, Reason, Reject

# A draining relay's answer: retry in a second, on another relay behind the same name.
DRAINING_RETRY_AFTER_S = 1
# An overloaded relay's (past listen.max_connections, or out of descriptors): the same.
OVERLOADED_RETRY_AFTER_S = 1


def sandbox_of(decision: Decision | None) -> str | None:
    if isinstance(decision, Forward) and decision.target is not None:
        return decision.target.sandbox_id
    return None


def unreachable(decision: Forward, *, exhausted: bool = False) -> Reject:
    """The upstream could not be dialled (after the retries of ``relay.upstreams``).

    ``exhausted``: relay could not even make the socket (its descriptor limit, EMFILE; the
    system's, ENFILE; kernel memory), or give it a local port or address (no ephemeral port
    left, or ``upstream.source_address`` gone from the host: EADDRNOTAVAIL, EADDRINUSE;
    ``relay.dial.shortage``). Nothing was sent to the upstream: relay is overloaded
    (SPEC §5: 503 with Retry-After, as past ``listen.max_connections``). A 502 "port is not
    open" blamed the guest: SDK 2.63 turns it into SandboxUnreachableException, and the access
    log and ``relay_refusals_total`` said port_closed (found by review, at a lowered
    RLIMIT_NOFILE; then for EADDRNOTAVAIL, by the next one). A CORS preflight still gets
    envd's 204, as for relay's other 503s.
    """
    if exhausted:
        return Reject(
            reason=Reason.OVERLOADED,
            retry_after=OVERLOADED_RETRY_AFTER_S,
            sandbox_id=sandbox_of(decision),
            envd_preflight=decision.envd_preflight,
        )
    if decision.kind is Kind.MANAGEMENT:
        return Reject(reason=Reason.MANAGEMENT_UNAVAILABLE)
    assert decision.target is not None
    return Reject(
        reason=Reason.PORT_CLOSED,
        sandbox_id=decision.target.sandbox_id,
        port=decision.target.port,
        envd_preflight=decision.envd_preflight,
    )


def closed_early(decision: Decision | None) -> Reject:
    """The upstream closed (or reset) the connection before its response head."""
    if isinstance(decision, Forward) and decision.kind is Kind.MANAGEMENT:
        return Reject(reason=Reason.MANAGEMENT_UNAVAILABLE)
    return Reject(
        reason=Reason.UPSTREAM_ERROR,
        detail="The sandbox closed the connection before answering",
        sandbox_id=decision.target.sandbox_id
        if isinstance(decision, Forward) and decision.target
        else None,
    )


def malformed(decision: Decision | None) -> Reject:
    """The upstream's response cannot be relayed (bad status, head too large, bad framing)."""
    return Reject(reason=Reason.UPSTREAM_ERROR, sandbox_id=sandbox_of(decision))


def revoked(decision: Decision | None, answer: Reason) -> Reject:
    """The sandbox's route was revoked while the request was in flight (SPEC §3): NOT_FOUND
    when it was removed, ROUTE_CHANGED when it changed; DRAINING when relay stops (drain or
    stop: one answer, with its Retry-After)."""
    retry_after = DRAINING_RETRY_AFTER_S if answer is Reason.DRAINING else None
    return Reject(reason=answer, sandbox_id=sandbox_of(decision), retry_after=retry_after)
