"""Streaming safetensors writer: tensor bytes go straight to the file and the sha256 in one pass.

The format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``
padded with spaces to a multiple of 8, then the concatenated raw tensor bytes. Writing it here
instead of ``safetensors.torch.save_file`` avoids a second pass to hash the file and accepts tensors
that share storage (tied embeddings are written twice, which every loader accepts). Readers are
the reference library (tested for parity).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

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


def _header(tensors: dict[str, torch.Tensor]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        n = tensor_nbytes(t)
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write ``tensors`` (CPU) to ``path``, fsync it, and return (bytes written, sha256 hex)."""
    digest = hashlib.sha256()
    header = _header(tensors)
    written = 0
    with open(path, "wb") as f:
        for chunk in _chunks(header, tensors):
            f.write(chunk)
            digest.update(chunk)
            written += chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return written, digest.hexdigest()


def _chunks(header: bytes, tensors: dict[str, torch.Tensor]):  # -> Iterator[bytes | memoryview]
    yield header
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"tensor {name!r} is on {t.device}: move the state dict to CPU first")
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            yield memoryview(flat.view(torch.uint8).numpy())


def plan_shards(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split ``tensors`` (in order) into shards of at most ``shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = tensor_nbytes(t)
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


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
