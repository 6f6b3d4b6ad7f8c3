"""Checks of the configuration against this machine, run before anything listens.

``relay serve`` runs them as part of start-up (``Relay.start``; once in the supervisor with
several workers); ``relay check-config`` runs them too unless ``--offline``. Each failure is a
:class:`~relay.config.ConfigError` naming the key, so the exit code is 2.
"""

from __future__ import annotations

from relay.config import Config
from relay.netlink import resolve_source
from relay.tlscheck import check_files


def host_checks(config: Config) -> None:
    """The TLS pair (``relay.tlscheck``) and the upstream source address (``relay.netlink``)."""
    if config.listen.tls_cert:
        check_files(
            config.path(config.listen.tls_cert),
            config.path(config.listen.tls_key),
            config.routing.domains,
        )
    resolve_source(config.upstream)
