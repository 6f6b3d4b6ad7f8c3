"""Checks of the configuration against this machine, run before anything listens.

``relay serve`` runs them as part of start-up (``Relay.start``; once in the supervisor with
several workers); ``relay check-config`` runs them too unless ``--offline``. Each failure is a
:class:`~relay.config.ConfigError` naming the key, so the exit code is 2.
"""

from __future__ import annotations

from relay.config import Config
from relay.netlink import resolve_source
from relay.tls import load_checked


def host_checks(config: Config) -> None:
    """The TLS pair (``relay.tlscheck``, then loaded as it will be served: ``relay.tls``)
    and the upstream source address (``relay.netlink``)."""
    if config.listen.tls_cert:
        load_checked(
            config.path(config.listen.tls_cert),
            config.path(config.listen.tls_key),
            config.routing.domains,
        )
    resolve_source(config.upstream)
