"""The README table renderer: deterministic, notes numbered once, the section replaced whole."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import compat_table

RESULTS: dict[str, Any] = {
    "versions": ["1.0", "js-2.0"],
    "forms": ["fixed", "host"],
    "rows": ["a", "b"],
    "cells": {
        "a": {
            "1.0/fixed": {"status": "gap", "label": "404", "note": "why"},
            "1.0/host": {"status": "pass", "label": "", "note": ""},
            "js-2.0/fixed": {"status": "gap", "label": "404", "note": "why"},
            "js-2.0/host": {"status": "FAIL", "label": "", "note": ""},
        },
        "b": {
            "1.0/fixed": {"status": "n/a", "label": "", "note": "absent"},
            "1.0/host": {"status": "pass", "label": "True", "note": ""},
        },
    },
}


def test_render() -> None:
    table = compat_table.render(RESULTS)
    assert table.startswith(compat_table.START)
    assert table.endswith(compat_table.END)
    # Python releases by version, JS ones labelled js-<version>.
    header = "| Python 1.0 fixed URL | Python 1.0 Host form | JS 2.0 fixed URL | JS 2.0 Host form |"
    assert f"| feature {header}" in table
    assert "| a | ⚠️ gap 404 [1] | ✅ | ⚠️ gap 404 [1] | ❌ FAIL |" in table
    assert "| b | n/a [2] | ✅ True | ❌ FAIL not run | ❌ FAIL not run |" in table
    assert "\n1. why\n2. absent\n" in table
    assert compat_table.render(RESULTS) == table


def test_replace_section_keeps_the_rest() -> None:
    document = f"# T\n\nintro\n\n{compat_table.START}\nold\n{compat_table.END}\n\n## After\n"
    section = compat_table.render(RESULTS)
    updated = compat_table.replace_section(document, section)
    assert updated == f"# T\n\nintro\n\n{section}\n\n## After\n"
    assert compat_table.current_section(updated) == section
    with pytest.raises(ValueError, match="markers"):
        compat_table.replace_section("no markers", section)
