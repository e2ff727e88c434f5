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


class RecordingSink:
    """A stage-timer sink that keeps every record (coalescing runs, no resets): what a live table would see."""

    allows_reset, coalesce_runs = False, True

    def __init__(self):
        self.records = []

    def add(self, record):
        self.records.append(record)
