"""Weight broadcast: publish the actor as a Hugging Face directory per version, verify it on use.

Layout under the run's weights root (name order = version order)::

    root/v00000007/  config.json, generation_config.json, tokenizer files (copied from base_dir),
                     model.safetensors | model-0000k-of-0000n.safetensors + model.safetensors.index.json,
                     MANIFEST.json  {"format", "version", "files": {name: {"bytes", "sha256"}}}

A version is written under ``root/.tmp-v{version}-{pid}-{rand}``, every file fsynced, then renamed
into place (atomic on one filesystem), so a crash or a full disk never leaves a partial directory
with a version name. The announcement's ``checksum`` is the sha256 of MANIFEST.json, which pins
every file's sha256. ``verify_weights_dir`` is what consumers call before loading: the directory
must be ``root/v{version:08d}`` itself (no traversal, no symlinks), hold exactly the manifest's
files, and match every size and hash. One publisher per root is assumed (stale ``.tmp-*``
directories are removed at start-up).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vapo_async.transport.messages import MessageError, MessageLimits, WeightAnnouncement
from vapo_async.transport.wire import check_file_name

if TYPE_CHECKING:  # torch is imported lazily: generators verify/fetch without loading it here
    import torch

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
FORMAT = "vapo_async.weights/1"
MAX_MANIFEST_BYTES = 16 << 20
_VERSION_DIR = re.compile(r"v\d{8}")
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.index\.json$")


class WeightsError(Exception):
    """A weight directory or fetch was refused; ``reason`` is a short token."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class WeightPublishError(RuntimeError):
    """Publishing a version failed (disk full, unwritable root, version exists); nothing was left behind."""


def version_dir_name(version: int) -> str:
    """``v{version:08d}``: the directory of weight ``version`` under a weights root."""
    return f"v{version:08d}"


def version_of_dir(name: str) -> int | None:
    """The version a directory name ``v{version:08d}`` stands for, or None for any other name."""
    return int(name[1:]) if _VERSION_DIR.fullmatch(name) else None


def published_versions(root: str | Path, complete: bool = True) -> dict[int, Path]:
    """Version -> directory of every version directory under ``root`` (oldest first); with
    ``complete`` only those holding a MANIFEST.json (a finished publish)."""
    r = Path(root)
    if not r.is_dir():
        return {}
    found = {v: p for p in r.iterdir() if (v := version_of_dir(p.name)) is not None and p.is_dir()
             and (not complete or (p / MANIFEST).is_file())}
    return dict(sorted(found.items()))


