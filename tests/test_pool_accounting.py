"""The upstream pool's count of open connections (``relay_upstream_connections``) returns to
zero when every connection is gone, however a dial ended.

Found by a soak of a relay subprocess (keep-alive GETs, POSTs, clients leaving mid-request and
mid-response, 38,000 requests in 30 s): afterwards it had no upstream socket left, yet the
gauge read 10 and never came down. A client that leaves while its exchange dials cancels the
dial task (``Exchange.client_lost``); when that lands after uvloop ran ``connection_made`` but
before the task resumed, uvloop's ``create_connection`` closes the transport itself
(``tr._close()`` on any exception from ``await waiter``) and ``connection_lost`` is never
called: its ``_call_connection_lost`` returns early for a closed handle.
"""

from __future__ import annotations

import asyncio

import pytest

from relay.upstreams import Pool, PoolKey
from tests.support.harness import scripted_upstream


@pytest.mark.parametrize("source", [None, "127.0.0.1"])  # uvloop's dial, relay.sourcebind's
async def test_a_dial_cancelled_after_connection_made_is_not_counted_open(
    source: str | None,
) -> None:
    pool = Pool(connect_timeout_s=5.0, source_address=source)
    gone = asyncio.Event()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until relay's side goes
        gone.set()
        writer.close()

    async with scripted_upstream(accept) as port:
        dial = asyncio.get_running_loop().create_task(
            pool.connect(PoolKey("sbx", 0, "127.0.0.1", port))
        )
        # Spin one loop turn at a time until connection_made has run: the dial task is then
        # woken but has not resumed yet, the moment a client's departure cancels it.
        for _ in range(100_000):  # bounded; a connect on loopback takes a few turns
            if pool.opened or dial.done():
                break
            await asyncio.sleep(0)
        assert pool.opened == 1
        assert not dial.done()
        dial.cancel()
        for _ in range(100):
            if dial.done():
                break
            await asyncio.sleep(0.01)
        assert dial.cancelled()
        # The socket itself is closed (the upstream sees its end): only the count was wrong.
        await asyncio.wait_for(gone.wait(), 5)
        for _ in range(20):  # a connection_lost still to come would run in these turns
            await asyncio.sleep(0.01)
        assert pool.opened == 0
