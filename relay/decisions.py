"""Remembered decisions: ``relay.core.decide`` once per distinct request head.

``decide`` is a pure function of the request head, the route table, the settings and the feed
state, plus the clock (signature expirations only) and the in-flight counts (per-sandbox
limits only). Clients repeat the same heads over and over (an SDK sends the same Host, token
and headers on every call; one signed download link is often fetched more than once, by
retries or by several readers), so
:class:`DecisionMemory` remembers decisions keyed by the whole head until the runtime says the
table, the settings or the feed state changed (``forget``).

What is never remembered: decisions that read the in-flight counts (a route with
``max_connections``), and refusals that may come from the clock (an expired signature looks
like any other 401). A signed URL's Forward is remembered until its ``signature_expiration``
(``Forward.expires``), in a memory of its own so that the common hit never reads the clock.
Bounded: each memory is dropped whenever it holds ``DECISION_MEMORY`` decisions, and a head
of more than ``MEMO_FIELDS`` fields or ``MEMO_BYTES`` bytes (SDKs send about ten fields and
well under 1 KiB) is decided but never remembered, so a client sending ever-new heads costs
relay a full ``decide`` per request and no more memory than ``DECISION_MEMORY`` small entries
(at most ~45 MiB per memory, see ``MEMO_FIELDS``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TypeVar

from relay.core.decide import FeedState, Settings, decide
from relay.core.headers import fields_size
from relay.core.model import Decision, Forward, Reason, RequestHead
from relay.core.routes import RouteTable

DECISION_MEMORY = 4096
# What a remembered head may hold, in fields and in bytes of target, names and values (what
# ``listen.max_header_bytes`` counts, minus the line framing). A key keeps the head's field
# tuple (~130 B of objects per field) and a Forward copies its bytes (``wire``; the target
# also into the path, log path and log line), so an entry costs ~1.5 KB + ~130 B per field +
# 2-4 B per byte: measured ~3 KB for an SDK head (12 fields, 600 B) and ~11 KB at worst
# within these limits, so at most ~45 MiB per memory, against ~12 MiB for one full of SDK
# heads. Unlimited, a 16 KiB head of 1,900 tiny fields cost ~250 KB, 4,096 of them ~1 GB.
MEMO_FIELDS = 32
MEMO_BYTES = 2048

Key = tuple[object, ...]
D = TypeVar("D", bound=Decision)


def rememberable(decision: Decision, head: RequestHead) -> bool:
    """Whether ``decision`` depends on the head, table, settings and feed state alone (and,
    for a Forward with ``expires``, on the clock only through that second)."""
    if isinstance(decision, Forward):
        return not (decision.route is not None and decision.route.max_connections)
    query = head.target.partition(b"?")[2]
    if b"expiration" in query or b"%" in query:
        return False  # an expired signature's refusal depends on the clock (in any spelling)
    return decision.reason is not Reason.SANDBOX_LIMIT


def small(head: RequestHead) -> bool:
    """Whether ``head`` (at most ``MEMO_FIELDS`` fields) is small enough to be remembered.

    Only asked after a full ``decide``, which this costs a few percent of (a loop over at
    most ``MEMO_FIELDS`` fields): a remembered head is never measured again."""
    return len(head.target) + fields_size(head.headers) <= MEMO_BYTES


class DecisionMemory:
    """Two memories keyed by the head's values, and a shortcut on the head object itself.

    The shortcut: a timeless decision is also stored on the ``RequestHead`` it was asked for
    (``RequestHead.decided``) with the current epoch, a new one after every ``forget``. A
    kept-alive connection reuses its head object for a repeated request (``relay.request_heads``),
    and the next ``decide`` for it is then an identity check instead of building and hashing
    a key of the whole head (~0.5 µs for a three-field head, more for an SDK's dozen)."""

    __slots__ = ("_expiring", "_timeless", "epoch")

    def __init__(self) -> None:
        self._timeless: dict[Key, Decision] = {}
        self._expiring: dict[Key, Forward] = {}
        self.epoch = object()  # read by Relay.decide, which checks the shortcut itself

    def decide(
        self,
        head: RequestHead,
        table: RouteTable,
        settings: Settings,
        feed: FeedState,
        inflight: Mapping[str, int],
    ) -> Decision:
        """``relay.core.decide(head, ...)``, remembered when it may be."""
        shortcut = head.decided
        if shortcut is not None and shortcut[0] is self.epoch:
            return shortcut[1]
        if len(head.headers) > MEMO_FIELDS:
            # Never remembered (MEMO_FIELDS), so not looked for: the lookup would only hash
            # every field for nothing.
            return decide(head, table, settings, feed=feed, now=int(time.time()), inflight=inflight)
        key = (
            head.method,
            head.target,
            head.version,
            head.headers,
            head.peer,
            head.tls,
            head.upgrade,
        )
        decision = self._timeless.get(key)
        if decision is not None:
            head.decided = (self.epoch, decision)
            return decision
        now = int(time.time())
        expiring = self._expiring.get(key)
        if expiring is not None and expiring.expires is not None and now <= expiring.expires:
            return expiring  # ``exp == now`` is still valid (auth.check_signature)
        decision = decide(head, table, settings, feed=feed, now=now, inflight=inflight)
        if rememberable(decision, head) and small(head):
            if isinstance(decision, Forward) and decision.expires is not None:
                _remember(self._expiring, key, decision)
            else:
                _remember(self._timeless, key, decision)
                head.decided = (self.epoch, decision)
        return decision

    def forget(self) -> None:
        """The table, the settings or the feed state changed: no remembered decision holds."""
        self._timeless.clear()
        self._expiring.clear()
        self.epoch = object()  # and none remembered on a head object


def _remember(memory: dict[Key, D], key: Key, decision: D) -> None:
    if len(memory) >= DECISION_MEMORY:
        memory.clear()
    memory[key] = decision
