"""The bytes of Go's ``json.NewEncoder(w).Encode(v)``, as envd writes its JSON answers
(``internal/api/error.go:14`` jsonError, ``envs.go:21``, ``store.go:158``).

Unlike ``json.dumps``: strings are written as UTF-8, not ``\\uXXXX``; ``<``, ``>`` and ``&``
are escaped (the Encoder's default SetEscapeHTML(true)), as are U+2028 and U+2029; each byte
that is not UTF-8 (a surrogate escape here) becomes ``\\ufffd``; map keys come sorted; the
value ends with a newline.
"""

from __future__ import annotations

import json
import re
from typing import Any

_GO_ESCAPES = re.compile("[<>&\u2028\u2029\udc80-\udcff]")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return "\\ufffd" if "\udc80" <= char <= "\udcff" else f"\\u{ord(char):04x}"


def encode(value: Any, *, sort_keys: bool = False) -> bytes:
    """``sort_keys`` for a Go map; a struct keeps its field order (the dict's order here)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=sort_keys)
    # The characters escaped here only ever occur inside strings in JSON text.
    return (_GO_ESCAPES.sub(_escape, text) + "\n").encode()
