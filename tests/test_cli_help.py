"""``relay --help`` and every subcommand's: what an operator reads before the docs."""

from __future__ import annotations

import argparse
import subprocess
import sys

from relay.__main__ import _parser


def _parsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(parser.prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found.extend(_parsers(child))
    return found


def test_every_option_and_argument_says_what_it_is() -> None:
    """Found by review, reading each ``--help`` as a new operator: ``check-config --config``,
    ``routes delete ID --config --maxlen``, ``routes list --config`` and ``sign-url --op`` had
    no text at all (``serve --config`` and ``routes put --config`` had)."""
    missing = [
        f"{prog} {action.option_strings or action.dest}"
        for prog, parser in _parsers(_parser())
        for action in parser._actions
        if action.help is None and not isinstance(action, argparse._SubParsersAction)
    ]
    assert missing == []


def test_the_top_level_help_is_plain_text_and_gives_the_exit_codes() -> None:
    """The description was the module docstring's first line, reStructuredText markup
    included (````relay serve | ...````); the exit codes, which the unit's
    RestartPreventExitStatus=2 relies on, were only in the source."""
    out = subprocess.run(
        [sys.executable, "-m", "relay", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "``" not in out
    text = " ".join(out.split())
    assert "exit codes: 0 success, 2 configuration or usage error" in text
    assert "1 anything else" in text
