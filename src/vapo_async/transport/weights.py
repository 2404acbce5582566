"""Weight versions on disk: the layout, its manifest, and the checks every consumer runs before loading.

Layout under the run's weights root (name order = version order)::

    root/v00000007/  config.json, generation_config.json, tokenizer files (copied from base_dir),
                     model.safetensors | model-0000k-of-0000n.safetensors + model.safetensors.index.json,
                     MANIFEST.json  {"format", "version", "hash", "files": {name: {"bytes", "digest"}}}

Writers (``transport/publisher.py``) assemble a version under ``root/.tmp-v{version:08d}`` and
rename it into place (atomic on one filesystem), so a crash or a full disk never leaves a partial
directory with a version name. The announcement's ``checksum`` is the sha256 of MANIFEST.json,
which pins every file's digest (``hash``: xxh3_128 by default, or sha256; ``transport/digest.py``).
``verify_weights_dir`` is what consumers call before loading: the directory must be
``root/v{version:08d}`` itself (no traversal, no symlinks), hold exactly the manifest's files, and
match every size and digest. Manifests of format 1 (sha256 only, key ``sha256``) are still read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

from vapo_async.transport.digest import HASHES, hash_file
from vapo_async.transport.messages import MessageError, MessageLimits, WeightAnnouncement
from vapo_async.transport.wire import check_file_name

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
FORMAT = "vapo_async.weights/2"
FORMAT_V1 = "vapo_async.weights/1"
"""sha256 digests under the key ``sha256``; still read."""
MAX_MANIFEST_BYTES = 16 << 20
DELTA = "DELTA.json"
"""Index of a version's deltas (``transport/delta.py``), in ``deltas_dir``."""
DELTA_SUFFIX = ".xor.zst"
"""A delta file's name: the file it encodes + this."""
_VERSION_DIR = re.compile(r"v\d{8}")


class WeightsError(Exception):
    """A weight directory or fetch was refused; ``reason`` is a short token."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def version_dir_name(version: int) -> str:
    """``v{version:08d}``: the directory of weight ``version`` under a weights root."""
    return f"v{version:08d}"


def deltas_dir(root: Path, version: int) -> Path:
    """Where version ``version``'s deltas live under a weights ``root`` (``root/deltas/v{version:08d}``)."""
    return root / "deltas" / version_dir_name(version)


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


def parse_manifest(raw: bytes, ann: WeightAnnouncement, limits: MessageLimits) -> tuple[dict[str, tuple[int, str]], str]:
    """Check ``raw`` against ``ann`` (sha256, version, file set, sizes) -> ({name: (bytes, digest)}, hash)."""
    if hashlib.sha256(raw).hexdigest() != ann.checksum:
        raise WeightsError("checksum", f"MANIFEST.json of version {ann.version} does not match the announced checksum")
    try:
        m = json.loads(raw)
        if m["format"] not in (FORMAT, FORMAT_V1) or m["version"] != ann.version:
            raise WeightsError("manifest", f"format/version {m['format']!r}/{m['version']!r} != {FORMAT}/{ann.version}")
        v1 = m["format"] == FORMAT_V1
        algo = "sha256" if v1 else str(m["hash"])
        if algo not in HASHES:
            raise WeightsError("manifest", f"unknown hash {algo!r} (known: {', '.join(HASHES)})")
        key = "sha256" if v1 else "digest"
        files = {check_file_name(k): (int(v["bytes"]), str(v[key])) for k, v in m["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, MessageError) as e:
        raise WeightsError("manifest", f"malformed MANIFEST.json: {e}") from None
    if set(files) != set(ann.files) or len(files) > limits.max_weight_files:
        raise WeightsError("manifest", "manifest files differ from the announcement's")
    if any(n < 0 for n, _ in files.values()) or sum(n for n, _ in files.values()) > limits.max_weight_bytes:
        raise WeightsError("size", f"weight files exceed limits.max_weight_bytes={limits.max_weight_bytes}")
    return files, algo


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
                       limits: MessageLimits | None = None, digests: bool = True) -> Path:
    """The resolved ``path`` after checking it is ``root/v{ann.version:08d}`` (no traversal or
    symlinks), holds exactly the manifest's files as regular files, and matches every size and
    digest (the manifest's own sha256 = ``ann.checksum``; ``digests=False`` skips the files'
    digests, for a caller that computed them while writing). Raises ``WeightsError``."""
    limits = limits or MessageLimits()
    real = locate_version(Path(path), Path(root), ann.version)
    try:
        st = os.lstat(real / MANIFEST)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            raise WeightsError("manifest", f"{real / MANIFEST} is not a regular file under {MAX_MANIFEST_BYTES} bytes")
        files, algo = parse_manifest((real / MANIFEST).read_bytes(), ann, limits)
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
            if digests and hash_file(real / name, algo) != digest:
                raise WeightsError("checksum", f"{real / name} does not match its {algo} in the manifest")
    except OSError as e:
        raise WeightsError("unreadable", f"cannot read weights at {real}: {e}") from e
    return real


def read_chunk(ann: WeightAnnouncement, name: str, offset: int, length: int) -> tuple[bytes, int]:
    """Bytes [offset, offset + length) of file ``name`` of a published version, and the file size
    (server side of chunked fetches; ``name`` must be MANIFEST.json, one of ``ann.files``, or, when
    the version has deltas, DELTA.json or a delta file)."""
    folder = Path(ann.path)
    if name != MANIFEST and name not in ann.files:
        if not ann.delta_checksum or (name != DELTA and name.removesuffix(DELTA_SUFFIX) not in ann.files):
            raise WeightsError("fetch_unknown_file", f"{name!r} is not part of version {ann.version}")
        folder = deltas_dir(folder.parent, ann.version)
    try:
        fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW)
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
