"""Fixtures of the tdfunc test suite. Shared helpers live in ``tests/helpers.py``."""

from __future__ import annotations

import pytest
import torch

# Re-exported while test modules move their imports to ``helpers``; new code imports from there.
from helpers import check_compiled as check_compiled
from helpers import compare as compare
from helpers import snapshot as snapshot


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
