"""Typed control messages of the controller <-> generator protocol, their codecs and dispatch.

Kinds (see docs/CONTRACTS.md):
- generator -> controller: ``hello``, ``request``, ``group`` (``RolloutGroup``), ``heartbeat``,
  ``bye``, ``fetch``, ``weights_refused``.
- controller -> generator: ``welcome``, ``lease``, ``ack``, ``chunk``, ``error``.
- PUB: ``weights`` (``WeightAnnouncement``).

Every class has ``to_frames()`` and is decoded by ``decode_from_generator`` /
``decode_from_controller`` / ``decode_announcement``, which validate everything and raise
``MessageError`` with a reason token. ``RolloutGroup``, ``encode_group`` and ``decode_group`` live in
``rollout.py`` and are re-exported here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vapo_async.transport.rollout import RolloutGroup, decode_group, encode_group
from vapo_async.transport.wire import (
    SCHEMA,
    Frame,
    MessageError,
    MessageLimits,
    check_file_name,
    check_frame_sizes,
    decode_header,
    encode_header,
    get_float,
    get_int,
    get_int_list,
    get_list,
    get_map,
    get_str,
)

__all__ = [
    "SCHEMA", "MessageError", "MessageLimits", "RolloutGroup", "encode_group", "decode_group",
    "WeightAnnouncement", "Hello", "Request", "Heartbeat", "Bye", "Fetch", "WeightsRefused", "Welcome", "Lease",
    "LeasePrompt", "Ack", "Chunk", "ErrorReply", "decode_from_generator", "decode_from_controller",
    "decode_announcement",
]

_HEX64 = re.compile(r"[0-9a-f]{64}")
_REASON = re.compile(r"[a-z0-9_]{1,64}")
_SCALAR = (bool, int, float, str)


@dataclass(frozen=True)
class WeightAnnouncement:
    """A published weight version: directory ``path``, sha256 ``checksum`` of its MANIFEST.json,
    total ``bytes`` and the manifest's file names (``files``, MANIFEST.json itself excluded)."""

    version: int
    path: str
    checksum: str
    bytes: int
    files: tuple[str, ...]

    def to_header(self) -> dict[str, Any]:
        return {"version": self.version, "path": self.path, "checksum": self.checksum,
                "bytes": self.bytes, "files": list(self.files)}

    def to_frames(self) -> list[bytes]:
        return [encode_header({"kind": "weights", **self.to_header()})]

    @staticmethod
    def from_header(h: dict[str, Any], limits: MessageLimits) -> WeightAnnouncement:
        checksum = get_str(h, "checksum", 64)
        if not _HEX64.fullmatch(checksum):
            raise MessageError("field_range", "checksum must be 64 lowercase hex digits")
        files = get_list(h, "files", limits.max_weight_files)
        names = tuple(check_file_name(get_str({"f": f}, "f", 255)) for f in files)
        return WeightAnnouncement(
            version=get_int(h, "version", 0, 2**31 - 1),
            path=get_str(h, "path", limits.max_path_chars),
            checksum=checksum,
            bytes=get_int(h, "bytes", 0, limits.max_weight_bytes),
            files=names,
        )


def _ann_or_none(h: dict[str, Any], key: str, limits: MessageLimits) -> WeightAnnouncement | None:
    if h.get(key) is None:
        return None
    return WeightAnnouncement.from_header(get_map(h, key), limits)


# ---- generator -> controller ----


@dataclass(frozen=True)
class Hello:
    """First message of a generator session; ``session`` is unique per client instance."""

    generator_id: str
    session: str
    max_prompts: int
    version: int = 0

    def to_frames(self) -> list[bytes]:
        return [encode_header({"kind": "hello", "generator_id": self.generator_id, "session": self.session,
                               "max_prompts": self.max_prompts, "version": self.version})]


@dataclass(frozen=True)
class Request:
    """The generator can take ``credit`` more prompts now (replaces any earlier request)."""

    credit: int

    def to_frames(self) -> list[bytes]:
        return [encode_header({"kind": "request", "credit": self.credit})]


@dataclass(frozen=True)
class Heartbeat:
    """Liveness; extends the deadlines of the sender's leases."""

    def to_frames(self) -> list[bytes]:
        return [encode_header({"kind": "heartbeat"})]


