"""The lease core's tests: each test taking ``core`` runs against both implementations."""

from __future__ import annotations

import types

import pytest
from core_implementations import IMPLEMENTATIONS, load_core


@pytest.fixture(params=IMPLEMENTATIONS)
def core(request: pytest.FixtureRequest) -> types.SimpleNamespace:
    return load_core(request.param)
