"""Shared pytest set-up for small CPU machines.

Many tests start several processes (inference servers, trainer ranks, sandboxes) on 2 cores; one
OpenMP thread per process avoids oversubscription, which made 2-thread runs 10-40x slower under load.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


LONG_TESTS = os.environ.get("ASYNCRL_LONG_TESTS") == "1"


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.long` tests run end to end for minutes: more than the CI run's budget on 2 cores.
    They are skipped, saying so, unless ASYNCRL_LONG_TESTS=1 (docs/contributing.md)."""
    if LONG_TESTS:
        return
    skip = pytest.mark.skip(reason="long test (minutes): set ASYNCRL_LONG_TESTS=1 to run it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
