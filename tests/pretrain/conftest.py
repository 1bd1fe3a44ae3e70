from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_thread):
    """Every pretrain test uses tiny models (see tests/conftest.py)."""
