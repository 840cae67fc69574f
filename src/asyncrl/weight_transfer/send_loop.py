"""The trainer's sending thread: every rank sends each version to every server's channel, in one order.

    loop = SendLoop(store, rank=r, world_size=W, sender=BucketSender(...), timeout_s=120,
                    initial=(0, list(iter_shards(model, fmt))), on_version=report)   # every rank
    loop.start()
    loop.submit(3, list(iter_shards(model, fmt)))    # after step 3, every rank (a collective snapshot)
    loop.wait(3)                                     # once it went to every channel (rank 0: reported)
    loop.close()

Every trainer rank must walk the channels in the same order: a rank that joins channel B while
another still sends on channel A waits for it forever. So trainer rank 0 alone decides, as an
ordered list of jobs in the run's control store (`job/<k>`, JSON), and every rank (itself too)
carries them out in turn:

- publish version v: send it to every open channel (a delta where the channel holds the last one);
- join the channel of a server's new generation (a restart, a new server, or after a failed
  transfer) and send it the current version whole, without waiting for a step: with one server
  that restarted, no rollouts would come, so no step and no version.

Each rank writes what each job did (`result/<k>/<rank>`); rank 0 gathers them, drops every channel
that failed on any rank (its key `closed`, so the server registers anew), and for a version calls
`on_version` with a `VersionReport` (the servers that took it, bytes, seconds, changed fraction).
Rank 0 announces each transfer on its channel (`ch/.../send/<n>`) before sending; servers wait
there, not inside a collective, between versions.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from asyncrl.weight_transfer.buckets import Shard, TransferError, count_differing
from asyncrl.weight_transfer.channel import Channel, Rendezvous
from asyncrl.weight_transfer.control import Registration, read_registration, wait_any_key
from asyncrl.weight_transfer.sender import BucketSender, SendStats

__all__ = ["SendLoop", "VersionReport", "count_changed"]

log = logging.getLogger(__name__)

_IDLE_S = 0.02  # rank 0's poll for registrations and versions
_CLOSE_S = 5.0


@dataclass(frozen=True, kw_only=True)
class VersionReport:
    """One version's transfer, over all trainer ranks. Example: VersionReport(version=3,
    servers=("server0",), left_behind=("server1",), num_bytes=101_000_000, seconds=0.8,
    changed_fraction=0.015)."""

    version: int
    servers: tuple[str, ...]  # took it (every rank's streams acknowledged)
    left_behind: tuple[str, ...]  # had a channel, did not take it
    num_bytes: int  # payload bytes sent, summed over trainer ranks and servers (per receiving rank)
    seconds: float  # the job's wall time on rank 0
    changed_fraction: float | None  # serving values that changed since the previous version (None: first)
    errors: dict[str, str] = field(default_factory=dict)  # server -> why it was left behind


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What every rank does next, in order: drop channels, join one, send a version."""

    index: int
    version: int | None  # the version sent (None: nothing to send yet)
    send: tuple[str, ...]  # channels it goes to
    dense: tuple[str, ...]  # of those, the ones that get it whole
    drop: tuple[str, ...] = ()
    join: dict | None = None  # a Registration's fields
    publish: bool = False  # a new version (reported) rather than a joining server's catch-up

    def encode(self) -> str:
        return json.dumps(asdict(self))


def count_changed(old: list[Shard], new: list[Shard]) -> tuple[int, int]:
    """(elements whose serving bits differ, elements) between two snapshots of one rank's shards."""
    changed = total = 0
    for a, b in zip(old, new, strict=True):
        assert a.key == b.key, "two snapshots of one rank walk the same shards"
        changed += count_differing(a.values, b.values)
        total += a.values.numel()
    return changed, total


