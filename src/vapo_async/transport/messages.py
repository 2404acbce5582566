"""The controller <-> generator protocol: one msgspec Struct per message kind, and its decoders.

Kinds (see docs/CONTRACTS.md):
- generator -> controller: ``hello``, ``request``, ``group`` (a one-group ``RolloutBatch``, codec
  in ``rollout.py``), ``heartbeat``, ``bye``, ``fetch``, ``weights_refused``, ``relay_join``.
- controller -> generator: ``welcome``, ``lease``, ``ack``, ``chunk``, ``error``, ``relay_peer``.
- generator -> generator (weight relay, ``relay.py``): ``fetch`` answered by ``chunk`` or ``error``.
- PUB: ``weights`` (``WeightAnnouncement``).

Each Struct is the one declaration of its kind: field types (``wire.Version``, ``wire.Index``, ...)
carry the ranges, ``__post_init__`` the few rules a type cannot state, and ``to_frames()`` encodes
it. ``decode_from_generator`` / ``decode_from_controller`` / ``decode_announcement`` decode a tagged
union of the kinds of one direction; everything is validated and a failure raises ``MessageError``
with a reason token. The deployment-sized limits of ``MessageLimits`` (weight and chunk sizes) are
checked after decoding by ``_check_limits``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from vapo_async.transport.batch import GroupInfo, RolloutBatch
from vapo_async.transport.rollout import (
    GroupMessage,
    decode_group,
    decode_group_frames,
    encode_group,
)
from vapo_async.transport.wire import (
    MAX_LEASE_PROMPTS,
    MAX_VERSION,
    SCHEMA,
    DirPath,
    Frame,
    Hex64,
    Id,
    Index,
    LeaseIds,
    MessageError,
    MessageLimits,
    PathStr,
    Seconds,
    ShortStr,
    Text,
    Token,
    Version,
    WireMessage,
    check_file_name,
    check_frame_sizes,
    decode_header,
    encode,
    settings_value,
)

__all__ = [
    "SCHEMA", "MessageError", "MessageLimits", "RolloutBatch", "GroupInfo", "encode_group", "decode_group",
    "WeightAnnouncement", "Hello", "Request", "Heartbeat", "Bye", "Fetch", "WeightsRefused", "Welcome", "Lease",
    "LeasePrompt", "Ack", "Chunk", "ErrorReply", "RelayJoin", "RelayPeer", "decode_from_generator",
    "decode_from_controller", "decode_announcement", "decode_fetch",
]

Scalar = bool | int | float | str
Z85Key = Annotated[str, msgspec.Meta(pattern=r"^([0-9A-Za-z.:+=^!/*?&<>()\[\]{}@%$#-]{40})?$")]
"""A CURVE public key in z85 (40 characters), or '' for none."""


class WeightAnnouncement(WireMessage, tag="weights"):
    """A published weight version: directory ``path``, sha256 ``checksum`` of its MANIFEST.json,
    total ``bytes`` and the manifest's plain file names (``files``, MANIFEST.json itself excluded);
    with ``weights.delta``, the version its deltas are against."""

    version: Version
    path: DirPath
    checksum: Hex64
    bytes: Index
    files: tuple[str, ...]
    delta_base: Annotated[int, msgspec.Meta(ge=-1, le=MAX_VERSION)] = -1
    """Version the learner wrote deltas against (``transport/delta.py``); -1 = none."""
    delta_checksum: Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{64})?$")] = ""
    """sha256 of the deltas' DELTA.json ('' = none)."""

    def __post_init__(self) -> None:
        for name in self.files:
            check_file_name(name)
        if (self.delta_base >= 0) != bool(self.delta_checksum) or self.delta_base >= self.version:
            raise MessageError("field", f"delta_base {self.delta_base} and delta_checksum must come together, "
                               f"below version {self.version}")

    def to_header(self) -> dict[str, Any]:
        """The fields as a plain JSON/msgpack-safe map (checkpoints; no kind or schema, no delta
        fields when there are no deltas, so checkpoints read the same as before they existed)."""
        plain = msgspec.json.decode(msgspec.json.encode(self))
        drop = {"kind", "schema"} | ({"delta_base", "delta_checksum"} if self.delta_base < 0 else set())
        return {k: v for k, v in plain.items() if k not in drop}


# ---- generator -> controller ----


class Hello(WireMessage, tag="hello"):
    """First message of a generator session; ``session`` is unique per client instance."""

    generator_id: Id
    session: Id
    max_prompts: Annotated[int, msgspec.Meta(ge=1, le=MAX_LEASE_PROMPTS)]
    version: Version = 0