@dataclass(frozen=True)
class Bye:
    """Clean leave; ``return_leases`` are handed back for immediate re-issue (all are, anyway)."""

    return_leases: tuple[int, ...] = ()

    def to_frames(self) -> list[bytes]:
        return [encode_header({"kind": "bye", "return_leases": list(self.return_leases)})]


@dataclass(frozen=True)
class Fetch:
    """Ask for ``length`` bytes of ``file`` of weight ``version`` starting at ``offset``."""

    version: int
    file: str
    offset: int
    length: int

    def to_frames(self) -> list[bytes]:
        return [encode_header({"kind": "fetch", "version": self.version, "file": self.file,
                               "offset": self.offset, "length": self.length})]


@dataclass(frozen=True)
class WeightsRefused:
    """The generator refused weight ``version`` (``reason``: checksum, size, outside_root,
    fetch_timeout, load, ...) and keeps version ``held``. ``return_leases`` are its leases that
    need a version it cannot load, handed back for immediate re-issue. Until it loads a newer
    version (it then sends ``request`` again) it asks for no credit."""

    version: int
    held: int
    reason: str
    return_leases: tuple[int, ...] = ()

    def to_frames(self) -> list[bytes]:
        return [encode_header({"kind": "weights_refused", "version": self.version, "held": self.held,
                               "reason": self.reason, "return_leases": list(self.return_leases)})]


# ---- controller -> generator ----


@dataclass(frozen=True)
class Welcome:
    """Answer to ``hello``: who the controller is and what a generator needs to start."""

    controller_id: str
    session: str
    version: int
    weights: WeightAnnouncement | None
    weights_root: str
    pub_endpoint: str
    vocab_size: int
    lease_timeout_s: float
    heartbeat_s: float
    sampling: dict[str, Any] = field(default_factory=dict)
    """How to sample (``n``, ``temperature``, ``top_p``, ``max_tokens``): overrides the generator's."""
    max_model_len: int = 0
    """Context every generator engine must offer: longest prompt + ``max_tokens`` (0 = no demand).
    A generator whose configured ``engine.max_model_len`` is shorter refuses at start."""
    reward: dict[str, Any] = field(default_factory=dict)
    """The learner's reward settings (``RewardConfig`` fields: values, answer formats, custom
    target); they replace the generator's own, so every generator scores alike."""

    def to_frames(self) -> list[bytes]:
        return [encode_header({
            "kind": "welcome", "controller_id": self.controller_id, "session": self.session,
            "version": self.version, "weights": self.weights.to_header() if self.weights else None,
            "weights_root": self.weights_root, "pub_endpoint": self.pub_endpoint,
            "vocab_size": self.vocab_size, "lease_timeout_s": self.lease_timeout_s,
            "heartbeat_s": self.heartbeat_s, "sampling": self.sampling,
            "max_model_len": self.max_model_len, "reward": self.reward,
        })]


@dataclass(frozen=True)
class LeasePrompt:
    """One leased prompt: dataset ``index``, templated ``prompt`` text, ground-truth ``answer``."""

    index: int
    prompt: str
    answer: str


@dataclass(frozen=True)
class Lease:
    """Prompts granted to one generator. Sample them only with weights of version >= ``min_version``
    (``weights`` names the current version); return each as a ``group`` before ``deadline_s``
    seconds pass without a heartbeat, or they are re-issued."""

    lease_id: int
    min_version: int
    deadline_s: float
    prompts: tuple[LeasePrompt, ...]
    weights: WeightAnnouncement | None = None

    def to_frames(self) -> list[bytes]:
        return [encode_header({
            "kind": "lease", "lease_id": self.lease_id, "min_version": self.min_version,
            "deadline_s": self.deadline_s, "weights": self.weights.to_header() if self.weights else None,
            "prompts": [{"index": p.index, "prompt": p.prompt, "answer": p.answer} for p in self.prompts],
        })]


@dataclass(frozen=True)
class Ack:
    """Receipt of a group: ``status`` is accepted, duplicate or rejected (with ``reason``)."""

    lease_id: int
    prompt_index: int
    status: str
    reason: str = ""

    def to_frames(self) -> list[bytes]:
        return [encode_header({"kind": "ack", "lease_id": self.lease_id, "prompt_index": self.prompt_index,
                               "status": self.status, "reason": self.reason})]


