"""A fixture for tests that switch profiling modes in-process: no OPSD_* variables, a fresh config."""

import pytest

from instrumentation import reset_for_tests
from instrumentation.config import ENV_VARS


@pytest.fixture(autouse=True)
def clean_profiling_env(monkeypatch):
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    reset_for_tests()
    yield
    reset_for_tests()