class Request(WireMessage, tag="request"):
    """The generator can take ``credit`` more prompts now (replaces any earlier request)."""

    credit: Annotated[int, msgspec.Meta(ge=0, le=MAX_LEASE_PROMPTS)]


class Heartbeat(WireMessage, tag="heartbeat"):
    """Liveness; extends the deadlines of the sender's leases."""


class Bye(WireMessage, tag="bye"):
    """Clean leave; ``return_leases`` are handed back for immediate re-issue (all are, anyway)."""

    return_leases: LeaseIds = ()


class Fetch(WireMessage, tag="fetch"):
    """Ask for ``length`` bytes (<= ``limits.max_chunk_bytes``) of ``file`` of weight ``version``
    starting at ``offset``."""

    version: Version
    file: str
    offset: Index
    length: Annotated[int, msgspec.Meta(ge=1)]

    def __post_init__(self) -> None:
        check_file_name(self.file)


class WeightsRefused(WireMessage, tag="weights_refused"):
    """The generator refused weight ``version`` (``reason``: checksum, size, outside_root,
    fetch_timeout, load, ...) and keeps version ``held``. ``return_leases`` are its leases that
    need a version it cannot load, handed back for immediate re-issue. Until it loads a newer
    version (it then sends ``request`` again) it asks for no credit."""

    version: Version
    held: Version
    reason: Token
    return_leases: LeaseIds = ()


class RelayJoin(WireMessage, tag="relay_join"):
    """The sender fetches weight ``version`` and serves the bytes it has to other generators at
    ``address`` (``tcp://HOST:PORT``; CURVE with server key ``public_key``, z85, when not empty).
    The controller answers ``relay_peer`` naming where to fetch from."""

    version: Version
    address: Id
    public_key: Z85Key = ""


# ---- controller -> generator ----


class Welcome(WireMessage, tag="welcome"):
    """Answer to ``hello``: who the controller is and what a generator needs to start."""

    controller_id: Id
    session: Id
    version: Version
    weights: WeightAnnouncement | None
    weights_root: PathStr
    pub_endpoint: DirPath
    vocab_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_VERSION)]
    lease_timeout_s: Seconds
    heartbeat_s: Seconds
    sampling: dict[str, Scalar] = msgspec.field(default_factory=dict)
    """How to sample (``n``, ``temperature``, ``top_p``, ``max_tokens``): overrides the generator's."""
    max_model_len: Annotated[int, msgspec.Meta(ge=0, le=MAX_VERSION)] = 0
    """Context every generator engine must offer: longest prompt + ``max_tokens`` (0 = no demand).
    A generator whose configured ``engine.max_model_len`` is shorter refuses at start."""
    reward: dict[str, Any] = msgspec.field(default_factory=dict)
    """The learner's reward settings (``RewardConfig`` fields: values, answer formats, custom
    target); they replace the generator's own, so every generator scores alike."""

    def __post_init__(self) -> None:
        if not settings_value(self.reward):
            raise MessageError("field", "reward must map strings to scalars, lists or maps of scalars")


class LeasePrompt(msgspec.Struct, frozen=True):
    """One leased prompt: dataset ``index``, templated ``prompt`` text, ground-truth ``answer``."""

    index: Index
    prompt: Text
    answer: Text


class Lease(WireMessage, tag="lease"):
    """Prompts granted to one generator. Sample them only with weights of version >= ``min_version``
    (``weights`` names the current version); return each as a ``group`` before ``deadline_s``
    seconds pass without a heartbeat, or they are re-issued."""

    lease_id: Index
    min_version: Version
    deadline_s: Seconds
    prompts: Annotated[tuple[LeasePrompt, ...], msgspec.Meta(max_length=MAX_LEASE_PROMPTS)]
    weights: WeightAnnouncement | None = None


class Ack(WireMessage, tag="ack"):
    """Receipt of a group: ``status`` is accepted, duplicate or rejected (with ``reason``)."""

    lease_id: Index
    prompt_index: Index
    status: Literal["accepted", "duplicate", "rejected"]
    reason: ShortStr = ""


class Chunk(WireMessage, tag="chunk"):
    """``data`` = bytes [offset, offset + len(data)) of ``file`` (total ``size``) of ``version``.
    ``data`` travels as frame 1, never in the header; decoded, it is a view onto that frame."""

    version: Version
    file: str
    offset: Index
    size: Index
    data: Annotated[bytes, msgspec.Meta(max_length=0)] = b""

    def __post_init__(self) -> None:
        check_file_name(self.file)

    def to_frames(self) -> list[bytes | memoryview]:
        return [encode(msgspec.structs.replace(self, data=b"")), self.data]


