"""Rollout and weight transports between processes. Filesystem first; torch-free.

write_batch(run_dir, batch, num_parts=4)        # orchestrator: rollouts/step_n/ appears atomically
share = read_batch_part(run_dir, step, rank=r, num_ranks=4)  # trainer data rank r: waits, reads its part
batch = read_batch(run_dir, step, timeout_s=60)  # every part: the whole batch
with stage_weights(run_dir, step) as tmp: ...    # publisher writes into tmp; STABLE + step_n link on exit
latest_stable_step(run_dir)                      # orchestrator: newest published version
MetricsWriter(run_dir, "trainer").write(step, m)  # both: one line of RUN/metrics.jsonl
check_free_space(path, num_bytes, "checkpoint")  # DiskFullError (names path, what, free space)
"""

from asyncrl.transport.disk import DiskFullError, check_free_space, disk_full_as_error
from asyncrl.transport.metrics import MetricsWriter
from asyncrl.transport.rollouts import (
    BatchManifest,
    BatchShare,
    RolloutTimeoutError,
    batch_steps,
    read_batch,
    read_batch_part,
    read_manifest,
    write_batch,
)
from asyncrl.transport.weights import (
    STABLE_MARKER,
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

__all__ = [
    "STABLE_MARKER",
    "BatchManifest",
    "BatchShare",
    "DiskFullError",
    "MetricsWriter",
    "RolloutTimeoutError",
    "WeightsTimeoutError",
    "batch_steps",
    "begin_publication",
    "check_free_space",
    "commit_publication",
    "discard_publication",
    "disk_full_as_error",
    "latest_stable_step",
    "prune_weights",
    "read_batch",
    "read_batch_part",
    "read_keep_set",
    "read_manifest",
    "retract_weights_after",
    "stable_steps",
    "stage_weights",
    "wait_for_weights",
    "write_batch",
    "write_keep_set",
]
