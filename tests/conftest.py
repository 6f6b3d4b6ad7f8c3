from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import uvloop
from hypothesis import settings

# The property tests check behaviour, not speed: hypothesis's default 200 ms deadline per
# example turns a slow host (CPython runs 3-4x slower on some of the VMs CI lands on, see
# bench/README.md "Hosts") or a coverage run into failures that say nothing about relay.
settings.register_profile("relay", deadline=None)
settings.load_profile("relay")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], object]]:
    """Tests run on uvloop, as the daemon does (``relay serve`` uses ``uvloop.run``)."""
    return {"uvloop": uvloop.new_event_loop}


class _AccessLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


@pytest.fixture
def access_lines() -> Iterator[list[dict[str, Any]]]:
    """Access-log lines as relay writes them without ``accesslog.configure`` (its logger)."""
    logger = logging.getLogger("relay.access")
    handler, level = _AccessLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
