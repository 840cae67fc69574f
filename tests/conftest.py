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
    """Files that hold `slow` or `vllm` tests run first, and `@pytest.mark.long` tests are skipped.

    The suite runs on two workers, one file per worker at a time (`-n 2 --dist loadfile`, README),
    which hand out files in collection order: the end-to-end runs first, so that the last files
    left are short ones and both workers finish together. `long` tests run end to end for minutes,
    more than the CI run's budget on 2 cores: they are skipped, saying so, unless
    ASYNCRL_LONG_TESTS=1 (docs/contributing.md)."""
    heavy = {item.path for item in items if "slow" in item.keywords or "vllm" in item.keywords}
    items.sort(key=lambda item: item.path not in heavy)  # stable: each file's order is kept
    if LONG_TESTS:
        return
    skip = pytest.mark.skip(reason="long test (minutes): set ASYNCRL_LONG_TESTS=1 to run it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