class ErrorReply(WireMessage, tag="error"):
    """The controller refused something; ``reason`` is a token (e.g. unknown_session); ``detail``
    is cut to 500 characters."""

    reason: Id
    detail: Annotated[str, msgspec.Meta(max_length=500)] = ""

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "detail", self.detail[:500])


class RelayPeer(WireMessage, tag="relay_peer"):
    """Answer to ``relay_join``: fetch the big files of ``version`` from the generator at
    ``address`` (server key ``public_key``); ``address`` empty = from the controller. The manifest
    always comes from the controller, so whatever a peer sends is checked against digests the
    learner wrote."""

    version: Version
    address: ShortStr = ""
    public_key: Z85Key = ""


FromGenerator = Hello | Request | Heartbeat | Bye | Fetch | WeightsRefused | RelayJoin | RolloutBatch
FromController = Welcome | Lease | Ack | Chunk | ErrorReply | RelayPeer
_FROM_GENERATOR = msgspec.msgpack.Decoder(
    Hello | Request | Heartbeat | Bye | Fetch | WeightsRefused | RelayJoin | GroupMessage)
_FROM_CONTROLLER = msgspec.msgpack.Decoder(FromController)
_FETCH = msgspec.msgpack.Decoder(Fetch)
_ANNOUNCEMENT = msgspec.msgpack.Decoder(WeightAnnouncement)


def _check_limits(msg: msgspec.Struct, limits: MessageLimits) -> None:
    """The ``MessageLimits`` bounds (deployment-sized, so not in the types)."""
    anns = [msg] if isinstance(msg, WeightAnnouncement) else [getattr(msg, "weights", None)]
    for a in anns:
        if isinstance(a, WeightAnnouncement) and (a.bytes > limits.max_weight_bytes
                                                  or len(a.files) > limits.max_weight_files):
            raise MessageError("field_range", f"weights of {a.bytes} bytes in {len(a.files)} files exceed the limits")
    offsets = [msg.offset] + ([msg.size] if isinstance(msg, Chunk) else []) if isinstance(msg, Fetch | Chunk) else []
    if any(o > limits.max_weight_bytes for o in offsets):
        raise MessageError("field_range", f"offset/size {offsets} > max_weight_bytes={limits.max_weight_bytes}")
    if isinstance(msg, Fetch) and msg.length > limits.max_chunk_bytes:
        raise MessageError("field_range", f"length={msg.length} > max_chunk_bytes={limits.max_chunk_bytes}")


def _decode(frames: Sequence[Frame], decoder: msgspec.msgpack.Decoder[Any], limits: MessageLimits,
            n_frames: int = 1) -> tuple[Any, list[memoryview]]:
    if not frames:
        raise MessageError("frame_count", "empty message")
    views = check_frame_sizes(frames, limits)
    msg = decode_header(views[0], decoder, limits)
    if not isinstance(msg, GroupMessage | Chunk) and len(views) != n_frames:
        raise MessageError("frame_count", f"{len(views)} frames, expected {n_frames}")
    _check_limits(msg, limits)
    return msg, views


def decode_from_generator(frames: Sequence[Frame], limits: MessageLimits, *, vocab_size: int | None,
                          max_version: int | None) -> FromGenerator:
    """Validate and decode any generator -> controller message. Raises ``MessageError``."""
    msg, views = _decode(frames, _FROM_GENERATOR, limits)
    if isinstance(msg, GroupMessage):
        return decode_group_frames(msg, views, limits, vocab_size=vocab_size, max_version=max_version)
    return msg  # type: ignore[no-any-return]


def decode_from_controller(frames: Sequence[Frame], limits: MessageLimits) -> FromController:
    """Validate and decode any controller -> generator message. Raises ``MessageError``."""
    msg, views = _decode(frames, _FROM_CONTROLLER, limits)
    if isinstance(msg, Chunk):
        if len(views) != 2:
            raise MessageError("frame_count", f"chunk has {len(views)} frames, expected 2")
        if views[1].nbytes > limits.max_chunk_bytes:
            raise MessageError("frame_too_large", f"chunk of {views[1].nbytes} bytes")
        return msgspec.structs.replace(msg, data=views[1])
    return msg  # type: ignore[no-any-return]


def decode_fetch(frames: Sequence[Frame], limits: MessageLimits) -> Fetch:
    """Validate and decode a ``fetch`` sent to a generator's relay server. Raises ``MessageError``."""
    msg, _ = _decode(frames, _FETCH, limits)
    return msg  # type: ignore[no-any-return]


def decode_announcement(frames: Sequence[Frame], limits: MessageLimits) -> WeightAnnouncement:
    """Validate and decode a PUB ``weights`` message. Raises ``MessageError``."""
    msg, _ = _decode(frames, _ANNOUNCEMENT, limits)
    return msg  # type: ignore[no-any-return]
