"""Filesystem weight transport: policy version n is `RUN/weights/step_n/`, complete once it holds STABLE.

Each publication is a directory of its own, `weights/.step_n.<id>/`, written in full (the
publisher's files, then `STABLE`) and never changed afterwards. `weights/step_n` is a symbolic
link to it, made or replaced by one `rename`, so there is never a moment without a complete
step_n once one was published: a step published again (a retrained step) switches from the old
publication to the new one at once. A reader that opens several files resolves the link once and
reads that directory (the orchestrator sends servers the resolved path, which also tells
publications of one step apart); a replaced publication stays on disk until its step is pruned.

Only the newest `keep_last` stable versions are kept, plus the versions of the keep-set,
`weights/keep.json`: steps another process needs on disk (the orchestrator's eval in progress and
the best version by an eval metric, docs/orchestrator.md). Its one writer, `write_keep_set`,
replaces it whole (temp + rename); the pruner reads it at every prune, so a step leaves the set
and is deleted at the next publish. `retract_weights_after` removes every publication newer than
a trainer checkpoint, for a resume, kept or not. Watchers (the orchestrator) need only this module:
no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from asyncrl.run_dir import step_name, step_of, steps_in, weights_dir, weights_keep_file, weights_root
from asyncrl.transport.disk import disk_full_as_error

__all__ = [
    "STABLE_MARKER",
    "TRANSFER_MANIFEST",
    "WeightsTimeoutError",
    "begin_publication",
    "commit_publication",
    "discard_publication",
    "holds_tensors",
    "latest_stable_step",
    "prune_weights",
    "read_keep_set",
    "retract_weights_after",
    "stable_steps",
    "stage_weights",
    "wait_for_weights",
    "write_keep_set",
]

STABLE_MARKER = "STABLE"
# A version the distributed transport sent without writing its tensors is published with this
# file (what the transfer did) and config.json only (docs/weights-transfer.md).
TRANSFER_MANIFEST = "manifest.json"
_POLL_S = 0.05


class WeightsTimeoutError(TimeoutError):
    """A policy version was not published in time."""


@contextmanager
def stage_weights(run_dir: str | os.PathLike, step: int, keep_last: int | None = None) -> Iterator[Path]:
    """Yield an empty directory to write into; on success publish it as weights/step_{step}/ + STABLE.

    If the body raises, the directory is removed and nothing is published; a full disk raises
    `DiskFullError` naming weights/step_{step}. An existing step_{step} (a step retrained after a
    resume) is replaced in one rename. With `keep_last`, older versions are pruned after it,
    except those of the keep-set. The same protocol in three calls, for writers that share a
    publication (several processes, or a background thread): `begin_publication`,
    `commit_publication`, `discard_publication`.
    """
    final = weights_dir(run_dir, step)
    with disk_full_as_error(final, f"published weights of step {step}"):
        content = begin_publication(run_dir, step)
        try:
            yield content
            commit_publication(run_dir, step, content)
        except BaseException:
            discard_publication(content)
            raise
    if keep_last is not None:
        prune_weights(run_dir, keep_last, keep=read_keep_set(run_dir))


def begin_publication(run_dir: str | os.PathLike, step: int) -> Path:
    """A new, empty `weights/.step_{step}.<id>/`: no reader sees it until `commit_publication`."""
    final = weights_dir(run_dir, step)
    with disk_full_as_error(final, f"published weights of step {step}"):
        final.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{step_name(step)}.", dir=final.parent))


def commit_publication(
    run_dir: str | os.PathLike, step: int, content: Path, keep_last: int | None = None
) -> None:
    """Mark `content` (from `begin_publication`, fully written) STABLE and make weights/step_{step}
    point to it in one rename; then keep the newest `keep_last` versions."""
    final = weights_dir(run_dir, step)
    link = content.with_name(f"{content.name}.link")
    with disk_full_as_error(final, f"published weights of step {step}"):
        try:
            (content / STABLE_MARKER).touch()
            os.symlink(content.name, link)
            _replace_with_link(final, link)
        except BaseException:
            link.unlink(missing_ok=True)
            raise
    if keep_last is not None:
        prune_weights(run_dir, keep_last, keep=read_keep_set(run_dir))


def discard_publication(content: Path) -> None:
    """Remove an uncommitted publication (a failed or abandoned write)."""
    content.with_name(f"{content.name}.link").unlink(missing_ok=True)
    shutil.rmtree(content, ignore_errors=True)


def _replace_with_link(final: Path, link: Path) -> None:
    if final.is_dir() and not final.is_symlink():
        # A plain directory (a run directory copied with its links resolved) cannot be replaced by
        # a rename: move it aside first. It is deleted with its step.
        os.rename(final, final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}"))
    os.replace(link, final)


def holds_tensors(publication: str | os.PathLike) -> bool:
    """Whether a published version's directory holds its weights: not a version that was only sent
    to the servers (`TRANSFER_MANIFEST`)."""
    return not (Path(publication) / TRANSFER_MANIFEST).is_file()


def stable_steps(run_dir: str | os.PathLike) -> list[int]:
    """Published steps (those with STABLE), ascending."""
    return steps_in(weights_root(run_dir), marker=STABLE_MARKER)


def latest_stable_step(run_dir: str | os.PathLike) -> int | None:
    steps = stable_steps(run_dir)
    return steps[-1] if steps else None


def prune_weights(run_dir: str | os.PathLike, keep_last: int, keep: Collection[int] = ()) -> list[int]:
    """Delete all but the newest `keep_last` stable versions and those in `keep`; returns the deleted
    steps."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    doomed = [s for s in stable_steps(run_dir)[:-keep_last] if s not in keep]
    for step in doomed:
        _delete_step(run_dir, step)
    return doomed


