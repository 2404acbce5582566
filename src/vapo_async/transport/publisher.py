"""Writing weight versions: the producer side of the layout in ``transport/weights.py``.

A version is assembled in ``root/.tmp-v{version:08d}`` (the same name for every writer, so that
several learner ranks can each drop their shard files into it), then ``finish_version`` copies the
base model's non-weight files, writes the shard index (several files) and MANIFEST.json, fsyncs
and renames the directory into place: a version name never holds a partial version, and the
announcement is built only after the rename. ``WeightPublisher`` is the one-process form (a state
dict in, an announcement out), used by tools and tests; the learner writes from reused buffers in
the background (``learner/publish.py``) with the same functions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from vapo_async.transport.delta import prune_deltas, write_deltas
from vapo_async.transport.digest import DEFAULT_HASH, hash_bytes
from vapo_async.transport.messages import WeightAnnouncement
from vapo_async.transport.weights import (
    FORMAT,
    MANIFEST,
    published_versions,
    version_dir_name,
    version_of_dir,
)

if TYPE_CHECKING:  # torch is imported lazily: generators import this package without it
    import torch

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")

FileDigests = dict[str, tuple[int, str]]
"""File name -> (bytes, hex digest)."""


class WeightPublishError(RuntimeError):
    """Publishing a version failed (disk full, unwritable root, version exists); nothing was left behind."""


def tmp_dir(root: Path, version: int) -> Path:
    """Where version ``version`` is assembled (shared by all writers of that version)."""
    return root / f".tmp-{version_dir_name(version)}"


def tmp_version(path: Path) -> int | None:
    """The version a ``.tmp-v{version:08d}`` directory assembles (None for any other name)."""
    return version_of_dir(path.name[5:]) if path.name.startswith(".tmp-") else None


def base_files(base_dir: Path) -> list[str]:
    """The base model's files every version carries (config, tokenizer, ...; no weights)."""
    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(f"base_dir {base_dir} has no config.json (not a Hugging Face model dir)")
    return sorted(p.name for p in base_dir.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST
                  and not p.name.endswith(_WEIGHT_SUFFIXES))


