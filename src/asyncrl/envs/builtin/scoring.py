"""Answer parsing and similarity scores shared by the built-in text environments."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["last_number", "lcs_length", "lcs_ratio"]

_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def lcs_length(a: Sequence[object], b: Sequence[object]) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) dynamic programme)."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(prediction: Sequence[object], target: Sequence[object]) -> float:
    """LCS / max(len): 1.0 for an exact match, and both missing and extra items cost."""
    longest = max(len(prediction), len(target))
    return 1.0 if longest == 0 else lcs_length(prediction, target) / longest


def last_number(text: str) -> float | None:
    """The last number written in `text` (the usual "final answer" convention), or None."""
    found = _NUMBER_RE.findall(text.replace(",", ""))
    return float(found[-1]) if found else None