@dataclass(frozen=True)
class Chunk:
    """``data`` = bytes [offset, offset + len(data)) of ``file`` (total ``size``) of ``version``."""

    version: int
    file: str
    offset: int
    size: int
    data: bytes | memoryview

    def to_frames(self) -> list[bytes | memoryview]:
        return [encode_header({"kind": "chunk", "version": self.version, "file": self.file,
                               "offset": self.offset, "size": self.size}), self.data]


@dataclass(frozen=True)
class ErrorReply:
    """The controller refused something; ``reason`` is a token (e.g. unknown_session)."""

    reason: str
    detail: str = ""

    def to_frames(self) -> list[bytes]:
        return [encode_header({"kind": "error", "reason": self.reason, "detail": self.detail[:500]})]


_GENERATOR_KINDS = frozenset({"hello", "request", "heartbeat", "bye", "fetch", "group", "weights_refused"})
_CONTROLLER_KINDS = frozenset({"welcome", "lease", "ack", "chunk", "error"})
FromGenerator = Hello | Request | Heartbeat | Bye | Fetch | WeightsRefused | RolloutGroup
FromController = Welcome | Lease | Ack | Chunk | ErrorReply


def _single(frames: Sequence[Frame], limits: MessageLimits, n: int = 1) -> dict[str, Any]:
    if len(frames) != n:
        raise MessageError("frame_count", f"{len(frames)} frames, expected {n}")
    return decode_header(check_frame_sizes(frames[:1], limits)[0], limits)


def decode_from_generator(frames: Sequence[Frame], limits: MessageLimits, *, vocab_size: int | None,
                          max_version: int | None) -> FromGenerator:
    """Validate and decode any generator -> controller message. Raises ``MessageError``."""
    if not frames:
        raise MessageError("frame_count", "empty message")
    head = decode_header(check_frame_sizes(frames[:1], limits)[0], limits)
    kind = head["kind"]
    if kind not in _GENERATOR_KINDS:
        raise MessageError("kind", f"unknown kind {kind[:40]!r}")
    if kind == "group":
        return decode_group(frames, limits, vocab_size=vocab_size, max_version=max_version)
    h = _single(frames, limits)
    if kind == "hello":
        return Hello(get_str(h, "generator_id", limits.max_id_chars), get_str(h, "session", limits.max_id_chars),
                     get_int(h, "max_prompts", 1, limits.max_lease_prompts), get_int(h, "version", 0, 2**31 - 1))
    if kind == "request":
        return Request(get_int(h, "credit", 0, limits.max_lease_prompts))
    if kind == "heartbeat":
        return Heartbeat()
    if kind == "bye":
        return Bye(tuple(get_int_list(h, "return_leases", limits.max_lease_prompts)))
    if kind == "fetch":
        return Fetch(get_int(h, "version", 0, 2**31 - 1), check_file_name(get_str(h, "file", 255)),
                     get_int(h, "offset", 0, limits.max_weight_bytes), get_int(h, "length", 1, limits.max_chunk_bytes))
    if kind == "weights_refused":
        reason = get_str(h, "reason", limits.max_id_chars)
        if not _REASON.fullmatch(reason):
            raise MessageError("field_range", "weights_refused reason must be a [a-z0-9_] token")
        return WeightsRefused(get_int(h, "version", 0, 2**31 - 1), get_int(h, "held", 0, 2**31 - 1), reason,
                              tuple(get_int_list(h, "return_leases", limits.max_lease_prompts)))
    raise MessageError("kind", f"unknown kind {kind[:40]!r}")


def _lease(h: dict[str, Any], limits: MessageLimits) -> Lease:
    prompts = []
    for p in get_list(h, "prompts", limits.max_lease_prompts):
        if not isinstance(p, dict):
            raise MessageError("field", "lease prompt must be a map")
        prompts.append(LeasePrompt(get_int(p, "index"), get_str(p, "prompt", limits.max_text_chars, True),
                                   get_str(p, "answer", limits.max_text_chars, True)))
    return Lease(get_int(h, "lease_id"), get_int(h, "min_version", 0, 2**31 - 1),
                 get_float(h, "deadline_s", 0.0, 1e7), tuple(prompts), _ann_or_none(h, "weights", limits))


