"""Wire basics: the msgpack header frame, size limits, strict field readers and ``MessageError``.

Every ZeroMQ message of this project is ``[header, *array_frames]``: frame 0 is a msgpack map
``{"schema": SCHEMA, "kind": str, ...}``; the remaining frames are raw little-endian array bytes
whose dtypes and lengths the header declares. Nothing here unpickles, evaluates or executes input:
msgpack is decoded into plain maps/lists/str/int/float/bool and every field is type- and
range-checked before use. A message that fails any check raises ``MessageError(reason, detail)``;
the reason is a short stable token used as a metric suffix (``transport/rejected/<reason>``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

SCHEMA = 1
"""Wire schema version; a message with another value is rejected (reason ``schema``)."""


class MessageError(ValueError):
    """An incoming message failed validation; ``reason`` is a short metric-friendly token."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class MessageLimits:
    """Upper bounds applied to every incoming message before its content is used."""

    max_header_bytes: int = 4 << 20
    """Largest msgpack header frame (a lease carries prompt texts, so this is not tiny)."""
    max_frame_bytes: int = 256 << 20
    """Largest single frame of any message."""
    max_group_size: int = 256
    """Largest G (responses per group)."""
    max_response_tokens: int = 131_072
    """Longest response L_i in tokens."""
    max_prompt_tokens: int = 131_072
    """Longest prompt P in tokens."""
    max_lease_prompts: int = 4096
    """Most prompts in one lease, credit request or bye."""
    max_text_chars: int = 1 << 20
    """Longest prompt/answer string inside a lease."""
    max_id_chars: int = 128
    """Longest identifier (generator id, session, reasons, finish reasons)."""
    max_path_chars: int = 4096
    """Longest path string in a weight announcement."""
    max_chunk_bytes: int = 16 << 20
    """Largest weight-fetch chunk (request length and reply payload)."""
    max_weight_files: int = 4096
    """Most files in one published weight directory."""
    max_weight_bytes: int = 1 << 40
    """Largest total size of one published weight directory."""
    logprob_tolerance: float = 1e-6
    """Log-probs above this are rejected (float round-off can give +1e-7 for p ~ 1)."""

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if value <= 0:
                raise ValueError(f"MessageLimits.{name} must be > 0, got {value}")


class _HasBuffer(Protocol):
    @property
    def buffer(self) -> memoryview: ...


Frame = bytes | bytearray | memoryview | _HasBuffer
"""What a frame may be: bytes-like, or a ``zmq.Frame`` (received with copy=False)."""

INT64_MAX = 2**63 - 1


def frame_view(frame: Frame) -> memoryview:
    """A flat byte view of ``frame`` without copying."""
    if isinstance(frame, (bytes, bytearray)):
        return memoryview(frame)
    if isinstance(frame, memoryview):
        return frame.cast("B") if frame.format != "B" or frame.ndim != 1 else frame
    return frame.buffer.cast("B")


def check_frame_sizes(frames: Sequence[Frame], limits: MessageLimits) -> list[memoryview]:
    """Byte views of all frames; raises when any frame is larger than ``max_frame_bytes``."""
    views = [frame_view(f) for f in frames]
    for i, v in enumerate(views):
        if v.nbytes > limits.max_frame_bytes:
            raise MessageError("frame_too_large", f"frame {i} has {v.nbytes} bytes")
    return views


def encode_header(header: dict[str, Any]) -> bytes:
    """msgpack bytes of ``header`` with the schema version set."""
    return msgpack.packb({"schema": SCHEMA, **header}, use_bin_type=True)


def decode_header(view: memoryview, limits: MessageLimits) -> dict[str, Any]:
    """Decode and check frame 0: a msgpack map with the right schema and a string kind."""
    if view.nbytes > limits.max_header_bytes:
        raise MessageError("header_too_large", f"{view.nbytes} bytes")
    try:
        header = msgpack.unpackb(view, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException) as e:  # FormatError/ExtraData/UTF-8 are ValueErrors
        raise MessageError("header_decode", str(e)[:200]) from None
    if not isinstance(header, dict):
        raise MessageError("header_type", f"header is {type(header).__name__}, not a map")
    if header.get("schema") != SCHEMA or isinstance(header.get("schema"), bool):
        raise MessageError("schema", f"schema {header.get('schema')!r} != {SCHEMA}")
    if not isinstance(header.get("kind"), str):
        raise MessageError("header_type", "missing string field 'kind'")
    return header


# ---- strict field readers (raise MessageError("field", ...) naming the field) ----


def _missing(key: str, expected: str, value: object) -> MessageError:
    return MessageError("field", f"{key}: expected {expected}, got {type(value).__name__}")


def get_int(h: dict[str, Any], key: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    """``h[key]`` as an int in [lo, hi] (bools are not ints here)."""
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise _missing(key, "int", v)
    if not lo <= v <= hi:
        raise MessageError("field_range", f"{key}={v} outside [{lo}, {hi}]")
    return v


def get_float(h: dict[str, Any], key: str, lo: float, hi: float) -> float:
    """``h[key]`` as a finite float in [lo, hi] (ints accepted)."""
    v = h.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _missing(key, "number", v)
    if not (math.isfinite(v) and lo <= v <= hi):
        raise MessageError("field_range", f"{key}={v} outside [{lo}, {hi}]")
    return float(v)


def get_str(h: dict[str, Any], key: str, max_chars: int, allow_empty: bool = False) -> str:
    """``h[key]`` as a string of at most ``max_chars`` characters."""
    v = h.get(key)
    if not isinstance(v, str):
        raise _missing(key, "str", v)
    if len(v) > max_chars or (not v and not allow_empty):
        raise MessageError("field_range", f"{key} has {len(v)} chars (max {max_chars})")
    return v


def get_bool(h: dict[str, Any], key: str) -> bool:
    """``h[key]`` as a bool."""
    v = h.get(key)
    if not isinstance(v, bool):
        raise _missing(key, "bool", v)
    return v


def get_list(h: dict[str, Any], key: str, max_len: int) -> list[Any]:
    """``h[key]`` as a list of at most ``max_len`` items."""
    v = h.get(key)
    if not isinstance(v, list):
        raise _missing(key, "list", v)
    if len(v) > max_len:
        raise MessageError("field_range", f"{key} has {len(v)} items (max {max_len})")
    return v


def get_int_list(h: dict[str, Any], key: str, max_len: int, lo: int = 0, hi: int = INT64_MAX) -> list[int]:
    """``h[key]`` as a list of ints each in [lo, hi]."""
    items = get_list(h, key, max_len)
    return [get_int({key: x}, key, lo, hi) for x in items]


def get_map(h: dict[str, Any], key: str) -> dict[str, Any]:
    """``h[key]`` as a map."""
    v = h.get(key)
    if not isinstance(v, dict):
        raise _missing(key, "map", v)
    return v


def check_file_name(name: str, max_chars: int = 255) -> str:
    """A plain file name: no separators, no '..', not hidden, no NUL; else ``MessageError``."""
    bad = (
        not name
        or len(name) > max_chars
        or name.startswith(".")
        or any(c in name for c in "/\\\x00")
        or name != name.strip()
    )
    if bad:
        raise MessageError("file_name", f"{name[:80]!r} is not a plain file name")
    return name
