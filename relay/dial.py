"""Dialing an upstream: how often a refused connect is tried again, and what a failed dial means.

``relay.upstreams.Pool.connect`` dials; this module holds what it dials by and reports with:
the retry delays of a refused connect (SPEC §4), :func:`shortage`, which tells a failure for want
of relay's own resources (descriptors, local ports, its source address: answered 503) from one
that says something about the upstream (502), and :class:`DialError`, what a dial raises.
"""

from __future__ import annotations

import errno
from typing import Protocol

# SPEC §4 / E2B's SandboxProxyRetries: envd's port forwarding can lag the route by up to 1 s.
RETRY_DELAYS_S = (0.1, 0.2, 0.3, 0.4)

# A socket relay could not make for want of its own resources, not the upstream's: its
# descriptor limit (EMFILE, RLIMIT_NOFILE), the system's (ENFILE), kernel memory. Answered 503
# (relay.core.failures.unreachable), and logged at most once per EXHAUSTED_LOG_S: at the limit
# every request fails so, hundreds of lines a second.
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
EXHAUSTED_LOG_S = 10.0

# What a dial ran short of when it failed for want of relay's own resources (DialError.shortage).
DESCRIPTORS = "descriptors"  # EXHAUSTED
PORTS = "ports"  # no local port left towards this address and port: connect's EADDRNOTAVAIL
SOURCE_PORTS = "source ports"  # none of source_address's left towards it: connect's EADDRNOTAVAIL
SOURCE_GONE = "source address"  # bind(source_address): EADDRNOTAVAIL, no interface has it


def shortage(code: int | None, source: str | None, *, at_bind: bool = False) -> str | None:
    """What relay ran short of, from a failed dial's errno, or None when the failure says
    something about the upstream (refused, unreachable) or the route (a family mismatch).

    A local port or address is relay's host's, not the guest's: nothing was sent to the
    guest, so "port is not open" (502) blamed it wrongly, as for EMFILE. Connect picks a
    port free towards this destination alone, with a source address too (relay.sourcebind
    binds it with IP_BIND_ADDRESS_NO_PORT), and fails with EADDRNOTAVAIL when none is
    (checked in a network namespace with a 4-port range). ``at_bind``: the bind to the source
    address failed (relay.sourcebind.BindError): EADDRNOTAVAIL there means no interface has
    the address; EADDRINUSE, that a kernel without IP_BIND_ADDRESS_NO_PORT (before Linux 4.2)
    found no port of it free towards every destination (TIME_WAIT included).

    =============  ===========  ============  ============
    errno          no source    source: bind  connect
    =============  ===========  ============  ============
    EMFILE, ...    DESCRIPTORS  DESCRIPTORS   DESCRIPTORS
    EADDRNOTAVAIL  PORTS        SOURCE_GONE   SOURCE_PORTS
    EADDRINUSE     None         SOURCE_PORTS  None
    =============  ===========  ============  ============
    """
    if code in EXHAUSTED:
        return DESCRIPTORS
    if not source:
        return PORTS if code == errno.EADDRNOTAVAIL else None
    if at_bind and code == errno.EADDRNOTAVAIL:
        return SOURCE_GONE
    if at_bind and code == errno.EADDRINUSE:
        return SOURCE_PORTS
    return SOURCE_PORTS if code == errno.EADDRNOTAVAIL else None


class DialObserver(Protocol):
    """Metrics hook (``relay.observe.Observer``): connect time and failures."""

    def dial_done(self, seconds: float) -> None: ...
    def dial_failed(self, reason: str) -> None: ...


class DialError(Exception):
    """The upstream could not be reached; ``refused`` when it actively refused; ``shortage``
    (:func:`shortage`) when relay ran out of its own descriptors, ports or source address."""

    def __init__(self, message: str, *, refused: bool, shortage: str | None = None) -> None:
        super().__init__(message)
        self.refused = refused
        self.shortage = shortage

    @property
    def exhausted(self) -> bool:
        """relay's own resources failed it: answered 503 overloaded, not 502 port_closed."""
        return self.shortage is not None
