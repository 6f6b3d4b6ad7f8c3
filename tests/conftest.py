from __future__ import annotations

from collections.abc import Callable, Mapping

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
