"""What route feeds deliver to, and what they are to the relay (implemented by ``Relay``).

A feed that reads whole tables (the file) needs :class:`Sink`; a feed that follows changes
(Redis) also applies deltas and reports when it loses and regains its source, so that the
relay can run the stale clock of SPEC §3. Both are structural protocols: ``Relay`` satisfies
them without inheriting, and tests pass small recording fakes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from relay.core.model import Route
from relay.core.routes import Network, RouteError


class Sink(Protocol):
    """Where a feed delivers whole tables."""

    def install_routes(self, routes: dict[str, Route], source: str) -> None:
        """Replace the table (revoking what changed) and mark it ready."""

    def reject_routes(self, errors: list[RouteError], source: str) -> None:
        """Each malformed route, logged with its id and reason and counted."""

    def feed_failed(self, source: str, message: str) -> None:
        """The source could not be read (logged and counted)."""


class StreamSink(Sink, Protocol):
    """Where a feed that follows changes delivers them."""

    def apply_routes(self, puts: Iterable[Route], deletes: Iterable[str], source: str) -> None:
        """Apply a batch in one swap of the table, revoking what it changed."""

    def feed_broken(self, since: float) -> None:
        """The feed is down, or the table behind it until a resync or a catch-up of several
        reads lands; ``since`` (``time.monotonic()``) is when it was last known good, the
        start of the stale clock."""

    def feed_restored(self) -> None:
        """The feed is back and the table was resynced: stop the stale clock."""


class Feed(Protocol):
    """A route source as the relay runs it."""

    source: str
    allowed: tuple[Network, ...]  # upstream.allowed_cidrs; a reload may replace it
    max_stale_s: float  # routes.max_stale_s, for a feed that must notice a hung source

    async def run(self) -> None:
        """Deliver tables to the sink until cancelled."""

    def load(self) -> object:
        """SIGHUP: read the source again now (the file) or resync (Redis)."""
