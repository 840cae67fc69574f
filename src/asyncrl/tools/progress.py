"""Progress of a long-running tool (`asyncrl eval`, `asyncrl sft-data`): a bar with ETA on a terminal.

    with progress_bar(total=128, desc="eval reverse-text") as bar:
        ...
        bar.update(1)

On a terminal (stderr) this is a tqdm bar: done/total, rate and ETA. Otherwise (CI, a log file)
it prints nothing, so logs keep the plain result lines the commands print at the end.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

__all__ = ["progress_bar"]


def progress_bar(total: int, desc: str, unit: str = "it") -> tqdm:
    """A tqdm bar on stderr when stderr is a terminal; a disabled (silent) one otherwise."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not sys.stderr.isatty(),
    )
