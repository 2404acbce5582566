"""Weight subscriber: apply the newest announced version between engine steps, refuse bad files.

An announcement can arrive three ways (PUB ``weights``, a lease's ``weights``, the ``welcome``);
``offer`` keeps the newest. ``apply`` (called by the sampling loop between two engine steps) makes
it current: ``ControllerClient.resolve_weights`` verifies the announced directory (inside the
trusted weights root, manifest checksum, every file's size and sha256) or, when this machine cannot
read it, fetches it in chunks into the local cache and verifies it there; then the engine reloads in
place (``VLLMEngine.reload``) once its tensor names and shapes match the reference layout (the base
model's, or the first version loaded; vLLM cannot recover from a failed in-place reload of a
wrongly shaped tensor). A version read from the learner's directory is hard-linked into the cache
first and the links are verified (``resolve_weights``): the learner prunes all but its newest
``keep_weights`` versions, and a generator that falls behind must neither lose the files it is
loading nor the ones a failed reload restores from. The cache keeps exactly the loaded version.
A directory that fails verification is refused: the engine keeps its
current weights, ``weights_refused`` counts it, an error is logged, and the same announcement is
retried after a back-off (a newer one is tried at once). While the target version is refused
(``stuck``), the sampling loop hands back leases that need it and asks for no credit.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from vapo_async.generator.engine import Engine, ReloadError
from vapo_async.transport.messages import WeightAnnouncement
from vapo_async.transport.safetensors_io import layout_mismatch, read_layout
from vapo_async.transport.weights import WeightsError

log = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"v\d{8}")


class WeightSource(Protocol):
    """The part of ``ControllerClient`` this module uses."""

    version: int

    def resolve_weights(self, ann: WeightAnnouncement, local_dir: str | Path) -> Path: ...


@dataclass
class SyncStats:
    """Counters of the weight subscriber."""

    applied: int = 0
    """Versions loaded into the engine."""
    refused: int = 0
    """Announcements refused (verification, fetch or load failure); previous weights kept."""
    last_pause_s: float = 0.0
    """Engine pause of the last reload (pause -> load -> resume), seconds."""
    last_resolve_s: float = 0.0
    """Verification (and fetch, if any) of the last applied version, seconds."""
    refused_reasons: dict[str, int] = field(default_factory=dict)
    """Refusals per reason token (checksum, outside_root, fetch_timeout, load, ...)."""


class WeightSync:
    """Tracks the version the engine should hold and loads it when ``apply`` is called.

    The target only moves forward (``offer``), except at the start of a controller session
    (``reset``): a learner that restarted from an older checkpoint announces an older version,
    and groups sampled with newer weights would be refused, so the engine goes back to it
    (``base_dir`` holds version ``base_version``, used when the controller has no announcement).
    ``layout_dir`` (default ``base_dir``) gives the reference tensor layout; raises ``ValueError``
    when its safetensors headers are malformed (a configuration error, not a refusal).
    """

    def __init__(self, source: WeightSource, engine: Engine, cache_dir: str | Path,
                 base_dir: str | Path | None = None, base_version: int = 0,
                 retry_s: float = 5.0, retry_max_s: float = 60.0, layout_dir: str | Path | None = None) -> None:
        self.source = source
        self.engine = engine
        self.cache_dir = Path(cache_dir).expanduser()
        self.base_dir = None if base_dir is None else Path(base_dir)
        self.base_version = base_version
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        self.target_version = engine.version
        self.target: WeightAnnouncement | None = None
        """Announcement of ``target_version`` (None: the engine's current or the base weights)."""
        self.stats = SyncStats()
        self.refused_version: int | None = None
        """Version refused last and not loaded since (``stuck`` while it is the target)."""
        self.refused_reason = ""
        """Reason token of that refusal (checksum, size, outside_root, fetch_timeout, load, ...)."""
        self._retry_at: dict[tuple[int, str], tuple[float, float]] = {}
        ref = layout_dir if layout_dir is not None else self.base_dir
        self.layout = (read_layout(ref) or None) if ref is not None else None
        """Tensor names and shapes every version must have (None: taken from the first version loaded)."""

    def offer(self, ann: WeightAnnouncement | None) -> None:
        """Aim for ``ann`` if it is newer than both the engine's weights and the current target."""
        if ann is not None and ann.version > max(self.engine.version, self.target_version):
            self.target, self.target_version = ann, ann.version

    def reset(self, version: int, ann: WeightAnnouncement | None) -> None:
        """New controller session at policy ``version`` (announced by ``ann``, or the base weights
        when ``ann`` is None): aim for exactly that, even if it is older than the engine's."""
        if ann is not None and ann.version != version:
            raise ValueError(f"welcome names version {version} but announces {ann.version}")
        if ann is None and version != self.engine.version and version != self.base_version:
            raise ValueError(f"controller is at version {version} without an announcement and the base "
                             f"weights are version {self.base_version}: cannot load it")
        if ann is None and version != self.engine.version and self.base_dir is None:
            raise ValueError(f"controller went back to the base weights (version {version}) but this "
                             "generator has no base model directory (start it with model=DIR)")
        self.target, self.target_version = ann, version

    def pending(self) -> bool:
        """The engine does not hold the target version yet."""
        return self.target_version != self.engine.version

    def stuck(self) -> bool:
        """The target version was refused and is still not loaded (a newer offer ends this)."""
        return self.pending() and self.refused_version == self.target_version

    def apply(self) -> bool:
        """Load the target version now unless backing off after a refusal; True if loaded.
        Raises ``ReloadError`` only when the engine could not even restore its old weights."""
        if not self.pending():
            return False
        ann = self.target
        key = (self.target_version, ann.checksum if ann else "base")
        retry = self._retry_at.get(key)
        if retry is not None and time.monotonic() < retry[0]:
            return False
        t0 = time.perf_counter()
        if ann is None:
            assert self.base_dir is not None
            path = self.base_dir
        else:
            try:
                path = self.source.resolve_weights(ann, self.cache_dir)
            except WeightsError as e:
                self._refuse(key, e.reason, f"version {ann.version} at {ann.path} refused: {e}")
                return False
            layout, problem = self._check_layout(path)
            if problem:
                self._refuse(key, "layout", f"version {ann.version} at {ann.path} refused: {problem}")
                return False
            self.layout = self.layout or layout  # the first version loaded sets it when nothing did
        resolve_s = time.perf_counter() - t0
        try:
            pause_s = self.engine.reload(path, self.target_version)
        except ReloadError as e:
            if not e.restored:
                raise
            self._refuse(key, "load", f"version {self.target_version} verified but failed to load: {e}")
            return False
        self.source.version = self.target_version
        self.refused_version = None
        self._retry_at.pop(key, None)
        self.stats.applied += 1
        self.stats.last_pause_s = pause_s
        self.stats.last_resolve_s = resolve_s
        log.info("weights version %d loaded from %s (verify/fetch %.3f s, engine pause %.3f s)",
                 self.target_version, path, resolve_s, pause_s)
        self._prune_cache(keep={path.name})
        return True

    def _check_layout(self, path: Path) -> tuple[dict[str, tuple[int, ...]] | None, str]:
        """(``path``'s tensor layout, '' or what differs from the reference). Checked before the
        engine is touched: after vLLM's in-place reload fails on a wrongly shaped tensor a restore
        fails the same way, so such a version must never reach it."""
        try:
            layout = read_layout(path) or None
        except (ValueError, OSError) as e:
            return None, str(e)
        if self.layout is None or layout is None:
            return layout, ""
        return layout, layout_mismatch(self.layout, layout)

    def _refuse(self, key: tuple[int, str], reason: str, msg: str) -> None:
        self.refused_version, self.refused_reason = self.target_version, reason
        self.stats.refused += 1
        self.stats.refused_reasons[reason] = self.stats.refused_reasons.get(reason, 0) + 1
        backoff = self.retry_s if key not in self._retry_at else min(2 * self._retry_at[key][1], self.retry_max_s)
        self._retry_at[key] = (time.monotonic() + backoff, backoff)
        log.error("%s; keeping weights version %d (retry in %.0f s)", msg, self.engine.version, backoff)

    def _prune_cache(self, keep: set[str]) -> None:
        """Delete fetched or pinned versions other than the one just loaded (a failed reload
        restores from that one; refused versions go too)."""
        if not self.cache_dir.is_dir():
            return
        for p in self.cache_dir.iterdir():
            if p.is_dir() and _VERSION_DIR.fullmatch(p.name) and p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)

