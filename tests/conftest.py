"""Fixtures of the tdfunc test suite. Shared helpers live in ``tests/helpers.py``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
