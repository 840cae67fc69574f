"""tests/helpers.py's run_ranks: ranks from the fork server; a failing rank's traceback and a hung
rank's stack reach the test's failure message."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from helpers import run_ranks


def _write_rank(rank: int, out: Path) -> None:
    (out / f"rank{rank}").write_text(str(rank))


def _fail_on_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def _one_sleeps_forever(rank: int) -> None:
    if rank == 1:
        while True:
            time.sleep(0.05)


def test_every_rank_runs_once(tmp_path):
    run_ranks(_write_rank, 3, tmp_path)
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0", "1", "2"]


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(Exception, match="rank one refuses"):
        run_ranks(_fail_on_one, 2)


def test_a_hung_rank_is_killed_at_the_deadline_with_its_stack_in_the_message():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_one_sleeps_forever, 2, deadline_s=3)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "ranks [1] of 2 still running after 3 s" in message
    assert "_one_sleeps_forever" in message and "--- rank 1" in message