class SendLoop:
    """See the module docstring. `initial` is the version the trainer starts from (0, or the step it
    resumed at) and its snapshot: what a server that joins before the first step gets."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        sender: BucketSender,
        timeout_s: float,
        initial: tuple[int, list[Shard]] | None = None,
        on_version: Callable[[VersionReport], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.sender, self.timeout_s, self.on_version = sender, timeout_s, on_version
        self.device = device or torch.device("cpu")
        self._current = initial  # (version, shards) last sent or to send to a joining server
        self._cond = threading.Condition()
        self._submitted: dict[int, list[Shard]] = {}
        self._done: set[int] = set()  # versions this rank (rank 0: every rank) finished
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._channels: dict[str, Channel] = {}  # open on this rank: channel name -> channel
        self._thread = threading.Thread(target=self._main, name=f"weights-send-{rank}", daemon=True)
        # rank 0's bookkeeping
        self._jobs = 0
        self._seen = 0  # registrations read
        self._servers: dict[str, str] = {}  # server -> its open channel's name
        self._announced: dict[str, int] = {}  # channel -> transfers announced on it
        self._drop: list[str] = []  # channels to drop in the next job

    def start(self) -> None:
        self._thread.start()

    def submit(self, version: int, shards: list[Shard]) -> None:
        """Hand this rank's snapshot of `version` to the thread (every rank, every version, in order)."""
        with self._cond:
            self._raise()
            self._submitted[version] = shards
            self._cond.notify_all()

    def wait(self, version: int, timeout_s: float | None = None) -> None:
        """Return once this rank sent `version` (rank 0: once every rank did and it was reported)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while version not in self._done:
                self._raise()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"version {version} was not sent within {timeout_s:g} s")
                self._cond.wait(0.5 if left is None else min(left, 0.5))

    def close(self) -> None:
        """Stop after the job under way, or drop it after a few seconds (a join or a send can block
        up to `timeout_s`; a trainer on its way out does not wait for that); then drop every channel
        (their servers register anew)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=_CLOSE_S)
        for channel in list(self._channels.values()):
            channel.close()
        self._channels.clear()

    def _raise(self) -> None:
        if self._error is not None:
            raise TransferError(f"the weights sending thread failed: {self._error}") from self._error

    # -- the thread ------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            while not self._stop.is_set():
                job = self._plan() if self.rank == 0 else self._follow()
                if job is None:
                    continue
                results, stats = self._execute(job)
                self.store.set(f"result/{job.index}/{self.rank}", json.dumps(results))
                if self.rank == 0:
                    self._conclude(job, stats)
                if job.publish:
                    with self._cond:
                        self._done.add(job.version)
                        self._cond.notify_all()
        except Exception as e:  # the thread's top level: the next submit or wait raises it
            if self._stop.is_set():
                return  # closed under a job: its channels were dropped
            log.exception("weights: the sending thread failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _follow(self) -> _Job | None:
        key = f"job/{self._jobs + 1}"
        if wait_any_key(self.store, [key], timeout_s=0.5, should_stop=self._stop.is_set) is None:
            return None
        self._jobs += 1
        return _Job(**json.loads(self.store.get(key)))

    def _plan(self) -> _Job | None:
        """Rank 0: the next job (a new registration first, then a submitted version) or None."""
        job = self._next_join() or self._next_publish()
        if job is None:
            with self._cond:
                self._cond.wait(_IDLE_S)  # a submit wakes it at once; registrations wait for the tick
            return None
        self.store.set(f"job/{job.index}", job.encode())
        return job

    def _next_join(self) -> _Job | None:
        while int(self.store.add("registrations", 0)) > self._seen:
            self._seen += 1
            reg = read_registration(self.store, self._seen)
            if int(self.store.add(f"gen/{reg.server}", 0)) > reg.gen:
                continue  # superseded: that server registered again since
            old = self._servers.pop(reg.server, None)
            if old is not None:
                self._forget(old)
            self._servers[reg.server] = reg.channel
            self._jobs += 1
            version = None if self._current is None else self._current[0]
            send = (reg.channel,) if version is not None else ()
            return _Job(
                index=self._jobs,
                version=version,
                send=send,
                dense=send,
                drop=self._take_drops(),
                join=asdict(reg),
            )
        return None

    def _next_publish(self) -> _Job | None:
        with self._cond:
            pending = sorted(v for v in self._submitted if v not in self._done)
        if not pending:
            return None
        self._jobs += 1
        send = tuple(self._servers.values())
        return _Job(
            index=self._jobs, version=pending[0], send=send, dense=(), drop=self._take_drops(), publish=True
        )

    def _take_drops(self) -> tuple[str, ...]:
        drops, self._drop = tuple(self._drop), []
        return drops

    def _forget(self, channel: str) -> None:
        """Rank 0: that channel's server gets no more versions on it (it registers anew)."""
        self.store.set(f"{channel}/closed", "1")
        self._announced.pop(channel, None)
        self._drop.append(channel)

    def _execute(self, job: _Job) -> tuple[dict, dict[str, SendStats | TransferError]]:
        """This rank's part of `job`; returns what it writes to `result/<k>/<rank>` and its stats."""
        start = time.monotonic()
        for name in job.drop:
            channel = self._channels.pop(name, None)
            if channel is not None:
                channel.close()
        errors: dict[str, str] = {}
        if job.join is not None:
            reg = Registration(**job.join)
            try:
                self._join(reg)
            except TransferError as e:
                errors[reg.channel] = str(e)
        stats: dict[str, SendStats | TransferError] = {}
        changed = None
        if job.version is not None:
            shards = self._shards_of(job)
            previous = self._current
            self._current = (job.version, shards)
            channels = {n: self._channels[n] for n in job.send if n in self._channels}
            self.sender.compare(shards, job.version)
            self._announce(channels)
            stats = self.sender.send_shards(shards, job.version, channels, dense=job.dense)
            if job.publish and previous is not None and previous[0] != job.version:
                # a delta sender compared the two versions already; count them only otherwise
                changed = self.sender.last_changed or count_changed(previous[1], shards)
        for name, s in stats.items():
            if isinstance(s, TransferError):
                errors[name] = str(s)
        sent = [s for s in stats.values() if isinstance(s, SendStats)]
        results = {
            "ok": [n for n in job.send if n not in errors],
            "errors": errors,
            "bytes": sum(s.num_bytes for s in sent),
            "changed": changed,
            "seconds": time.monotonic() - start,
        }
        return results, stats

    def _shards_of(self, job: _Job) -> list[Shard]:
        if self._current is not None and self._current[0] == job.version and not job.publish:
            return self._current[1]
        with self._cond:
            while job.version not in self._submitted:  # the main thread snapshots it after the step
                self._cond.wait(0.5)
                if self._stop.is_set():
                    raise TransferError(f"stopped before version {job.version} was submitted")
            return self._submitted.pop(job.version)

    def _join(self, reg: Registration) -> None:
        num_receivers = reg.receivers
        rdv = Rendezvous(
            host="",
            port=0,
            num_senders=self.world_size,
            world_size=self.world_size + num_receivers,
            name=reg.channel,
        )
        channel = Channel.join(
            rdv, rank=self.rank, device=self.device, timeout_s=self.timeout_s, store=self.store
        )
        self._channels[reg.channel] = channel
        log.info("weights: trainer rank %d joined %s", self.rank, reg.channel)

    def _announce(self, channels: dict[str, Channel]) -> None:
        """Rank 0 tells each channel's receivers that a transfer starts (they wait on the store)."""
        if self.rank != 0:
            return
        for name in channels:
            n = self._announced.get(name, 0) + 1
            self._announced[name] = n
            self.store.set(f"{name}/send/{n}", "1")

    def _conclude(self, job: _Job, stats: dict) -> None:
        """Rank 0: gather every rank's results, drop failed channels, report a published version."""
        results = []
        for r in range(self.world_size):
            key = f"result/{job.index}/{r}"
            if wait_any_key(self.store, [key], should_stop=self._stop.is_set) is None:
                return
            results.append(json.loads(self.store.get(key)))
        failed = {n: e for res in results for n, e in res["errors"].items()}
        server_of = {ch: s for s, ch in self._servers.items()}
        for name in failed:
            server = server_of.get(name)
            if server is not None and self._servers.get(server) == name:
                del self._servers[server]
            self._forget(name)
            log.warning("weights: channel %s failed: %s", name, failed[name])
        if not job.publish:
            return
        changed = [r["changed"] for r in results]
        report = VersionReport(
            version=job.version,
            servers=tuple(sorted(server_of[n] for n in job.send if n not in failed and n in server_of)),
            left_behind=tuple(sorted(server_of[n] for n in job.send if n in failed and n in server_of)),
            num_bytes=sum(r["bytes"] for r in results),
            seconds=max(r["seconds"] for r in results),
            changed_fraction=None
            if None in changed
            else sum(c for c, _ in changed) / max(1, sum(t for _, t in changed)),
            errors={server_of[n]: e for n, e in failed.items() if n in server_of},
        )
        if self.on_version is not None:
            self.on_version(report)
