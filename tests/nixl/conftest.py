"""Real NIXL engines over UCX: every test here is marked ``nixl``; the long ones are also ``serial``."""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    # A hook of this folder's conftest: pytest calls it for the items collected under this folder only.
    item.add_marker(pytest.mark.nixl)
