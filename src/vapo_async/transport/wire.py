"""Wire basics: the msgspec header, its constrained field types, size limits and ``MessageError``.

Every ZeroMQ message of this project is ``[header, *array_frames]``: frame 0 is a msgpack map
encoded from a ``WireMessage`` Struct (``{"kind": str, "schema": SCHEMA, ...}``); the remaining
frames are raw little-endian array bytes whose dtypes and lengths the header declares (they are
never copied into the header: zero-copy on both ends). Each message kind is one Struct, declared
once: its annotations give encoding, decoding and validation (types, ranges, lengths, patterns).
Nothing here unpickles, evaluates or executes input: msgspec decodes msgpack into the declared
types only. A message that fails any check raises ``MessageError(reason, detail)``; the reason is a
short stable token used as a metric suffix (``transport/rejected/<reason>``):

- ``header_decode`` (not msgpack), ``header_type`` (not a map / no ``kind``), ``header_too_large``,
  ``schema``, ``kind`` (unknown for this direction), ``frame_count``, ``frame_too_large``;
- ``field`` (wrong type or missing), ``field_range`` (outside its declared range, length or pattern);
- the reasons raised by a Struct's ``__post_init__`` (``file_name``, ``dtype``, ...), kept as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, TypeVar

import msgspec

SCHEMA = 1
"""Wire schema version; a message with another value is rejected (reason ``schema``)."""

# ---- limits that are part of the protocol (declared once, used by the field types below) ----

MAX_VERSION = 2**31 - 1
"""Largest policy version (int32 on the wire, like the per-token version arrays)."""
INT64_MAX = 2**63 - 1
MAX_GROUP_SIZE = 256
"""Largest G (responses per group)."""
MAX_RESPONSE_TOKENS = 131_072
"""Longest response L_i in tokens."""
MAX_PROMPT_TOKENS = 131_072
"""Longest prompt P in tokens."""
MAX_LEASE_PROMPTS = 4096
"""Most prompts in one lease, credit request or bye."""
MAX_TEXT_CHARS = 1 << 20
"""Longest prompt/answer string inside a lease."""
MAX_ID_CHARS = 128
"""Longest identifier (generator id, session, reasons, finish reasons)."""
MAX_PATH_CHARS = 4096
"""Longest path string (weights directory, endpoint)."""
MAX_SECONDS = 1e7
"""Largest duration (deadlines, heartbeats) a header may carry."""

Version = Annotated[int, msgspec.Meta(ge=0, le=MAX_VERSION)]
"""A policy version."""
Index = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
"""A non-negative id or index (lease ids, dataset indices, byte offsets)."""
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
"""A non-empty identifier."""
ShortStr = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
"""A short string, possibly empty (finish reasons, ack reasons)."""
Token = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9_]{1,64}$")]
"""A reason token: ``[a-z0-9_]{1,64}`` (it becomes a metric name)."""
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
"""Prompt or answer text."""
PathStr = Annotated[str, msgspec.Meta(max_length=MAX_PATH_CHARS)]
"""A path or endpoint string, possibly empty."""
DirPath = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS)]
"""A non-empty path or endpoint string."""
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
"""A finite, non-negative duration (NaN is out of range)."""
LeaseIds = Annotated[tuple[Index, ...], msgspec.Meta(max_length=MAX_LEASE_PROMPTS)]
"""Lease ids handed back (bye, weights_refused)."""
Hex64 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
"""A sha256 digest in lowercase hex."""


class MessageError(ValueError):
    """An incoming message failed validation; ``reason`` is a short metric-friendly token."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class MessageLimits:
    """Deployment-sized upper bounds applied to every incoming message before its content is used
    (the protocol's own bounds are the ``MAX_*`` constants above)."""

    max_header_bytes: int = 4 << 20
    """Largest msgpack header frame (a lease carries prompt texts, so this is not tiny)."""
    max_frame_bytes: int = 256 << 20
    """Largest single frame of any message."""
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


class WireMessage(msgspec.Struct, tag_field="kind", frozen=True, kw_only=True):
    """Base of every header: the subclass's ``tag`` is its ``kind``; ``schema`` is checked on decode."""

    schema: Literal[1] = SCHEMA

    def to_frames(self) -> list[bytes | memoryview]:
        """``[header]``; kinds with array frames override this."""
        return [encode(self)]


_ENCODER = msgspec.msgpack.Encoder()
M = TypeVar("M")


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of a header Struct."""
    return _ENCODER.encode(msg)


def _reason(e: msgspec.ValidationError) -> str:
    """The reason token of a msgspec validation error (see the module docstring)."""
    if isinstance(e.__cause__, MessageError):  # raised by a Struct's __post_init__
        return e.__cause__.reason
    text = str(e)
    if text.endswith("`$.schema`"):
        return "schema"
    if text.endswith("`$.kind`"):
        return "kind"
    if "missing required field `kind`" in text or (text.startswith("Expected `object`") and " - at `" not in text):
        return "header_type"
    if ", got `" in text or "missing required field" in text:
        return "field"
    return "field_range"


def decode_header(view: memoryview, decoder: msgspec.msgpack.Decoder[M], limits: MessageLimits) -> M:
    """Decode and validate frame 0 with ``decoder`` (a Struct or a tagged union of Structs)."""
    if view.nbytes > limits.max_header_bytes:
        raise MessageError("header_too_large", f"{view.nbytes} bytes")
    try:
        return decoder.decode(view)
    except msgspec.ValidationError as e:
        cause = e.__cause__
        raise MessageError(_reason(e), cause.detail if isinstance(cause, MessageError) else str(e)[:200]) from None
    except msgspec.DecodeError as e:
        raise MessageError("header_decode", str(e)[:200]) from None


class _HasBuffer(Protocol):
    @property
    def buffer(self) -> memoryview: ...


Frame = bytes | bytearray | memoryview | _HasBuffer
"""What a frame may be: bytes-like, or a ``zmq.Frame`` (received with copy=False)."""


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


def settings_value(value: Any, depth: int = 0) -> bool:
    """A settings value: a scalar, None, or a short list / string-keyed map of them, nested at
    most three deep (the reward map -> ``custom`` -> a list argument of the custom target)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth >= 3:
        return False
    if isinstance(value, list):
        return len(value) <= 64 and all(settings_value(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return len(value) <= 64 and all(isinstance(k, str) and settings_value(v, depth + 1) for k, v in value.items())
    return False
