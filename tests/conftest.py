from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], object]]:
    """Tests run on uvloop, as the daemon does (``relay serve`` uses ``uvloop.run``)."""
    return {"uvloop": uvloop.new_event_loop}