def sha256_file(path: Path, block: int = 8 << 20) -> str:
    """Streaming sha256 of a file."""
    digest = hashlib.sha256()
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WeightPublisher:
    """Writes versions under ``root`` (see module docstring) and keeps the newest ``keep`` (>= 2,
    since generators may still be loading the previous one)."""

    def __init__(self, root: str | Path, base_dir: str | Path, keep: int = 3, shard_bytes: int = 4 << 30) -> None:
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (generators may still read the previous version), got {keep}")
        self.root = Path(root)
        self.base_dir = Path(base_dir)
        self.keep = keep
        self.shard_bytes = shard_bytes
        if not (self.base_dir / "config.json").is_file():
            raise FileNotFoundError(f"base_dir {self.base_dir} has no config.json (not a Hugging Face model dir)")
        self.base_files = sorted(
            p.name for p in self.base_dir.iterdir()
            if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST and not _WEIGHT_FILES.fullmatch(p.name)
        )
        self.root.mkdir(parents=True, exist_ok=True)
        self.root = self.root.resolve()
        for stale in self.root.glob(".tmp-*"):
            log.warning("removing stale partial weight directory %s", stale)
            shutil.rmtree(stale)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-writer")

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> WeightAnnouncement:
        """Write ``state_dict`` (CPU tensors) as version ``version``; returns its announcement.
        Raises ``WeightPublishError`` with the cause; the partial directory is removed first."""
        final = self.root / version_dir_name(version)
        if final.exists():
            raise WeightPublishError(f"weights version {version} already exists at {final}")
        tmp = self.root / f".tmp-{version_dir_name(version)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=False)
            files = self._write_model(tmp, state_dict)
            files.update(self._copy_base(tmp))
            manifest = json.dumps({"format": FORMAT, "version": version, "files": files}, indent=1, sort_keys=True)
            (tmp / MANIFEST).write_bytes(manifest.encode())
            _fsync_file(tmp / MANIFEST)
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WeightPublishError(f"could not publish weights version {version} under {self.root}: {e}") from e
        self._prune(keep_also=final)
        total = sum(f["bytes"] for f in files.values()) + len(manifest.encode())
        return WeightAnnouncement(version, str(final), hashlib.sha256(manifest.encode()).hexdigest(), total,
                                  tuple(sorted(files)))

    def publish_async(self, version: int, state_dict: dict[str, torch.Tensor], copy: bool = True) -> Future[WeightAnnouncement]:
        """Publish on the writer thread. With ``copy`` the tensors are first copied to fresh CPU
        tensors on the caller's thread (the only stall), so training may update the originals."""
        snapshot = {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()} if copy else state_dict
        return self._executor.submit(self.publish, version, snapshot)

    def close(self) -> None:
        """Wait for queued publishes and stop the writer thread."""
        self._executor.shutdown(wait=True)

    def _write_model(self, out: Path, state_dict: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
        from vapo_async.transport.safetensors_io import plan_shards, write_safetensors

        shards = plan_shards(state_dict, self.shard_bytes)
        if len(shards) == 1:
            n, digest = write_safetensors(out / "model.safetensors", shards[0])
            return {"model.safetensors": {"bytes": n, "sha256": digest}}
        files: dict[str, dict[str, Any]] = {}
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            n, digest = write_safetensors(out / name, shard)
            files[name] = {"bytes": n, "sha256": digest}
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
        (out / "model.safetensors.index.json").write_bytes(index)
        _fsync_file(out / "model.safetensors.index.json")
        files["model.safetensors.index.json"] = {"bytes": len(index), "sha256": hashlib.sha256(index).hexdigest()}
        return files

    def _copy_base(self, out: Path) -> dict[str, dict[str, Any]]:
        files = {}
        for name in self.base_files:
            shutil.copyfile(self.base_dir / name, out / name)
            _fsync_file(out / name)
            files[name] = {"bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
        return files

    def _prune(self, keep_also: Path) -> None:
        versions = list(published_versions(self.root, complete=False).values())
        for old in versions[: max(0, len(versions) - self.keep)]:
            if old != keep_also:
                shutil.rmtree(old)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def parse_manifest(raw: bytes, ann: WeightAnnouncement, limits: MessageLimits) -> dict[str, tuple[int, str]]:
    """Check ``raw`` against ``ann`` (sha256, version, file set, sizes) -> {name: (bytes, sha256)}."""
    if hashlib.sha256(raw).hexdigest() != ann.checksum:
        raise WeightsError("checksum", f"MANIFEST.json of version {ann.version} does not match the announced checksum")
    try:
        m = json.loads(raw)
        if m["format"] != FORMAT or m["version"] != ann.version:
            raise WeightsError("manifest", f"format/version {m['format']!r}/{m['version']!r} != {FORMAT}/{ann.version}")
        files = {check_file_name(k): (int(v["bytes"]), str(v["sha256"])) for k, v in m["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, MessageError) as e:
        raise WeightsError("manifest", f"malformed MANIFEST.json: {e}") from None
    if set(files) != set(ann.files) or len(files) > limits.max_weight_files:
        raise WeightsError("manifest", "manifest files differ from the announcement's")
    if any(n < 0 for n, _ in files.values()) or sum(n for n, _ in files.values()) > limits.max_weight_bytes:
        raise WeightsError("size", f"weight files exceed limits.max_weight_bytes={limits.max_weight_bytes}")
    return files


def locate_version(path: Path, root: Path, version: int) -> Path:
    """The real path of ``path`` after checking it is ``root/v{version:08d}`` (no traversal, no symlink)."""
    if path.is_symlink():
        raise WeightsError("symlink", f"{path} is a symlink")
    real = Path(os.path.realpath(path))
    root_real = Path(os.path.realpath(root))
    if real.parent != root_real or real.name != version_dir_name(version):
        raise WeightsError("outside_root", f"{path} is not {root_real / version_dir_name(version)}")
    return real


def pin_version(src: Path, cache_dir: Path) -> Path:
    """Hard-link the version directory ``src`` (regular files) to ``cache_dir/src.name`` and return
    that path: the files then survive the learner pruning ``src``. Verify the result, not ``src``
    (a directory being pruned or republished while it is linked yields a partial or other copy). A
    directory of the same name already in the cache is replaced. Raises ``FileNotFoundError`` when
    ``src`` vanished, another ``OSError`` (EXDEV, EPERM, ...) when links cannot be made."""
    if os.path.realpath(cache_dir) == os.path.realpath(src.parent):
        raise ValueError(f"the weights cache {cache_dir} is the learner's weights directory: pinning would "
                         "delete the versions it reads (set weights_cache elsewhere)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".pin-{src.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name in os.listdir(src):
            os.link(src / name, tmp / name, follow_symlinks=False)
        dest = cache_dir / src.name
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def verify_weights_dir(path: str | Path, root: str | Path, ann: WeightAnnouncement,
                       limits: MessageLimits | None = None) -> Path:
    """The resolved ``path`` after checking it is ``root/v{ann.version:08d}`` (no traversal or
    symlinks), holds exactly the manifest's files as regular files, and matches every size and
    sha256 (the manifest's own sha256 = ``ann.checksum``). Raises ``WeightsError``."""
    limits = limits or MessageLimits()
    real = locate_version(Path(path), Path(root), ann.version)
    try:
        st = os.lstat(real / MANIFEST)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            raise WeightsError("manifest", f"{real / MANIFEST} is not a regular file under {MAX_MANIFEST_BYTES} bytes")
        files = parse_manifest((real / MANIFEST).read_bytes(), ann, limits)
        present = set(os.listdir(real))
        if present != set(files) | {MANIFEST}:
            raise WeightsError("unexpected_files", f"{real} holds {sorted(present ^ (set(files) | {MANIFEST}))[:5]} "
                               "beyond/instead of the manifest's files")
        for name, (size, digest) in files.items():
            st = os.lstat(real / name)
            if not stat.S_ISREG(st.st_mode):
                raise WeightsError("symlink", f"{real / name} is not a regular file")
            if st.st_size != size:
                raise WeightsError("size", f"{real / name} has {st.st_size} bytes, manifest says {size}")
            if sha256_file(real / name) != digest:
                raise WeightsError("checksum", f"{real / name} does not match its sha256 in the manifest")
    except OSError as e:
        raise WeightsError("unreadable", f"cannot read weights at {real}: {e}") from e
    return real


def read_chunk(ann: WeightAnnouncement, name: str, offset: int, length: int) -> tuple[bytes, int]:
    """Bytes [offset, offset + length) of file ``name`` of a published version, and the file size
    (server side of chunked fetches; ``name`` must be MANIFEST.json or one of ``ann.files``)."""
    if name != MANIFEST and name not in ann.files:
        raise WeightsError("fetch_unknown_file", f"{name!r} is not part of version {ann.version}")
    try:
        fd = os.open(Path(ann.path) / name, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise WeightsError("fetch_unavailable", f"version {ann.version} file {name}: {e.strerror}") from e
    try:
        size = os.fstat(fd).st_size
        if offset > size:
            raise WeightsError("fetch_range", f"offset {offset} beyond {name} size {size}")
        return os.pread(fd, min(length, size - offset), offset), size
    except OSError as e:
        raise WeightsError("fetch_unavailable", f"version {ann.version} file {name}: {e.strerror}") from e
    finally:
        os.close(fd)


def announcement_for(path: str | Path) -> WeightAnnouncement:
    """Rebuild the announcement of an already published directory (e.g. after a learner restart)."""
    p = Path(path)
    raw = (p / MANIFEST).read_bytes()
    m = json.loads(raw)
    files = m["files"]
    total = sum(int(f["bytes"]) for f in files.values()) + len(raw)
    return WeightAnnouncement(int(m["version"]), str(p.resolve()), hashlib.sha256(raw).hexdigest(), total,
                              tuple(sorted(files)))


def latest_published(root: str | Path) -> WeightAnnouncement | None:
    """The announcement of the newest complete version under ``root`` (None if there is none)."""
    versions = list(published_versions(root).values())
    return announcement_for(versions[-1]) if versions else None
