"""Safetensors files written in one pass (bytes to the file and to the checksum together), and their layout.

The format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``
padded with spaces to a multiple of 8, then the concatenated raw tensor bytes. Writing it here
instead of ``safetensors.torch.save_file`` avoids a second pass to hash the file and accepts tensors
that share storage (tied embeddings are written twice, which every loader accepts). ``plan_files``
lays out a version before its bytes exist, so the learner gathers each tensor straight into its
place in a reused buffer (``learner/snapshot.py``) and ``write_image`` writes that buffer as is. Readers are
the reference library (tested for parity).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from vapo_async.transport.digest import BLOCK, DEFAULT_HASH, new_hasher

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES[torch.float8_e4m3fn] = "F8_E4M3"
    _DTYPES[torch.float8_e5m2] = "F8_E5M2"


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes ``t`` occupies in a safetensors file."""
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its bytes lie at ``[begin, end)`` after the header."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class FileLayout:
    """A safetensors file before its bytes exist: the header and every tensor's place after it.
    Whoever fills a flat buffer of ``data_bytes`` at these offsets has the file's body."""

    name: str
    """File name (``model.safetensors`` or ``model-0000k-of-0000n.safetensors``)."""
    rank: int
    """The learner rank that gathers and writes this file."""
    header: bytes
    entries: tuple[TensorEntry, ...]
    data_bytes: int

    @property
    def total_bytes(self) -> int:
        return len(self.header) + self.data_bytes


TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]
"""(name, dtype in the file, shape) of one tensor."""


def _layout(name: str, rank: int, specs: Sequence[TensorSpec]) -> FileLayout:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    entries = []
    offset = 0
    for tname, dtype, shape in specs:
        if dtype not in _DTYPES:
            raise TypeError(f"tensor {tname!r} has dtype {dtype}, which safetensors cannot store")
        n = math.prod(shape) * dtype.itemsize
        header[tname] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        entries.append(TensorEntry(tname, dtype, tuple(shape), offset, offset + n))
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return FileLayout(name, rank, struct.pack("<Q", len(raw)) + raw, tuple(entries), offset)


def plan_files(specs: Sequence[TensorSpec], ranks: int = 1, shard_bytes: int = 4 << 30) -> list[FileLayout]:
    """The files of one weights version written by ``ranks`` writers: the tensors, in order, cut
    into ``ranks`` contiguous runs of about equal bytes (each rank gathers and writes its own), each
    run cut again where a file would pass ``shard_bytes``. One file is ``model.safetensors``,
    several are Hugging Face shards ``model-0000k-of-0000n.safetensors`` (an index names them).
    Deterministic: every rank computes the same plan from the same specs."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    sizes = [math.prod(s) * d.itemsize for _, d, s in specs]
    total = sum(sizes)
    runs: list[list[int]] = [[] for _ in range(ranks)]
    acc = 0
    for i, n in enumerate(sizes):  # tensor i goes to the rank whose equal share holds its middle byte
        runs[min(ranks - 1, (acc + n // 2) * ranks // max(total, 1))].append(i)
        acc += n
    pieces: list[tuple[int, list[int]]] = []
    for rank, run in enumerate(runs):
        cur: list[int] = []
        size = 0
        for i in run:
            if cur and size + sizes[i] > shard_bytes:
                pieces.append((rank, cur))
                cur, size = [], 0
            cur.append(i)
            size += sizes[i]
        if cur:
            pieces.append((rank, cur))
    n = len(pieces)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    return [_layout(name, rank, [specs[i] for i in idx]) for name, (rank, idx) in zip(names, pieces, strict=True)]


def write_image(path: Path, header: bytes, body: memoryview, algo: str, fsync: bool = True) -> tuple[int, str]:
    """Write ``header`` + ``body`` (a flat byte view) to ``path`` and return (bytes, hex digest)."""
    return _write_hashed(path, (memoryview(header), body), algo, fsync)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], algo: str = DEFAULT_HASH,
                      fsync: bool = True) -> tuple[int, str]:
    """Write ``tensors`` (CPU) to ``path`` tensor by tensor (no copy of the whole file) and
    return (bytes written, hex digest with ``algo``)."""
    layout = _layout(Path(path).name, 0, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])
    return _write_hashed(path, _chunks(layout.header, tensors), algo, fsync)


def _write_hashed(path: Path, pieces: Iterable[memoryview], algo: str, fsync: bool) -> tuple[int, str]:
    """Write ``pieces`` to ``path`` in blocks, each hashed right after it is written, while it is
    still in cache (one pass); returns (bytes, hex digest)."""
    h = new_hasher(algo)
    written = 0
    with open(path, "wb", buffering=0) as f:
        for piece in pieces:
            for lo in range(0, len(piece), BLOCK):
                block = piece[lo:lo + BLOCK]
                _write_all(f, block)
                h.update(block)
                written += len(block)
        if fsync:
            os.fsync(f.fileno())
    return written, h.hexdigest()


def _write_all(f: BinaryIO, data: memoryview) -> None:
    while len(data):
        n = f.write(data)
        if n is None or n <= 0:
            raise OSError(f"short write to {f.name}")
        data = data[n:]


def _chunks(header: bytes, tensors: dict[str, torch.Tensor]) -> Iterator[memoryview]:
    yield memoryview(header)
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"tensor {name!r} is on {t.device}: move the state dict to CPU first")
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            yield memoryview(flat.view(torch.uint8).numpy())


MAX_HEADER_BYTES = 100 << 20
"""Largest safetensors header ``read_layout`` accepts (the format's own limit)."""


def read_layout(weights_dir: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} over the safetensors shards of ``weights_dir`` (those its index names,
    else every ``*.safetensors`` file), from the headers only; {} when there are none. Raises
    ``ValueError`` naming the file when a header or the index is malformed or a name repeats, and
    ``OSError`` when a shard cannot be read."""
    layout: dict[str, tuple[int, ...]] = {}
    for path in _safetensors_files(Path(weights_dir)):
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= MAX_HEADER_BYTES:
                raise ValueError(f"{path}: not a safetensors file (header length {n})")
            try:
                header = json.loads(f.read(n))
                shapes = {k: tuple(int(d) for d in v["shape"]) for k, v in header.items() if k != "__metadata__"}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}: malformed safetensors header: {e}") from None
        if repeated := set(shapes) & set(layout):
            raise ValueError(f"{path}: tensors {sorted(repeated)[:3]} also appear in another shard")
        layout.update(shapes)
    return layout


def _safetensors_files(weights_dir: Path) -> list[Path]:
    """The shards ``model.safetensors.index.json`` names, else every ``*.safetensors`` file."""
    index = weights_dir / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(weights_dir.glob("*.safetensors"))
    try:
        names = set(json.loads(index.read_bytes())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: malformed index: {e}") from None
    if any(not isinstance(n, str) or "/" in n or n.startswith(".") for n in names):
        raise ValueError(f"{index}: weight_map names a file outside the directory")
    return sorted(weights_dir / n for n in names)


def layout_mismatch(expected: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]]) -> str:
    """'' when ``got`` has the same tensor names and shapes as ``expected``, else what differs."""
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    reshaped = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    parts = [f"missing {missing[:3]}" if missing else "", f"unexpected {extra[:3]}" if extra else "",
             ", ".join(f"{k} {list(got[k])} != {list(expected[k])}" for k in reshaped[:3])]
    return "; ".join(p for p in parts if p)
