"""Delta encoding of weight versions: ``zstd(file(v) XOR file(base))`` for generators that hold ``base``.

Between two optimizer steps most bytes of a weight file keep their high bits (sign, exponent,
leading mantissa bits), and in bf16 most values do not change at all, so the XOR of consecutive
versions is mostly zeros and compresses well (benchmarks/results/bench_weight_delta.md measures
it on a real run). With ``weights.delta=true`` the learner writes, beside version ``v`` and only
when ``v - 1`` is still on disk, the folder::

    root/deltas/v{v:08d}/  DELTA.json   {"format", "version", "base", "base_checksum", "hash",
                                         "files": {name: {"delta", "bytes", "digest"}}}
                           <name>.xor.zst  for each safetensors file of the same size in both versions

``base_checksum`` is the sha256 of the base version's MANIFEST.json (what its announcement named);
``bytes``/``digest`` are the delta file's. The version folder itself is unchanged (vLLM, the shared
path and verification never see the deltas). The announcement carries ``delta_base`` and
``delta_checksum`` (sha256 of DELTA.json); a generator fetching from the controller that holds the
base version (its cached, verified copy has that manifest checksum) fetches DELTA.json and the
deltas instead of those files, decodes each against its copy and checks the result against the
version's own manifest digest; anything that fails is fetched whole (``transport/fetch.py``).

Departure: none (the papers do not describe weight transport).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import zstandard

from vapo_async.transport.digest import BLOCK, new_hasher
from vapo_async.transport.weights import (
    DELTA,
    DELTA_SUFFIX,
    MANIFEST,
    WeightsError,
    deltas_dir,
    version_dir_name,
)

FORMAT = "vapo_async.delta/1"
SUFFIX = DELTA_SUFFIX


def _xor(a: bytes, b: bytes) -> bytes:
    return (np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8)).tobytes()


def encode_file(cur: Path, base: Path, out: Path, algo: str, level: int = 1) -> tuple[int, str]:
    """Write ``zstd(cur XOR base)`` to ``out`` (same-size files); returns its (bytes, digest)."""
    if cur.stat().st_size != base.stat().st_size:
        raise ValueError(f"{cur} and {base} differ in size: no delta")
    h = new_hasher(algo)
    with open(cur, "rb") as fc, open(base, "rb") as fb, open(out, "wb") as fo:
        hashing = _HashingWriter(fo, h)
        with zstandard.ZstdCompressor(level=level).stream_writer(hashing, closefd=False) as z:
            while block := fc.read(BLOCK):
                z.write(_xor(block, fb.read(len(block))))
        fo.flush()
        os.fsync(fo.fileno())
        return hashing.n, h.hexdigest()


class _HashingWriter:
    """A file object that hashes what passes through it (zstd's output, as it is written)."""

    def __init__(self, f, h) -> None:  # f: BinaryIO, h: Hasher
        self.f, self.h, self.n = f, h, 0

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.n += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def decode_file(delta: Path, base: Path, out: Path, algo: str) -> str:
    """Write ``unzstd(delta) XOR base`` to ``out``; returns its digest. Raises ``WeightsError``
    (``delta``) when the decoded size is not the base's."""
    size = base.stat().st_size
    h, have = new_hasher(algo), 0
    try:
        with open(delta, "rb") as fd, open(base, "rb") as fb, open(out, "wb") as fo:
            reader = zstandard.ZstdDecompressor().stream_reader(fd)
            while block := reader.read(BLOCK):
                if have + len(block) > size:
                    raise WeightsError("delta", f"{delta} decodes to more than the base's {size} bytes")
                data = _xor(block, fb.read(len(block)))
                fo.write(data)
                h.update(data)
                have += len(block)
            fo.flush()
            os.fsync(fo.fileno())
    except zstandard.ZstdError as e:
        raise WeightsError("delta", f"{delta} is not a valid zstd stream: {e}") from None
    if have != size:
        raise WeightsError("delta", f"{delta} decodes to {have} bytes, the base has {size}")
    return h.hexdigest()


def write_deltas(root: Path, version: int, files: list[str], algo: str, level: int = 1) -> str | None:
    """Encode ``files`` of version ``version`` against ``version - 1`` into ``deltas_dir`` (only
    those whose base exists with the same size); returns the sha256 of DELTA.json, or None when
    there is no base. The folder appears complete or not at all (tmp + rename)."""
    base_dir, cur_dir = root / version_dir_name(version - 1), root / version_dir_name(version)
    if version < 1 or not (base_dir / MANIFEST).is_file():
        return None
    final = deltas_dir(root, version)
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        entries = {}
        for name in files:
            cur, base = cur_dir / name, base_dir / name
            if base.is_file() and base.stat().st_size == cur.stat().st_size:
                n, digest = encode_file(cur, base, tmp / (name + SUFFIX), algo, level)
                entries[name] = {"delta": name + SUFFIX, "bytes": n, "digest": digest}
        base_checksum = hashlib.sha256((base_dir / MANIFEST).read_bytes()).hexdigest()
        raw = json.dumps({"format": FORMAT, "version": version, "base": version - 1, "base_checksum": base_checksum,
                          "hash": algo, "files": entries}, indent=1, sort_keys=True).encode()
        (tmp / DELTA).write_bytes(raw)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return hashlib.sha256(raw).hexdigest()


def parse_delta(raw: bytes, checksum: str, version: int) -> tuple[int, str, str, dict[str, tuple[str, int, str]]]:
    """(base version, base manifest sha256, hash, {file: (delta name, delta bytes, delta digest)}) of a
    DELTA.json that hashes to ``checksum``. Raises ``WeightsError`` (``delta``)."""
    if hashlib.sha256(raw).hexdigest() != checksum:
        raise WeightsError("delta", f"DELTA.json of version {version} does not match the announced checksum")
    try:
        m = json.loads(raw)
        if m["format"] != FORMAT or m["version"] != version:
            raise WeightsError("delta", f"format/version {m['format']!r}/{m['version']!r} != {FORMAT}/{version}")
        files = {str(k): (str(v["delta"]), int(v["bytes"]), str(v["digest"])) for k, v in m["files"].items()}
        if any(d != k + SUFFIX for k, (d, _, _) in files.items()):
            raise WeightsError("delta", "delta file names must be <file>" + SUFFIX)
        return int(m["base"]), str(m["base_checksum"]), str(m["hash"]), files
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsError("delta", f"malformed DELTA.json: {e}") from None


def prune_deltas(root: Path, keep: set[int]) -> None:
    """Delete the deltas of versions not in ``keep`` (and partial ones)."""
    d = root / "deltas"
    if not d.is_dir():
        return
    for p in d.iterdir():
        v = int(p.name[1:]) if p.name.startswith("v") and p.name[1:].isdigit() else None
        if v is None or v not in keep:
            shutil.rmtree(p, ignore_errors=True)
