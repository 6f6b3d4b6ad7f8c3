"""The SDK scenario's checks of ``files`` on one sandbox handle (sync SDK): text, binary and
gzip transfers, directory operations, a missing file, ``watch_dir`` polling, and the signed
``download_url``/``upload_url`` fetched as a plain HTTP client would.

Runs in the SDK's virtualenv like the scenario: only the standard library and ``e2b``.
"""

from __future__ import annotations

import gzip
import os
import time
from collections.abc import Callable
from typing import Any

from e2b import FilesystemEventType

from tests.support.sdk_scenario_http import fetch
from tests.support.sdk_scenario_run import describe, expect

MIB = 1024 * 1024


def file_checks(sbx: Any) -> list[tuple[str, Callable[[], object]]]:
    def files_text() -> None:
        sbx.files.write("/home/user/t/a.txt", "alpha ✓\n")
        expect(sbx.files.read("/home/user/t/a.txt") == "alpha ✓\n", "text read back differs")

    def files_binary() -> None:
        data = os.urandom(MIB)
        sbx.files.write("/home/user/t/blob.bin", data)
        back = sbx.files.read("/home/user/t/blob.bin", format="bytes")
        expect(bytes(back) == data, f"binary read back differs ({len(back)} bytes)")

    def files_ops() -> None:
        sbx.files.write("/home/user/dir/a.txt", "alpha")
        expect(sbx.files.make_dir("/home/user/dir/sub") is True, "make_dir returned False")
        expect(sbx.files.make_dir("/home/user/dir/sub") is False, "second make_dir returned True")
        names = sorted(e.name for e in sbx.files.list("/home/user/dir"))
        expect(names == ["a.txt", "sub"], repr(names))
        moved = sbx.files.rename("/home/user/dir/a.txt", "/home/user/dir/b.txt")
        expect(moved.path == "/home/user/dir/b.txt", repr(moved))
        expect(sbx.files.exists("/home/user/dir/b.txt"), "renamed file missing")
        expect(not sbx.files.exists("/home/user/dir/a.txt"), "old name still exists")
        sbx.files.remove("/home/user/dir")
        expect(not sbx.files.exists("/home/user/dir"), "remove left the directory")

    def files_missing() -> None:
        try:
            sbx.files.read("/home/user/nope.txt")
        except Exception as exc:  # FileNotFoundException / NotFoundException
            expect("NotFound" in type(exc).__name__, describe(exc))
            return
        raise AssertionError("no error")

    def files_gzip() -> None:
        sbx.files.write("/home/user/z.txt", "z" * 10000, gzip=True)
        expect(sbx.files.read("/home/user/z.txt", gzip=True) == "z" * 10000, "gzip read differs")

    def sync_watch() -> None:
        sbx.files.make_dir("/home/user/w")
        handle = sbx.files.watch_dir("/home/user/w")
        sbx.files.write("/home/user/w/new.txt", "x")
        events: list[Any] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not events:
            events = handle.get_new_events()
            time.sleep(0.1)
        handle.stop()
        expect(
            any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE for e in events),
            repr(events),
        )

    def download(expiration: int | None) -> Callable[[], None]:
        def check() -> None:
            path = f"/home/user/dl-{expiration}.txt"
            sbx.files.write(path, "via url")
            url = sbx.download_url(path, use_signature_expiration=expiration)
            expect(("signature_expiration=" in url) == (expiration is not None), url)
            status, body, headers = fetch(url, headers={"Accept-Encoding": "gzip"})
            if headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            expect(status == 200, f"HTTP {status}: {body.decode(errors='replace').strip()}")
            expect(body == b"via url", repr(body))

        return check

    def upload(expiration: int | None) -> Callable[[], None]:
        def check() -> None:
            path = f"/home/user/up-{expiration}.txt"
            url = sbx.upload_url(path, use_signature_expiration=expiration)
            expect(("signature_expiration=" in url) == (expiration is not None), url)
            status, body, _ = fetch(
                url,
                method="POST",
                data=b"uploaded!",
                headers={"Content-Type": "application/octet-stream"},
            )
            expect(status == 200, f"HTTP {status}: {body.decode(errors='replace').strip()}")
            expect(sbx.files.read(path) == "uploaded!", "upload_url content")

        return check

    return [
        ("files write/read text", files_text),
        ("files write/read 1 MiB binary", files_binary),
        ("files list, make_dir, rename, remove, exists", files_ops),
        ("files.read missing file → NotFound", files_missing),
        ("files gzip write/read", files_gzip),
        ("watch_dir (sync, polling)", sync_watch),
        ("download_url", download(None)),
        ("download_url with expiration", download(300)),
        ("upload_url", upload(None)),
        ("upload_url with expiration", upload(300)),
        ("is_running() while routed", sbx.is_running),
    ]
