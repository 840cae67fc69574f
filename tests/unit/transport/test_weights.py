"""Weight transport mechanics: a directory per publication, the step_n link, STABLE, keep-last-K,
retraction, waiting, a full disk."""

from __future__ import annotations

import errno
import re
import threading

import pytest

from asyncrl.run_dir import weights_dir
from asyncrl.transport import (
    STABLE_MARKER,
    DiskFullError,
    WeightsTimeoutError,
    begin_publication,
    commit_publication,
    discard_publication,
    latest_stable_step,
    prune_weights,
    read_keep_set,
    retract_weights_after,
    stable_steps,
    stage_weights,
    wait_for_weights,
    write_keep_set,
)


def _publish(run_dir, step, keep_last=None, payload=b"w"):
    existed = weights_dir(run_dir, step).exists()
    with stage_weights(run_dir, step, keep_last=keep_last) as tmp:
        assert existed or not weights_dir(run_dir, step).exists()  # invisible until the body finishes
        (tmp / "model.safetensors").write_bytes(payload)


def _names(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "weights").iterdir())


def test_publish_links_step_n_to_a_complete_publication(tmp_path):
    _publish(tmp_path, 1)
    final = weights_dir(tmp_path, 1)
    assert sorted(p.name for p in final.iterdir()) == [STABLE_MARKER, "model.safetensors"]
    publication = final.resolve()
    assert (
        final.is_symlink() and publication.parent == final.parent and publication.name.startswith(".step_1.")
    )
    assert _names(tmp_path) == [publication.name, "step_1"]
    assert latest_stable_step(tmp_path) == 1


def test_a_shared_publication_appears_only_when_committed_and_a_discarded_one_leaves_nothing(tmp_path):
    _publish(tmp_path, 1)
    content = begin_publication(tmp_path, 2)
    for rank in range(2):  # several writers fill one publication
        (content / f"model-{rank}.safetensors").write_bytes(b"w")
    assert stable_steps(tmp_path) == [1] and not weights_dir(tmp_path, 2).exists()
    commit_publication(tmp_path, 2, content, keep_last=1)
    assert stable_steps(tmp_path) == [2] and weights_dir(tmp_path, 2).resolve() == content
    assert sorted(p.name for p in content.iterdir()) == [
        STABLE_MARKER,
        "model-0.safetensors",
        "model-1.safetensors",
    ]
    abandoned = begin_publication(tmp_path, 3)
    (abandoned / "model-0.safetensors").write_bytes(b"w")
    discard_publication(abandoned)
    assert _names(tmp_path) == [content.name, "step_2"]


def test_keep_last_prunes_oldest(tmp_path):
    for step in range(1, 6):
        _publish(tmp_path, step, keep_last=2)
    assert stable_steps(tmp_path) == [4, 5]
    assert [n for n in _names(tmp_path) if "step_1" in n or "step_2" in n or "step_3" in n] == []
    assert len(_names(tmp_path)) == 4  # step_4, step_5 and their publications


def test_the_keep_set_survives_pruning_until_it_leaves_the_set(tmp_path):
    for step in (1, 2):
        _publish(tmp_path, step)
    write_keep_set(tmp_path, {2: "best by eval/reverse-text/pass@4 (0.5)", 3: "eval in progress"})
    assert read_keep_set(tmp_path) == {2: "best by eval/reverse-text/pass@4 (0.5)", 3: "eval in progress"}
    for step in range(3, 7):
        _publish(tmp_path, step, keep_last=1)
    assert stable_steps(tmp_path) == [2, 3, 6]
    assert (weights_dir(tmp_path, 2) / "model.safetensors").read_bytes() == b"w"
    write_keep_set(tmp_path, {2: "best"})  # the eval of v3 ended: v3 goes at the next publish
    _publish(tmp_path, 7, keep_last=1)
    assert stable_steps(tmp_path) == [2, 7]
    assert prune_weights(tmp_path, 1) == [2]  # without the keep-set, the pruner keeps only the newest
    assert [n for n in _names(tmp_path) if n.startswith(".keep")] == []  # no temp file left behind


def test_retraction_ignores_the_keep_set_file(tmp_path):
    _publish(tmp_path, 1)
    write_keep_set(tmp_path, {1: "best"})
    assert retract_weights_after(tmp_path, 0) == [1]
    assert read_keep_set(tmp_path) == {1: "best"}  # its writer (the orchestrator) updates it


def test_a_keep_set_that_is_not_one_is_an_error_naming_the_file(tmp_path):
    assert read_keep_set(tmp_path) == {}
    _publish(tmp_path, 1)
    (tmp_path / "weights" / "keep.json").write_text('{"steps": [3]}')
    with pytest.raises(ValueError, match=r"keep\.json is not a keep-set .*fix or delete it"):
        _publish(tmp_path, 2, keep_last=1)


