"""What is in flight per sandbox: the live index that revocation ends and limits count.

A forwarded exchange or WebSocket splice is registered in ``Hub.live`` under its sandbox
(:func:`sandbox_of`) while it runs, so that a revoked route ends it at once (SPEC §3).
:class:`Inflight` reads ``decide``'s in-flight counts (SPEC §5a ``max_connections``) off that
same index; :class:`SharedInflight` adds the other workers' counts from the supervisor's shared
table (``relay.sharedcount``) for a worker (``relay.runtime.WorkerRelay``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from relay.core.model import Decision, Forward, Reason

if TYPE_CHECKING:
    from relay.sharedcount import SharedCounts


class Live(Protocol):
    """An exchange or splice that a revocation can end."""

    @property
    def decision(self) -> Decision | None: ...

    def revoke(self, answer: Reason) -> bool:
        """End it now, answering ``answer`` if no response has started; False if it had
        already ended (nothing to count)."""
        ...


class Inflight(Mapping[str, int]):
    """In-flight exchanges per sandbox (SPEC §5a ``max_connections``), read off the live
    index: the count is the size of the sandbox's set, so registering an exchange keeps one
    structure, not a set and a counter."""

    __slots__ = ("_live",)

    def __init__(self, live: dict[str, set[Live]]) -> None:
        self._live = live

    def __getitem__(self, sandbox_id: str) -> int:
        return len(self._live[sandbox_id])

    def get(self, sandbox_id: str, default: int = 0) -> int:  # type: ignore[override]
        items = self._live.get(sandbox_id)
        return default if items is None else len(items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)


class SharedInflight(Inflight):
    """A worker's count for ``decide``: its own exchanges (exact, as in a single relay) plus
    the other workers' (``relay.sharedcount``: an estimate that is never too low). It also
    keeps which live items this worker added to the shared table, with the sandbox each was
    counted for, so that what an item added is what its end takes away."""

    __slots__ = ("_shared", "counted")

    def __init__(self, live: dict[str, set[Live]], shared: SharedCounts) -> None:
        super().__init__(live)
        self._shared = shared
        self.counted: dict[Live, str] = {}

    def __getitem__(self, sandbox_id: str) -> int:
        return self.get(sandbox_id)

    def get(self, sandbox_id: str, default: int = 0) -> int:  # type: ignore[override]
        # decide() asks only about a sandbox whose route has a limit.
        return super().get(sandbox_id, default) + self._shared.others(sandbox_id)

    def count(self, item: Live, sandbox_id: str) -> None:
        """``item``, to a sandbox whose route has a limit, is in flight in this worker."""
        if item not in self.counted:
            self.counted[item] = sandbox_id
            self._shared.add(sandbox_id)

    def release(self, item: Live) -> None:
        sandbox_id = self.counted.pop(item, None)
        if sandbox_id is not None:
            self._shared.take(sandbox_id)


def sandbox_of(item: Live) -> str | None:
    decision = item.decision
    if isinstance(decision, Forward) and decision.target is not None:
        return decision.target.sandbox_id
    return None
