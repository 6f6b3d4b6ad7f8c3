"""relay.core must stay pure: no module there may import anything that does I/O or reads
the clock (architecture habit 1). This test parses the sources, so it fails on a new import
even when the import is never executed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "relay" / "core"
BANNED = frozenset(
    {
        "aiohttp",
        "asyncio",
        "datetime",
        "httptools",
        "logging",
        "os",
        "random",
        "redis",
        "select",
        "selectors",
        "signal",
        "socket",
        "ssl",
        "subprocess",
        "threading",
        "time",
        "uvloop",
    }
)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_module_is_pure(path: Path) -> None:
    assert not imported_modules(path) & BANNED


def test_core_imports_only_core() -> None:
    for path in CORE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("relay"):
                assert node.module.startswith("relay.core"), (path.name, node.module)


def test_checker_sees_a_banned_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom asyncio import sleep\n")
    assert imported_modules(bad) == {"time", "asyncio"}
