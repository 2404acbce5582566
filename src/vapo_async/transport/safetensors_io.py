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
