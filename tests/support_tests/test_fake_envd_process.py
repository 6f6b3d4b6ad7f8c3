"""The fake envd's process.Process service, driven over raw Connect like the SDK drives envd."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import Mapping
from typing import Any

import pytest

from tests.support.connect import (
    FLAG_END_STREAM,
    ConnectStream,
    Frame,
    JSONDict,
    stream,
    unary,
)
from tests.support.fake_envd import SDK_STREAM_HEADERS, FakeEnvd, sdk_start_request

START = "/process.Process/Start"
CONNECT = "/process.Process/Connect"


async def run_stream(
    envd: FakeEnvd, method: str, request: JSONDict, headers: Mapping[str, str] | None = None
) -> tuple[ConnectStream, list[Frame]]:
    async with ConnectStream(envd.host, envd.port, method, request, headers) as call:
        frames = [frame async for frame in call]
    return call, frames


def events(frames: list[Frame]) -> list[JSONDict]:
    return [f.payload["event"] for f in frames if not f.is_end]


def output(frames: list[Frame], stream_name: str) -> bytes:
    return b"".join(
        base64.b64decode(e["data"][stream_name])
        for e in events(frames)
        if stream_name in e.get("data", {})
    )


async def call_unary(envd: FakeEnvd, method: str, request: JSONDict) -> tuple[int, Any]:
    result = await unary(envd.host, envd.port, method, request)
    return result.status, result.json()


async def test_start_streams_real_output_then_end_and_end_of_stream(envd: FakeEnvd) -> None:
    command = "for i in $(seq 5); do echo $i; sleep 0.1; done"
    call, frames = await run_stream(envd, START, sdk_start_request(command), SDK_STREAM_HEADERS)

    assert call.head is not None
    assert call.head.status == 200
    assert call.head.header("Content-Type") == "application/connect+json"
    assert call.head.header("Transfer-Encoding") == "chunked"
    first = events(frames)[0]
    assert set(first) == {"start"}
    assert first["start"]["pid"] > 0
    assert output(frames, "stdout") == b"1\n2\n3\n4\n5\n"
    # Flushed as produced: the data frames are spread over the command's run time.
    data_frames = [f for f in frames if "data" in f.payload.get("event", {})]
    assert data_frames[-1].arrival - data_frames[0].arrival > 0.3
    assert events(frames)[-1] == {"end": {"exited": True, "status": "exit status 0"}}
    assert frames[-1].flags == FLAG_END_STREAM
    assert frames[-1].payload == {}
    assert call.clean_end


async def test_end_event_fields_match_go_process_state(envd: FakeEnvd) -> None:
    # Not a login shell: a host's /etc/profile must not add to stderr.
    request = {"process": {"cmd": "/bin/sh", "args": ["-c", "echo out; echo err >&2; exit 3"]}}
    _, frames = await run_stream(envd, START, request)
    assert output(frames, "stdout") == b"out\n"
    assert output(frames, "stderr") == b"err\n"
    assert events(frames)[-1] == {
        "end": {
            "exitCode": 3,
            "exited": True,
            "status": "exit status 3",
            "error": "exit status 3",
        }
    }


async def test_missing_command_is_exit_127_from_the_shell_wrapper(envd: FakeEnvd) -> None:
    request = {"process": {"cmd": "/no/such/binary"}}
    _, frames = await run_stream(envd, START, request)
    assert events(frames)[-1]["end"]["exitCode"] == 127
    assert b"/no/such/binary" in output(frames, "stderr")


async def test_cwd_and_envs(envd: FakeEnvd) -> None:
    envd.host_path("/home/user/work").mkdir()
    request = sdk_start_request('echo "$FOO:$USER"; pwd')
    request["process"] |= {"cwd": "/home/user/work", "envs": {"FOO": "bar"}}
    _, frames = await run_stream(envd, START, request)
    lines = output(frames, "stdout").decode().splitlines()
    assert lines[0] == "bar:user"
    assert lines[1] == str(envd.host_path("/home/user/work"))


async def test_missing_cwd_fails_the_stream_with_invalid_argument(envd: FakeEnvd) -> None:
    request = sdk_start_request("true")
    request["process"]["cwd"] = "/nowhere"
    call, frames = await run_stream(envd, START, request)
    assert call.head is not None
    assert call.head.status == 200  # stream errors travel in the end frame
    assert [f.payload for f in frames] == [
        {"error": {"code": "invalid_argument", "message": "cwd '/nowhere' does not exist"}}
    ]


async def test_keepalive_fires_when_idle(envd: FakeEnvd) -> None:
    headers = {"Keepalive-Ping-Interval": "1"}
    _, frames = await run_stream(envd, START, sdk_start_request("sleep 1.4"), headers)
    kinds = [next(iter(e)) for e in events(frames)]
    assert kinds == ["start", "keepalive", "end"]
    assert frames[1].payload == {"event": {"keepalive": {}}}
    assert 0.8 < frames[1].arrival - frames[0].arrival < 1.3


async def test_keepalive_ticker_is_reset_by_data(envd: FakeEnvd) -> None:
    # Without the reset a keepalive would fire at 1.0 s, between the two echoes.
    command = "sleep 0.6; echo a; sleep 0.7; echo b"
    headers = {"Keepalive-Ping-Interval": "1"}
    _, frames = await run_stream(envd, START, sdk_start_request(command), headers)
    kinds = [next(iter(e)) for e in events(frames)]
    assert kinds == ["start", "data", "data", "end"]


async def test_connect_timeout_kills_the_process_and_ends_the_stream(envd: FakeEnvd) -> None:
    started = time.monotonic()
    headers = {"Connect-Timeout-Ms": "300"}
    call, frames = await run_stream(envd, START, sdk_start_request("sleep 5"), headers)
    assert time.monotonic() - started < 2
    pid = events(frames)[0]["start"]["pid"]
    assert call.end is not None
    assert call.end.payload == {
        "error": {"code": "deadline_exceeded", "message": "context deadline exceeded"}
    }
    for _ in range(50):
        if pid not in envd.process.running:
            break
        await asyncio.sleep(0.02)
    assert pid not in envd.process.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_background_process_connect_list_and_kill(envd: FakeEnvd) -> None:
    request = sdk_start_request("echo ready; sleep 30")
    request["tag"] = "bg"
    async with ConnectStream(envd.host, envd.port, START, request) as started:
        iterator = aiter(started)
        pid = (await anext(iterator)).payload["event"]["start"]["pid"]

        status, listing = await call_unary(envd, "/process.Process/List", {})
        assert status == 200
        assert listing == {
            "processes": [
                {
                    "config": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo ready; sleep 30"]},
                    "pid": pid,
                    "tag": "bg",
                }
            ]
        }

        async with ConnectStream(
            envd.host, envd.port, CONNECT, {"process": {"pid": pid}}
        ) as attached:
            attached_iter = aiter(attached)
            assert (await anext(attached_iter)).payload == {"event": {"start": {"pid": pid}}}
            status, body = await call_unary(
                envd,
                "/process.Process/SendSignal",
                {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"},
            )
            assert (status, body) == (200, {})
            rest = [frame async for frame in attached_iter]
        killed = {"exitCode": -1, "status": "signal: killed", "error": "signal: killed"}
        assert events(rest)[-1] == {"end": killed}
        assert rest[-1].payload == {}
        original = [frame async for frame in iterator]
        assert events(original)[-1] == {"end": killed}

    # Retained for a late Connect (service.go terminatedRetentionTTL): start + end, then EOS.
    _, late = await run_stream(envd, CONNECT, {"process": {"tag": "bg"}})
    assert [f.payload for f in late] == [
        {"event": {"start": {"pid": pid}}},
        {"event": {"end": killed}},
        {},
    ]


async def test_unknown_pid_and_signal(envd: FakeEnvd) -> None:
    status, body = await call_unary(
        envd,
        "/process.Process/SendSignal",
        {"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"},
    )
    assert (status, body) == (
        404,
        {"code": "not_found", "message": "process with pid 999999 not found"},
    )
    _, frames = await run_stream(envd, CONNECT, {"process": {"pid": 999999}})
    assert frames[-1].payload["error"]["code"] == "not_found"


async def test_stdin_send_and_close(envd: FakeEnvd) -> None:
    request = {"process": {"cmd": "cat"}}  # stdin absent means enabled (handler.go)
    async with ConnectStream(envd.host, envd.port, START, request) as call:
        iterator = aiter(call)
        pid = (await anext(iterator)).payload["event"]["start"]["pid"]
        data = base64.b64encode(b"hello\n").decode()
        status, _ = await call_unary(
            envd,
            "/process.Process/SendInput",
            {"process": {"pid": pid}, "input": {"stdin": data}},
        )
        assert status == 200
        status, _ = await call_unary(envd, "/process.Process/CloseStdin", {"process": {"pid": pid}})
        assert status == 200
        frames = [frame async for frame in iterator]
    assert output(frames, "stdout") == b"hello\n"
    assert events(frames)[-1] == {"end": {"exited": True, "status": "exit status 0"}}


async def test_stdin_disabled_rejects_input(envd: FakeEnvd) -> None:
    async with ConnectStream(
        envd.host, envd.port, START, sdk_start_request("sleep 5", stdin=False)
    ) as call:
        pid = (await anext(aiter(call))).payload["event"]["start"]["pid"]
        status, body = await call_unary(
            envd,
            "/process.Process/SendInput",
            {"process": {"pid": pid}, "input": {"stdin": "eA=="}},
        )
        await call_unary(
            envd,
            "/process.Process/SendSignal",
            {"process": {"pid": pid}, "signal": "SIGNAL_SIGTERM"},
        )
    assert (status, body) == (
        500,
        {"code": "internal", "message": "error writing to stdin: stdin not enabled or closed"},
    )


async def test_pty_output_input_and_resize(envd: FakeEnvd) -> None:
    request = {
        "process": {"cmd": "/bin/bash", "args": ["-c", "stty size; read a; stty size"]},
        "pty": {"size": {"cols": 80, "rows": 24}},
    }
    async with ConnectStream(envd.host, envd.port, START, request) as call:
        iterator = aiter(call)
        pid = (await anext(iterator)).payload["event"]["start"]["pid"]
        seen = b""
        while b"24 80" not in seen:
            event = (await anext(iterator)).payload["event"]
            seen += base64.b64decode(event["data"]["pty"])
        resize = {"process": {"pid": pid}, "pty": {"size": {"cols": 100, "rows": 30}}}
        assert (await call_unary(envd, "/process.Process/Update", resize))[0] == 200
        keys = base64.b64encode(b"go\n").decode()
        send = {"process": {"pid": pid}, "input": {"pty": keys}}
        assert (await call_unary(envd, "/process.Process/SendInput", send))[0] == 200
        frames = [frame async for frame in iterator]
    assert b"30 100" in output(frames, "pty")
    assert events(frames)[-1]["end"]["exited"] is True
    status, _ = await call_unary(envd, "/process.Process/CloseStdin", {"process": {"pid": 999999}})
    assert status == 404


async def test_stream_helper_yields_arrival_flags_payload(envd: FakeEnvd) -> None:
    frames = [f async for f in stream(envd.host, envd.port, START, sdk_start_request("echo x"))]
    arrival, flags, payload = frames[0]
    assert arrival > 0
    assert flags == 0
    assert "start" in payload["event"]
    assert frames[-1].is_end


async def test_break_streams_cuts_the_connection_without_an_end_frame(envd: FakeEnvd) -> None:
    command = "for i in $(seq 20); do echo $i; sleep 0.1; done"
    async with ConnectStream(envd.host, envd.port, START, sdk_start_request(command)) as call:
        frames = []
        async for frame in call:
            frames.append(frame)
            if "data" in frame.payload.get("event", {}):
                assert envd.break_streams() == 1
    assert call.end is None
    assert not call.clean_end
    assert output(frames, "stdout").startswith(b"1\n")
    assert envd.live_exchanges == 0


async def test_break_streams_mid_envelope_leaves_a_partial_frame(envd: FakeEnvd) -> None:
    command = "for i in $(seq 20); do echo $i; sleep 0.1; done"
    async with ConnectStream(envd.host, envd.port, START, sdk_start_request(command)) as call:
        async for frame in call:
            if "data" in frame.payload.get("event", {}):
                assert envd.break_streams(mid_envelope=True) == 1
    assert call.end is None
    assert not call.clean_end
    assert call.truncated_bytes == 5 + 8  # the announced envelope never completed
