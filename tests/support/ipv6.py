"""Whether this machine can run the IPv6 tests: on ``::1``, the loopback only."""

from __future__ import annotations

import socket


def no_ipv6_loopback() -> str | None:
    """Why IPv6 on ::1 cannot be tested here, or None when it can."""
    if not socket.has_ipv6:
        return "Python was built without IPv6"
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        return f"cannot bind ::1 ({exc.strerror})"
    return None
