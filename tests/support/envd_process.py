"""process.Process for the fake envd: the RPCs over real subprocesses, and envd's event stream.

Sources: envd ``internal/services/process/{start,connect,list,input,signal,update,service}.go``,
``handler/handler.go`` and ``spec/process/process.proto``. The subprocesses themselves (spawning,
output, the end event) are in ``envd_subprocess``.

What matches envd:
- ``cwd`` and ``envs`` as envd resolves them (PATH, HOME, USER, LOGNAME first).
- Stdin is a pipe unless the Start request says ``"stdin": false`` (absent means true, for old
  SDKs; handler.go).
- Events: start{pid} → data{stdout|stderr|pty} → end{…}; a keepalive when the ticker fires, the
  ticker reset by each data event.
- ``Connect-Timeout-Ms`` on Start bounds the process itself (start.go determineTimeoutFromHeader):
  it is SIGKILLed when the deadline passes, whether or not a client is still attached.
- A pid that exited less than 30 s ago still answers Connect with start + end (service.go
  terminatedRetentionTTL).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal

from tests.support.connect import ConnectError, JSONDict
from tests.support.envd_rpc import Call, KeepaliveTicker, Send, StreamMethod, UnaryMethod
from tests.support.envd_subprocess import (
    WRAPPER,
    Event,
    ManagedProcess,
    set_window_size,
    spawn_pipes,
    spawn_pty,
    supervise,
)
from tests.support.sandbox_fs import SandboxFS, SandboxUser, go_errno_text

RETENTION_S = 30.0  # service.go terminatedRetentionTTL

_SIGNALS = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM}
_SIGNAL_NUMBERS = {9: "SIGNAL_SIGKILL", 15: "SIGNAL_SIGTERM"}

KEEPALIVE_EVENT: JSONDict = {"event": {"keepalive": {}}}


def normalize_config(config: JSONDict) -> JSONDict:
    """ProcessConfig as envd echoes it in List (proto3 JSON: empty repeated/map omitted)."""
    out: JSONDict = {}
    if config.get("cmd"):
        out["cmd"] = config["cmd"]
    if config.get("args"):
        out["args"] = list(config["args"])
    if config.get("envs"):
        out["envs"] = dict(config["envs"])
    if config.get("cwd") is not None:
        out["cwd"] = config["cwd"]  # `optional string`: present even when empty
    return out


class ProcessService:
    def __init__(self, fs: SandboxFS, env_vars: dict[str, str]) -> None:
        self._fs = fs
        self._env_vars = env_vars
        self._processes: dict[int, ManagedProcess] = {}
        self._terminated: dict[int, tuple[str | None, JSONDict]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self.workdir: str | None = None

    def unary_methods(self) -> dict[str, UnaryMethod]:
        return {
            "/process.Process/List": self.list_processes,
            "/process.Process/SendInput": self.send_input,
            "/process.Process/SendSignal": self.send_signal,
            "/process.Process/CloseStdin": self.close_stdin,
            "/process.Process/Update": self.update,
        }

    def stream_methods(self) -> dict[str, StreamMethod]:
        return {
            "/process.Process/Start": self.start,
            "/process.Process/Connect": self.connect,
        }

    @property
    def running(self) -> dict[int, ManagedProcess]:
        return dict(self._processes)

    # -- streams --------------------------------------------------------------------------------

    async def start(self, call: Call, request: JSONDict, send: Send) -> None:
        managed = await self._spawn(call, request)
        # start.go forks the data and end channels before the process starts: nothing is lost.
        queue = managed.subscribe()
        try:
            await send({"event": {"start": {"pid": managed.pid}}})
            await self._pump(call, queue, send)
        finally:
            managed.unsubscribe(queue)

    async def connect(self, call: Call, request: JSONDict, send: Send) -> None:
        selector = request.get("process") or {}
        try:
            managed = self._lookup(selector)
        except ConnectError:
            retained = self._lookup_terminated(selector)
            if retained is None:
                raise
            pid, end = retained
            await send({"event": {"start": {"pid": pid}}})
            await send({"event": {"end": end}})
            return
        queue = managed.subscribe()
        try:
            await send({"event": {"start": {"pid": managed.pid}}})
            await self._pump(call, queue, send)
        finally:
            managed.unsubscribe(queue)

    async def _pump(self, call: Call, queue: asyncio.Queue[Event], send: Send) -> None:
        ticker = KeepaliveTicker(call.keepalive_s)
        while True:
            try:
                async with asyncio.timeout(ticker.remaining()):
                    kind, payload = await queue.get()
            except TimeoutError:
                await send(KEEPALIVE_EVENT)
                ticker.fired()
                continue
            await send({"event": {kind: payload}})
            if kind == "end":
                return
            ticker.reset()

    # -- unary ----------------------------------------------------------------------------------

    async def list_processes(self, call: Call, request: JSONDict) -> JSONDict:
        processes = []
        for managed in self._processes.values():
            info: JSONDict = {"config": managed.config, "pid": managed.pid}
            if managed.tag is not None:
                info["tag"] = managed.tag
            processes.append(info)
        return {"processes": processes} if processes else {}

    async def send_input(self, call: Call, request: JSONDict) -> JSONDict:
        managed = self._lookup(request.get("process") or {})
        data = request.get("input") or {}
        if "pty" in data:
            self._write_pty(managed, base64.b64decode(data["pty"]))
        elif "stdin" in data:
            await self._write_stdin(managed, base64.b64decode(data["stdin"]))
        else:
            raise ConnectError("unimplemented", "invalid input type <nil>")
        return {}

    async def send_signal(self, call: Call, request: JSONDict) -> JSONDict:
        managed = self._lookup(request.get("process") or {})
        name = request.get("signal", "SIGNAL_UNSPECIFIED")
        name = _SIGNAL_NUMBERS.get(name, name) if isinstance(name, int) else name
        if name not in _SIGNALS:
            raise ConnectError("unimplemented", f"invalid signal: {name}")
        managed.signal(_SIGNALS[name])
        return {}

    async def close_stdin(self, call: Call, request: JSONDict) -> JSONDict:
        managed = self._lookup(request.get("process") or {})
        if managed.pty_master is not None:
            raise ConnectError(
                "unknown",
                "error closing stdin: cannot close stdin for PTY process — "
                "send Ctrl+D (0x04) instead",
            )
        if managed.proc.stdin is not None and not managed.proc.stdin.is_closing():
            managed.proc.stdin.close()
        return {}

    async def update(self, call: Call, request: JSONDict) -> JSONDict:
        managed = self._lookup(request.get("process") or {})
        if request.get("pty") is not None:
            size = request["pty"].get("size") or {}
            if managed.pty_master is None:
                raise ConnectError("internal", "error resizing tty: tty not assigned to process")
            set_window_size(managed.pty_master, size.get("rows", 0), size.get("cols", 0))
        return {}

    # -- lifecycle ------------------------------------------------------------------------------

    async def close(self) -> None:
        """Kill every process tree (each runs in its own session) and wait for them."""
        for managed in list(self._processes.values()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(managed.pid, signal.SIGKILL)
            managed.output_cancelled.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    async def _spawn(self, call: Call, request: JSONDict) -> ManagedProcess:
        config = request.get("process") or {}
        cmd, args = config.get("cmd", ""), list(config.get("args", []))
        cwd = self._fs.resolve(config.get("cwd") or "", call.user, self.workdir)
        if not self._fs.host(cwd).exists():
            raise ConnectError("invalid_argument", f"cwd '{cwd}' does not exist")
        env = self._environment(call.user, config.get("envs") or {})
        argv = ["/bin/sh", "-c", WRAPPER, "--", cmd, *args]
        try:
            if request.get("pty") is not None:  # JSON null is an unset field
                size = request["pty"].get("size") or {}
                spawned, master = await spawn_pty(argv, self._fs.host(cwd), env, size)
            else:
                stdin = request.get("stdin") in (None, True)
                spawned, master = await spawn_pipes(argv, self._fs.host(cwd), env, stdin), None
        except OSError as exc:
            user_command = " ".join([cmd, *args])
            raise ConnectError(
                "invalid_argument",
                f"error starting process '{user_command}': {go_errno_text(exc)}",
            ) from exc
        managed = ManagedProcess(
            pid=spawned.process.pid,
            config=normalize_config(config),
            tag=request.get("tag"),
            proc=spawned.process,
            transport=spawned.transport,
            pty_master=master,
        )
        self._terminated.pop(managed.pid, None)
        self._processes[managed.pid] = managed
        if call.timeout_s:
            loop = asyncio.get_running_loop()
            managed.timeout_handle = loop.call_later(call.timeout_s, managed.kill_on_timeout)
        self._track(asyncio.create_task(self._run(managed)))
        return managed

    def _environment(self, user: SandboxUser, envs: dict[str, str]) -> dict[str, str]:
        # handler.go: only PATH from envd's own environment, then HOME/USER/LOGNAME, then the
        # /init env vars, then the request's (last one wins).
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self._fs.host(user.home)),
            "USER": user.name,
            "LOGNAME": user.name,
        }
        return env | self._env_vars | envs

    async def _run(self, managed: ManagedProcess) -> None:
        await supervise(managed)
        self._retire(managed)

    def _retire(self, managed: ManagedProcess) -> None:
        if self._processes.get(managed.pid) is managed:
            del self._processes[managed.pid]
        assert managed.end is not None
        self._terminated[managed.pid] = (managed.tag, managed.end)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(RETENTION_S, self._forget, managed.pid, managed.end)
        self._timers.add(timer)

    def _forget(self, pid: int, end: JSONDict) -> None:
        retained = self._terminated.get(pid)
        if retained is not None and retained[1] is end:
            del self._terminated[pid]

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- helpers --------------------------------------------------------------------------------

    def _lookup(self, selector: JSONDict) -> ManagedProcess:
        """service.go getProcess."""
        if "pid" in selector:
            pid = int(selector["pid"])
            managed = self._processes.get(pid)
            if managed is None:
                raise ConnectError("not_found", f"process with pid {pid} not found")
            return managed
        if "tag" in selector:
            tag = selector["tag"]
            for managed in self._processes.values():
                if managed.tag == tag:
                    return managed
            raise ConnectError("not_found", f"process with tag {tag} not found")
        raise ConnectError("unimplemented", "invalid input type *process.ProcessSelector")

    def _lookup_terminated(self, selector: JSONDict) -> tuple[int, JSONDict] | None:
        if "pid" in selector:
            retained = self._terminated.get(int(selector["pid"]))
            return (int(selector["pid"]), retained[1]) if retained else None
        if "tag" in selector:
            for pid, (tag, end) in self._terminated.items():
                if tag == selector["tag"]:
                    return pid, end
        return None

    def _write_pty(self, managed: ManagedProcess, data: bytes) -> None:
        if managed.pty_master is None:
            raise ConnectError(
                "internal",
                "error writing to tty: tty not assigned to process — "
                "input should be written to the stdin, not the tty",
            )
        try:
            os.write(managed.pty_master, data)
        except OSError as exc:
            raise ConnectError(
                "internal",
                f"error writing to tty: error writing to tty of process '{managed.pid}': "
                f"{go_errno_text(exc)}",
            ) from exc

    async def _write_stdin(self, managed: ManagedProcess, data: bytes) -> None:
        if managed.pty_master is not None:
            raise ConnectError(
                "internal",
                "error writing to stdin: tty assigned to process — "
                "input should be written to the pty, not the stdin",
            )
        stdin = managed.proc.stdin
        if stdin is None or stdin.is_closing():
            raise ConnectError("internal", "error writing to stdin: stdin not enabled or closed")
        try:
            stdin.write(data)
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ConnectError(
                "internal",
                f"error writing to stdin: error writing to stdin of process '{managed.pid}': "
                "write |1: broken pipe",
            ) from exc