def write_keep_set(run_dir: str | os.PathLike, steps: Mapping[int, str]) -> None:
    """Make `steps` (step -> why, for whoever reads the file) the keep-set; replaces the previous one."""
    path = weights_keep_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps({"steps": {str(s): why for s, why in sorted(steps.items())}}, indent=1) + "\n")
    os.replace(tmp, path)


def read_keep_set(run_dir: str | os.PathLike) -> dict[int, str]:
    """The keep-set (step -> why); empty when there is none.

    A file that is not one (edited by hand, say) raises ValueError naming it: pruning on a guess
    could delete the weights it was meant to keep.
    """
    path = weights_keep_file(run_dir)
    if not path.is_file():
        return {}
    try:
        steps = json.loads(path.read_text())["steps"]
        return {int(s): str(why) for s, why in steps.items()}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(
            f"{path} is not a keep-set ({type(e).__name__}: {e}); it should read "
            '{"steps": {"12": "why"}}: fix or delete it'
        ) from None


def retract_weights_after(run_dir: str | os.PathLike, step: int) -> list[int]:
    """Delete every publication (complete or not) of a step after `step`; returns the deleted steps.

    For a resume from the trainer checkpoint of `step`: the trainer publishes those steps again,
    and no server may load the old ones meanwhile. Run it while no process uses the run directory.
    """
    root = weights_root(run_dir)
    if not root.is_dir():
        return []
    found = {_step_of_entry(child.name) for child in root.iterdir()}
    doomed = sorted(s for s in found if s is not None and s > step)
    for s in doomed:
        _delete_step(run_dir, s)
    return doomed


def _step_of_entry(name: str) -> int | None:
    """The step of `step_n`, of its publications `.step_n.<id>` and of their links `.step_n.<id>.link`."""
    return step_of(name.removeprefix(".").split(".", 1)[0])


def _delete_step(run_dir: str | os.PathLike, step: int) -> None:
    final = weights_dir(run_dir, step)
    # The name first, so no watcher picks up a half-deleted publication.
    if final.is_symlink():
        final.unlink()
    elif final.is_dir():
        (final / STABLE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(final, ignore_errors=True)
    for leftover in final.parent.glob(f".{step_name(step)}.*"):  # its publications, replaced or half-written
        if leftover.is_symlink():
            leftover.unlink()
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def wait_for_weights(run_dir: str | os.PathLike, step: int, timeout_s: float) -> Path:
    """Block until weights/step_{step}/STABLE exists; returns weights/step_{step}."""
    final = weights_dir(run_dir, step)
    deadline = time.monotonic() + timeout_s
    while not (final / STABLE_MARKER).is_file():
        if time.monotonic() >= deadline:
            raise WeightsTimeoutError(
                f"weights for step {step} not published after {timeout_s:.0f}s: no {final / STABLE_MARKER}"
            )
        time.sleep(_POLL_S)
    return final
