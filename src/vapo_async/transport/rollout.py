"""The ``group`` message: one prompt's ``RolloutBatch`` (N = 1) and its zero-copy wire encoding.

Notation: G responses, P prompt length, L_i length of response i.

Frames (all little-endian): 0 is the ``GroupMessage`` header (msgspec: the group's ``GroupInfo``,
``prompt_len`` = P, ``lengths`` = [L_0, ..., L_{G-1}] and the ``dtypes`` of the array frames); then
one frame per wire field of ``batch.FIELDS`` in table order, of length P, sum L_i, G or 1 by its
level. Today: prompt_ids int32 (P,), response_ids int32 (sum L_i,), logprobs float32 (sum L_i,),
versions int32 (sum L_i,), rewards float32 (G,), correct bool (G,), truncated bool (G,); bools are one
byte each, 0 or 1.

``decode_group`` returns numpy views straight onto the received frames (``np.frombuffer``: no
copy, read-only); copy before writing into them. Fields not on the wire take their ``fill``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec
import numpy as np

from vapo_async.transport import batch as table
from vapo_async.transport.batch import GROUP, PROMPT, RESPONSE, TOKEN, GroupInfo, RolloutBatch
from vapo_async.transport.wire import (
    MAX_GROUP_SIZE,
    MAX_PROMPT_TOKENS,
    MAX_RESPONSE_TOKENS,
    Frame,
    MessageError,
    MessageLimits,
    WireMessage,
    check_frame_sizes,
    decode_header,
    encode,
)


def wire_dtypes() -> dict[str, str]:
    """Wire dtype of each array frame; a header declaring anything else is rejected (reason ``dtype``)."""
    return {f.name: f.dtype for f in table.wire_fields()}


class GroupMessage(WireMessage, tag="group"):
    """Header of a ``group`` message (generator -> controller). Invariants beyond the types:
    ``dtypes`` equals ``wire_dtypes()``; ``finish_reasons`` is empty or has one entry per response."""

    info: GroupInfo
    prompt_len: Annotated[int, msgspec.Meta(ge=1, le=MAX_PROMPT_TOKENS)]
    lengths: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, le=MAX_RESPONSE_TOKENS)], ...],
                       msgspec.Meta(min_length=1, max_length=MAX_GROUP_SIZE)]
    dtypes: dict[str, str]

    def __post_init__(self) -> None:
        if self.dtypes != wire_dtypes():
            raise MessageError("dtype", f"dtypes {str(self.dtypes)[:200]} != {wire_dtypes()}")
        if self.info.finish_reasons and len(self.info.finish_reasons) != len(self.lengths):
            raise MessageError("field", "finish_reasons must be G short strings or empty")


_DECODER = msgspec.msgpack.Decoder(GroupMessage)


def _as_frame(a: np.ndarray, dtype: str) -> memoryview:
    arr = np.ascontiguousarray(np.asarray(a).reshape(-1).astype(dtype, copy=False))
    return memoryview(arr.view(np.uint8))


def encode_group(g: RolloutBatch) -> list[bytes | memoryview]:
    """Frames of a one-group batch (header + one per wire field). The array frames are
    memoryviews (send with ``copy=False``). Raises ``ValueError`` unless ``g`` is one group."""
    info = g.info[0] if g.n_groups == 1 and g.info else None
    if info is None:
        raise ValueError(f"a group message carries one group with its GroupInfo, got {g.n_groups} groups")
    header = GroupMessage(info=info, prompt_len=int(g.prompt_lens[0]),
                          lengths=tuple(int(n) for n in g.response_lens), dtypes=wire_dtypes())
    return [encode(header), *(_as_frame(g.data[f.name], f.dtype) for f in table.wire_fields())]


def _array(view: memoryview, name: str, dtype_str: str, n: int) -> np.ndarray:
    dtype = np.dtype(dtype_str)
    if view.nbytes != n * dtype.itemsize:
        raise MessageError("length_mismatch", f"{name}: {view.nbytes} bytes, expected {n} x {dtype.itemsize}")
    if dtype == np.bool_:
        raw = np.frombuffer(view, dtype=np.uint8, count=n)
        if raw.size and int(raw.max()) > 1:
            raise MessageError("bool_value", f"{name} holds bytes other than 0/1")
    return np.frombuffer(view, dtype=dtype, count=n)


def _check_values(b: RolloutBatch, limits: MessageLimits, vocab_size: int | None, max_version: int | None) -> None:
    for name in ("prompt_ids", "response_ids"):
        a = b.data[name]
        if a.size and (int(a.min()) < 0 or (vocab_size is not None and int(a.max()) >= vocab_size)):
            raise MessageError("token_range", f"{name} outside [0, {vocab_size}): [{a.min()}, {a.max()}]")
    lp = b.data["logprobs"]
    if not np.isfinite(lp).all():
        raise MessageError("logprob_nonfinite", f"{int((~np.isfinite(lp)).sum())} non-finite log-probs")
    if lp.size and float(lp.max()) > limits.logprob_tolerance:
        raise MessageError("logprob_positive", f"max log-prob {float(lp.max())} > 0")
    v = b.data["versions"]
    if v.size and int(v.min()) < 0:
        raise MessageError("version_negative", f"min version {int(v.min())}")
    if v.size and max_version is not None and int(v.max()) > max_version:
        raise MessageError("version_future", f"version {int(v.max())} > current {max_version}")
    if v.size > 1:
        steps = np.diff(v.astype(np.int64))
        ends = np.cumsum(b.response_lens)[:-1]
        steps[ends[(ends > 0) & (ends < v.size)] - 1] = 0  # a new response may start at any version
        if int(steps.min()) < 0:
            raise MessageError("version_order", "versions decrease within a response")
    if not np.isfinite(b.data["rewards"]).all():
        raise MessageError("reward_nonfinite", "non-finite reward")


def decode_group_frames(h: GroupMessage, views: Sequence[memoryview], limits: MessageLimits, *,
                        vocab_size: int | None, max_version: int | None) -> RolloutBatch:
    """The batch of a ``group`` message whose header ``h`` is decoded and frames size-checked."""
    wire = table.wire_fields()
    if len(views) != 1 + len(wire):
        raise MessageError("frame_count", f"group has {len(views)} frames, expected {1 + len(wire)}")
    lens = np.asarray(h.lengths, dtype=np.int64)
    sizes = {PROMPT: h.prompt_len, TOKEN: int(lens.sum()), RESPONSE: len(lens), GROUP: 1}
    got = {f.name: _array(v, f.name, f.dtype, sizes[f.level]) for f, v in zip(wire, views[1:], strict=True)}
    data = {f.name: got[f.name] if f.wire else np.full(sizes[f.level], f.fill, f.dtype) for f in table.FIELDS}
    b = RolloutBatch(np.array([h.prompt_len], dtype=np.int64), np.array([len(lens)], dtype=np.int64), lens,
                     data, [h.info])
    _check_values(b, limits, vocab_size, max_version)
    return b


def decode_group(frames: Sequence[Frame], limits: MessageLimits, *, vocab_size: int | None = None,
                 max_version: int | None = None) -> RolloutBatch:
    """Validate and decode a ``group`` message (zero-copy views). Raises ``MessageError``.

    ``vocab_size`` bounds token ids (V); ``max_version`` is the receiver's current policy version
    (no token may claim a newer one)."""
    if not frames:
        raise MessageError("frame_count", "empty message")
    views = check_frame_sizes(frames, limits)
    h = decode_header(views[0], _DECODER, limits)
    return decode_group_frames(h, views, limits, vocab_size=vocab_size, max_version=max_version)