def prepare_root(root: Path) -> Path:
    """Create ``root`` and remove partial versions a crashed writer left (call before any writer starts)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        log.warning("removing stale partial weight directory %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    return root.resolve()


def finish_version(root: Path, version: int, model_files: FileDigests, base_dir: Path, algo: str,
                   dtype_name: str | None = None, weight_map: dict[str, str] | None = None,
                   fsync: bool = True, delta_level: int | None = None) -> WeightAnnouncement:
    """Complete ``tmp_dir(root, version)``, which holds ``model_files`` (already written and
    hashed): add the base files (``config.json``'s dtype set to ``dtype_name`` when given), the
    index when there are several files (``weight_map``: tensor -> file), MANIFEST.json; rename it
    to ``root/v{version:08d}``; with ``delta_level`` (zstd level), write the model files' deltas
    against version - 1 when it is on disk (``transport/delta.py``). Raises ``WeightPublishError``
    (the partial directory removed)."""
    tmp, final = tmp_dir(root, version), root / version_dir_name(version)
    try:
        if final.exists():
            raise FileExistsError(f"weights version {version} already exists at {final}")
        files = dict(model_files)
        for name in base_files(base_dir):
            raw = (base_dir / name).read_bytes()
            if name == "config.json" and dtype_name is not None:
                raw = _with_dtype(raw, dtype_name)
            files[name] = _write_small(tmp / name, raw, algo, fsync)
        if len(model_files) > 1:
            if weight_map is None:
                raise ValueError("several model files need a weight_map for the index")
            total = sum(n for n, _ in model_files.values())
            index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
            files[INDEX] = _write_small(tmp / INDEX, index, algo, fsync)
        manifest = json.dumps({"format": FORMAT, "version": version, "hash": algo,
                               "files": {k: {"bytes": n, "digest": d} for k, (n, d) in files.items()}},
                              indent=1, sort_keys=True).encode()
        _write_small(tmp / MANIFEST, manifest, algo, fsync)
        if fsync:
            _fsync_dir(tmp)
        os.rename(tmp, final)
        if fsync:
            _fsync_dir(root)
    except (OSError, ValueError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WeightPublishError(f"could not publish weights version {version} under {root}: {e}") from e
    total_bytes = sum(n for n, _ in files.values()) + len(manifest)
    delta = None if delta_level is None else _deltas(root, version, sorted(model_files), algo, delta_level)
    return WeightAnnouncement(version, str(final), hashlib.sha256(manifest).hexdigest(), total_bytes,
                              tuple(sorted(files)), -1 if delta is None else version - 1, delta or "")


def _deltas(root: Path, version: int, names: list[str], algo: str, level: int) -> str | None:
    """``write_deltas``; a failure costs the deltas (logged), never the version."""
    try:
        return write_deltas(root, version, names, algo, level)
    except (OSError, ValueError) as e:
        log.warning("no deltas for weights version %d: %s", version, e)
        return None


def prune(root: Path, keep: int, keep_also: Path | None = None) -> None:
    """Delete all but the newest ``keep`` versions (never ``keep_also``) and partial versions older
    than the newest complete one (abandoned by ``latest wins``)."""
    versions = published_versions(root, complete=False)
    paths = list(versions.values())
    for old in paths[: max(0, len(paths) - keep)]:
        if old != keep_also:
            shutil.rmtree(old, ignore_errors=True)
    newest = max(versions, default=-1)
    for tmp in root.glob(".tmp-*"):
        v = tmp_version(tmp)
        if v is not None and v < newest:
            shutil.rmtree(tmp, ignore_errors=True)
    prune_deltas(root, set(published_versions(root)))


class WeightPublisher:
    """One process writes whole versions from CPU state dicts (see module docstring); keeps the
    newest ``keep`` (>= 2, since generators may still be loading the previous one)."""

    def __init__(self, root: str | Path, base_dir: str | Path, keep: int = 3, shard_bytes: int = 4 << 30,
                 algo: str = DEFAULT_HASH, fsync: bool = True, delta_level: int | None = None) -> None:
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (generators may still read the previous version), got {keep}")
        self.base_dir = Path(base_dir)
        base_files(self.base_dir)  # refuses a directory without config.json now
        self.keep, self.shard_bytes, self.algo, self.fsync = keep, shard_bytes, algo, fsync
        self.delta_level = delta_level
        """zstd level of deltas against the previous version (None: none; ``transport/delta.py``)."""
        hash_bytes(b"", algo)  # refuses an unknown algorithm now
        self.root = prepare_root(Path(root))

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> WeightAnnouncement:
        """Write ``state_dict`` (CPU tensors) as version ``version``; returns its announcement.
        Raises ``WeightPublishError`` with the cause; the partial directory is removed first."""
        from vapo_async.transport.safetensors_io import plan_files, write_safetensors

        plan = plan_files([(k, t.dtype, tuple(t.shape)) for k, t in state_dict.items()], 1, self.shard_bytes)
        tmp = tmp_dir(self.root, version)
        files: FileDigests = {}
        try:
            if (self.root / version_dir_name(version)).exists():
                raise FileExistsError(f"weights version {version} already exists")
            tmp.mkdir()
            for f in plan:
                files[f.name] = write_safetensors(tmp / f.name, {e.name: state_dict[e.name] for e in f.entries},
                                                  self.algo, self.fsync)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WeightPublishError(f"could not publish weights version {version} under {self.root}: {e}") from e
        weight_map = {e.name: f.name for f in plan for e in f.entries}
        ann = finish_version(self.root, version, files, self.base_dir, self.algo, weight_map=weight_map,
                             fsync=self.fsync, delta_level=self.delta_level)
        prune(self.root, self.keep, keep_also=Path(ann.path))
        return ann

    def close(self) -> None:
        """Nothing runs in the background here (kept for symmetry with the learner's writer)."""


def _with_dtype(raw: bytes, dtype_name: str) -> bytes:
    """config.json with its dtype keys (``torch_dtype``, ``dtype``) set to ``dtype_name``."""
    cfg = json.loads(raw)
    cfg["torch_dtype"] = dtype_name
    if "dtype" in cfg:
        cfg["dtype"] = dtype_name
    return json.dumps(cfg, indent=2, sort_keys=True).encode()


def _write_small(path: Path, raw: bytes, algo: str, fsync: bool) -> tuple[int, str]:
    with open(path, "wb") as f:
        f.write(raw)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return len(raw), hash_bytes(raw, algo)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

