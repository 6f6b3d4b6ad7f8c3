"""The acceptance check of issue 6: after the whole hostile suite, the same relay process
still answers a normal authorized request.

``conftest.pytest_collection_modifyitems`` runs this test last in the session, whatever
order the modules were collected in.
"""

from __future__ import annotations

from tests.hostile.conftest import (
    ENVD_TOKEN,
    TRAFFIC_TOKEN,
    Hostile,
    assert_no_internal_error,
    relay_log,
)
from tests.support.rawhttp import request


async def test_the_same_relay_still_serves_after_the_suite(hostile: Hostile) -> None:
    proc = hostile.relay.proc
    assert proc is not None
    assert proc.pid == hostile.pid
    assert proc.poll() is None, "relay exited during the suite"
    mark = hostile.recorder.mark()
    response = await request(
        hostile.port,
        "POST",
        "/process.Process/List",
        hostile.envd,
        [("X-Access-Token", ENVD_TOKEN), ("Content-Type", "application/json")],
        body=b"{}",
    )
    assert response.status == 200
    assert response.body == b"POST /process.Process/List 2"
    (seen,) = await hostile.recorder.wait_for(mark, 1)
    assert seen.header(b"x-access-token") == []  # strip mode, still
    # A signed URL's signature is a credential too: it reaches neither envd nor the log.
    signed = await request(
        hostile.port,
        "GET",
        "/files?path=%2Fx&signature=v1_SECRETSIGNATURE&signature_expiration=1",
        hostile.envd,
    )
    assert signed.status == 401
    assert_no_internal_error(hostile.relay)
    log = relay_log(hostile.relay)
    for secret in (ENVD_TOKEN, TRAFFIC_TOKEN, "SECRETSIGNATURE"):
        assert secret not in log