def _settings(value: Any, depth: int = 0) -> bool:
    """A settings value: a scalar, None, or a short list / string-keyed map of them, nested at
    most three deep (the reward map -> ``custom`` -> a list argument of the custom target)."""
    if value is None or isinstance(value, _SCALAR):
        return True
    if depth >= 3:
        return False
    if isinstance(value, list):
        return len(value) <= 64 and all(_settings(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return len(value) <= 64 and all(isinstance(k, str) and _settings(v, depth + 1) for k, v in value.items())
    return False


def _welcome(h: dict[str, Any], limits: MessageLimits) -> Welcome:
    sampling = get_map(h, "sampling")
    if not all(isinstance(k, str) and isinstance(v, _SCALAR) for k, v in sampling.items()):
        raise MessageError("field", "sampling must map strings to scalars")
    reward = get_map(h, "reward")
    if not _settings(reward):
        raise MessageError("field", "reward must map strings to scalars, lists or maps of scalars")
    return Welcome(
        controller_id=get_str(h, "controller_id", limits.max_id_chars),
        session=get_str(h, "session", limits.max_id_chars),
        version=get_int(h, "version", 0, 2**31 - 1),
        weights=_ann_or_none(h, "weights", limits),
        weights_root=get_str(h, "weights_root", limits.max_path_chars, True),
        pub_endpoint=get_str(h, "pub_endpoint", limits.max_path_chars),
        vocab_size=get_int(h, "vocab_size", 1, 2**31 - 1),
        lease_timeout_s=get_float(h, "lease_timeout_s", 0.0, 1e7),
        heartbeat_s=get_float(h, "heartbeat_s", 0.0, 1e7),
        sampling=sampling,
        max_model_len=get_int(h, "max_model_len", 0, 2**31 - 1),
        reward=reward,
    )


def decode_from_controller(frames: Sequence[Frame], limits: MessageLimits) -> FromController:
    """Validate and decode any controller -> generator message. Raises ``MessageError``."""
    if not frames:
        raise MessageError("frame_count", "empty message")
    head = decode_header(check_frame_sizes(frames[:1], limits)[0], limits)
    kind = head["kind"]
    if kind not in _CONTROLLER_KINDS:
        raise MessageError("kind", f"unknown kind {kind[:40]!r}")
    if kind == "chunk":
        h = _single(frames, limits, 2)
        data = check_frame_sizes(frames, limits)[1]
        if data.nbytes > limits.max_chunk_bytes:
            raise MessageError("frame_too_large", f"chunk of {data.nbytes} bytes")
        return Chunk(get_int(h, "version", 0, 2**31 - 1), check_file_name(get_str(h, "file", 255)),
                     get_int(h, "offset", 0, limits.max_weight_bytes), get_int(h, "size", 0, limits.max_weight_bytes),
                     data)
    h = _single(frames, limits)
    if kind == "welcome":
        return _welcome(h, limits)
    if kind == "lease":
        return _lease(h, limits)
    if kind == "ack":
        status = get_str(h, "status", limits.max_id_chars)
        if status not in ("accepted", "duplicate", "rejected"):
            raise MessageError("field_range", f"ack status {status[:40]!r}")
        return Ack(get_int(h, "lease_id"), get_int(h, "prompt_index"), status,
                   get_str(h, "reason", limits.max_id_chars, True))
    if kind == "error":
        return ErrorReply(get_str(h, "reason", limits.max_id_chars), get_str(h, "detail", 500, True))
    raise MessageError("kind", f"unknown kind {kind[:40]!r}")


def decode_announcement(frames: Sequence[Frame], limits: MessageLimits) -> WeightAnnouncement:
    """Validate and decode a PUB ``weights`` message. Raises ``MessageError``."""
    h = _single(frames, limits)
    if h["kind"] != "weights":
        raise MessageError("kind", f"expected weights, got {h['kind'][:40]!r}")
    return WeightAnnouncement.from_header(h, limits)
