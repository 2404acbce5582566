"""Publishing the actor after every training step that changed it, off the training path.

``submit`` is all the training step pays: a device-to-host copy of the actor into reused buffers
(``learner/snapshot.py``; a collective under FSDP2, every rank at the same step). A writer thread
per rank then writes that rank's files of the version (safetensors, hashed in the same pass:
``transport/safetensors_io.write_image``) into ``RUN_DIR/weights/.tmp-v{version:08d}`` and drops a
fragment ``.rank-{r}.json`` with their digests beside them. Rank 0's writer, once every rank's
fragment is there, completes the version (base files, shard index, MANIFEST.json, atomic rename:
``transport/publisher.finish_version``) and calls ``on_published`` with the announcement, which
the module hands to the controller (``learner/reports.py`` releases the step reports waiting for it).

Latest wins: while a version is being written, a newer snapshot replaces the pending one (its
buffers are reused), so at most two buffer sets exist and nothing queues. Ranks decide this alone,
so a rank may skip a version that others wrote; rank 0 then abandons that version (it sees the
rank's progress marker ``.rank-{r}.written`` pass it) and publishes the next one. ``flush`` waits
until the newest submitted version is written (and, on rank 0, published); checkpoints and
evaluations flush first. A writer error (disk full, a rank that never writes) is raised on the
training thread at the next ``submit``/``flush``. The ranks share the run directory's filesystem.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vapo_async.learner.snapshot import HostSnapshot, SnapshotPlan, snapshot_plan
from vapo_async.transport.digest import DEFAULT_HASH, new_hasher
from vapo_async.transport.messages import WeightAnnouncement
from vapo_async.transport.publisher import (
    FileDigests,
    WeightPublishError,
    finish_version,
    prepare_root,
    prune,
    tmp_dir,
)
from vapo_async.transport.safetensors_io import write_image
from vapo_async.transport.weights import (
    MANIFEST,
    announcement_for,
    published_versions,
    version_dir_name,
)

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class PublishStats:
    """Counters of the writer (rank 0's are logged as ``weights/*``)."""

    published: int = 0
    """Versions this rank wrote (rank 0: completed and announced)."""
    skipped: int = 0
    """Snapshots replaced by a newer one before they were written (latest wins)."""
    abandoned: int = 0
    """Rank 0: versions given up because another rank skipped them."""
    last_snapshot_s: float = 0.0
    """Training-thread stall of the last ``submit`` (device-to-host copy)."""
    last_write_s: float = 0.0
    """Background time of the last version: files written and hashed (rank 0: until announced)."""
    write_s: list[float] = field(default_factory=list)
    """Every version's background time (benchmarks read it)."""


@dataclass
class _Job:
    version: int
    snap: HostSnapshot
    notify: bool
    """Call ``on_published`` (submitted versions; not the synchronous ``publish``)."""


class WeightPublishing:
    """Snapshot (all ranks, collective) and background writing of actor versions under ``root``."""

    def __init__(self, root: Path, base_dir: str, keep: int, rank: int, world: int = 1,
                 dtype: torch.dtype | None = None, algo: str = DEFAULT_HASH, fsync: bool = True,
                 shard_bytes: int = 4 << 30, finalize_timeout_s: float = 600.0,
                 delta_level: int | None = None) -> None:
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (generators may still read the previous version), got {keep}")
        new_hasher(algo)  # refuses an unknown name now
        self.rank, self.world, self.keep = rank, world, keep
        self.base_dir = Path(base_dir)
        self.dtype, self.algo, self.fsync = dtype, algo, fsync
        self.shard_bytes, self.finalize_timeout_s = shard_bytes, finalize_timeout_s
        self.delta_level = delta_level
        """zstd level of the deltas against the previous version (None: no deltas)."""
        self.root = Path(root).resolve()
        if rank == 0:  # before any rank writes: every write follows a collective snapshot
            prepare_root(self.root)
            for marker in self.root.glob(".rank-*.written"):
                marker.unlink()
        self.on_published: Callable[[WeightAnnouncement], None] | None = None
        """Rank 0: called on the writer thread with each completed submitted version, in order."""
        self.last: WeightAnnouncement | None = None
        """Rank 0: the newest completed version."""
        self.announced = -1
        """Rank 0: the newest version completed and handed to ``on_published`` (or returned by ``publish``)."""
        self.stats = PublishStats()
        self._plan: SnapshotPlan | None = None
        self._cond = threading.Condition()
        self._pending: _Job | None = None
        self._writing: _Job | None = None
        self._spare: list[HostSnapshot] = []
        self._error: BaseException | None = None
        self._raised = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"weight-writer-{rank}", daemon=True)
        self._thread.start()

    # ---- the training thread ----

    def submit(self, actor: nn.Module, version: int, notify: bool = True) -> float:
        """Collective: snapshot ``actor`` as ``version`` and return; the writer does the rest.
        Returns the stall in seconds. Raises the writer's error, if one happened."""
        self._raise_error()
        if self._plan is None:
            self._plan = snapshot_plan(actor, self.world, self.dtype, self.shard_bytes)
        with self._cond:
            snap = None
            if self._pending is not None:  # latest wins: the pending version is never written
                snap, notify = self._pending.snap, notify or self._pending.notify
                log.info("weights version %d skipped: version %d replaces it before it was written",
                         self._pending.version, version)
                self.stats.skipped += 1
                self._pending = None
            elif self._spare:
                snap = self._spare.pop()
        if snap is None:
            snap = HostSnapshot(self._plan, self.rank, pin=torch.cuda.is_available() and _on_cuda(actor))
        stall = snap.capture(actor, self._plan)
        with self._cond:
            self._pending = _Job(version, snap, notify)
            self._cond.notify_all()
        self.stats.last_snapshot_s = stall
        return stall

    def publish(self, actor: nn.Module, version: int) -> WeightAnnouncement | None:
        """Collective: publish ``version`` and wait until it is complete; rank 0 returns its
        announcement (``on_published`` is not called), other ranks None."""
        self.submit(actor, version, notify=False)
        self.flush()
        if self.rank != 0:
            return None
        if self.last is None or self.last.version != version:
            raise WeightPublishError(f"weights version {version} was not published")
        return self.last

    def wait_published(self, version: int, stop: Callable[[], bool]) -> float:
        """Rank 0: block until ``version`` or a newer one is announced (or ``stop()`` is true);
        returns the seconds waited. The learner calls it before pulling the batch of a step at
        policy version V with ``V - eta``: no step trains more than eta versions ahead of the
        weights generators can have (with the controller's admission this holds by itself; a
        source without admission, ``ListSource``, needs it). Raises the writer's error."""
        t0 = time.perf_counter()
        with self._cond:
            while self.announced < version and self._error is None and not stop():
                if self._pending is None and self._writing is None:
                    raise WeightPublishError(f"weights version {version} was awaited but nothing is being written "
                                             f"(newest announced: {self.announced})")
                self._cond.wait(timeout=0.5)
        self._raise_error()
        return time.perf_counter() - t0

    def flush(self) -> None:
        """Wait until this rank's writer has written everything submitted (rank 0: published it)."""
        with self._cond:
            while (self._pending is not None or self._writing is not None) and self._error is None:
                self._cond.wait(timeout=1.0)
        self._raise_error()

    def close(self) -> None:
        """Write what is pending, stop the writer thread; raises the writer's error if the
        training thread has not raised it yet."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._raise_error(once=True)

    def versions(self) -> list[int]:
        """Rank 0: the complete versions under ``root`` (oldest first)."""
        return list(published_versions(self.root))

    def existing(self, version: int) -> WeightAnnouncement | None:
        """Rank 0: the announcement of an already published ``version`` (None if it is gone)."""
        path = self.root / version_dir_name(version)
        return announcement_for(path) if (path / MANIFEST).is_file() else None

    def remove_newer(self, version: int) -> list[Path]:
        """Rank 0, on resume: delete versions newer than ``version`` (published after the
        checkpoint, by the run that crashed); the resumed run publishes them again."""
        if self.rank != 0:
            return []
        gone = [p for v, p in published_versions(self.root, complete=False).items() if v > version]
        for p in gone:
            shutil.rmtree(p)
        if gone:
            log.warning("resume at version %d: removed newer weight versions %s", version, [p.name for p in gone])
        return gone

    def _raise_error(self, once: bool = False) -> None:
        """Raise the writer's error (``once``: unless the training thread already raised it)."""
        if self._error is not None and not (once and self._raised):
            self._raised = True
            raise WeightPublishError(f"the weight writer failed: {self._error}") from self._error

    # ---- the writer thread ----

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None or self._error is not None:
                    return
                job, self._pending, self._writing = self._pending, None, self._pending
            t0 = time.perf_counter()
            try:
                ann = self._write(job)
                if ann is not None:
                    self.last = ann
                    if job.notify and self.on_published is not None:
                        self.on_published(ann)
                    with self._cond:
                        self.announced = ann.version
            except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
                log.error("weights version %d: %s", job.version, e)
                with self._cond:
                    self._error = e
            dt = time.perf_counter() - t0
            self.stats.last_write_s = dt
            self.stats.write_s.append(dt)
            with self._cond:
                self._writing = None
                self._spare.append(job.snap)
                self._cond.notify_all()

    def _write(self, job: _Job) -> WeightAnnouncement | None:
        """This rank's files of ``job`` and its fragment; rank 0 completes the version."""
        assert self._plan is not None
        v, tmp = job.version, tmp_dir(self.root, job.version)
        tmp.mkdir(parents=True, exist_ok=True)
        digests: FileDigests = {}
        for f in job.snap.files:
            digests[f.name] = write_image(tmp / f.name, f.header, job.snap.body(f.name), self.algo, self.fsync)
        _write_atomic(tmp / f".rank-{self.rank}.json", json.dumps(digests).encode())
        _write_atomic(self.root / f".rank-{self.rank}.written", str(v).encode())
        if self.rank != 0:
            self.stats.published += 1
            return None
        every = self._fragments(v)
        if every is None:
            self.stats.abandoned += 1
            return None
        for r in range(self.world):
            (tmp / f".rank-{r}.json").unlink()
        dtype_name = _DTYPE_NAMES.get(self.dtype) if self.dtype is not None else None
        ann = finish_version(self.root, v, every, self.base_dir, self.algo, dtype_name,
                             self._plan.weight_map(), self.fsync, self.delta_level)
        prune(self.root, self.keep, keep_also=Path(ann.path))
        self.stats.published += 1
        return ann

    def _fragments(self, version: int) -> FileDigests | None:
        """Rank 0: every rank's file digests of ``version``; None when a rank skipped it."""
        tmp = tmp_dir(self.root, version)
        deadline = time.monotonic() + self.finalize_timeout_s
        while True:
            missing = [r for r in range(self.world) if not (tmp / f".rank-{r}.json").is_file()]
            if not missing:
                every: FileDigests = {}
                for r in range(self.world):
                    every.update({k: (int(n), str(d)) for k, (n, d) in
                                  json.loads((tmp / f".rank-{r}.json").read_bytes()).items()})
                return every
            if any(_progress(self.root, r) > version for r in missing):
                log.info("weights version %d abandoned: rank(s) %s skipped it", version, missing)
                return None
            if time.monotonic() > deadline:
                raise WeightPublishError(f"rank(s) {missing} wrote no shard of weights version {version} within "
                                         f"weights.finalize_timeout_s={self.finalize_timeout_s:g} s")
            time.sleep(0.005)


def _progress(root: Path, rank: int) -> int:
    """The newest version rank ``rank`` wrote its shard of (-1: none yet)."""
    try:
        return int((root / f".rank-{rank}.written").read_text())
    except (OSError, ValueError):
        return -1


def _write_atomic(path: Path, raw: bytes) -> None:
    part = path.with_name(path.name + ".part")
    part.write_bytes(raw)
    os.replace(part, path)


def _on_cuda(model: nn.Module) -> bool:
    return any(p.is_cuda for p in model.parameters())