def test_failure_inside_publish_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), stage_weights(tmp_path, 3) as tmp:
        (tmp / "partial").write_bytes(b"x")
        raise RuntimeError("disk full")
    assert list((tmp_path / "weights").iterdir()) == []
    assert latest_stable_step(tmp_path) is None


def test_republishing_a_step_replaces_it_and_a_reader_of_the_old_one_reads_it_whole(tmp_path):
    _publish(tmp_path, 2, payload=b"old")
    held = weights_dir(tmp_path, 2).resolve()  # a server resolves the link once, then loads
    _publish(tmp_path, 2, payload=b"new")
    assert (weights_dir(tmp_path, 2) / "model.safetensors").read_bytes() == b"new"
    assert weights_dir(tmp_path, 2).resolve() != held  # another publication: its identity
    assert (held / "model.safetensors").read_bytes() == b"old" and (held / STABLE_MARKER).is_file()
    _publish(tmp_path, 3, keep_last=1)
    assert _names(tmp_path) == [weights_dir(tmp_path, 3).resolve().name, "step_3"]  # both of step 2 pruned


def test_a_reader_never_sees_a_republished_step_missing_or_mixed(tmp_path):
    def publish(generation: int) -> None:
        with stage_weights(tmp_path, 2) as tmp:
            for name in ("a.bin", "b.bin"):
                (tmp / name).write_bytes(b"%d" % generation)

    publish(0)
    seen, problems, done = set(), [], threading.Event()

    def read() -> None:
        while not done.is_set():
            path = weights_dir(tmp_path, 2).resolve()
            a, b = ((path / n).read_bytes() if (path / n).is_file() else None for n in ("a.bin", "b.bin"))
            if a is None or a != b or not (path / STABLE_MARKER).is_file():
                problems.append((path.name, a, b))
            seen.add(a)

    reader = threading.Thread(target=read)
    reader.start()
    for generation in range(1, 50):
        publish(generation)
    done.set()
    reader.join()
    assert problems == [] and len(seen) > 1


def test_a_plain_step_directory_is_replaced_by_a_publication(tmp_path):
    weights_dir(tmp_path, 4).mkdir(parents=True)  # a run directory copied with its links resolved
    (weights_dir(tmp_path, 4) / STABLE_MARKER).touch()
    _publish(tmp_path, 4, payload=b"new")
    assert weights_dir(tmp_path, 4).is_symlink()
    assert (weights_dir(tmp_path, 4) / "model.safetensors").read_bytes() == b"new"
    _publish(tmp_path, 5, keep_last=1)
    assert not [n for n in _names(tmp_path) if "step_4" in n]


def test_retraction_removes_every_publication_after_a_step(tmp_path):
    for step in range(1, 6):
        _publish(tmp_path, step)
    _publish(tmp_path, 4, payload=b"again")  # a replaced publication of step 4 stays until pruned
    (tmp_path / "weights" / ".step_6.half").mkdir()  # a publisher killed while writing step 6
    kept = {n for n in _names(tmp_path) if re.match(r"\.?step_[123](\.|$)", n)}
    assert retract_weights_after(tmp_path, 3) == [4, 5, 6]
    assert stable_steps(tmp_path) == [1, 2, 3]
    assert set(_names(tmp_path)) == kept
    assert retract_weights_after(tmp_path, 3) == []
    assert retract_weights_after(tmp_path / "nothing", 0) == []


def test_directory_without_stable_is_not_a_version(tmp_path):
    weights_dir(tmp_path, 7).mkdir(parents=True)
    assert stable_steps(tmp_path) == []
    with pytest.raises(WeightsTimeoutError, match="step 7"):
        wait_for_weights(tmp_path, 7, timeout_s=0.1)
    (weights_dir(tmp_path, 7) / STABLE_MARKER).touch()
    assert wait_for_weights(tmp_path, 7, timeout_s=1) == weights_dir(tmp_path, 7)


@pytest.mark.parametrize("keep_last", [None, 1])
def test_a_full_disk_while_publishing_names_the_step_and_leaves_nothing(tmp_path, keep_last):
    _publish(tmp_path, 1)
    before = _names(tmp_path)
    with pytest.raises(DiskFullError) as caught, stage_weights(tmp_path, 2, keep_last=keep_last) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    message = str(caught.value)
    assert message.startswith(
        f"no space left for the published weights of step 2 at {weights_dir(tmp_path, 2)}: "
    )
    assert " free on its filesystem" in message and "--resume" in message
    assert caught.value.errno == errno.ENOSPC
    assert _names(tmp_path) == before and stable_steps(tmp_path) == [1]
