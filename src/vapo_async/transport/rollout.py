"""``RolloutGroup``: one prompt and its G sampled responses, and its zero-copy wire encoding.

Notation: G responses per group, P prompt length, L_i length of response i.

Frames of a ``group`` message (all little-endian, per-response arrays concatenated in response
order; the header's ``lengths`` = [L_0, ..., L_{G-1}] splits them back):

  0 header    msgpack {schema, kind="group", lease_id, prompt_index, generator_id, group_size=G,
              prompt_len=P, lengths, dtypes, finish_reasons, gen_time_s}
  1 prompt_ids     int32   (P,)
  2 response_ids   int32   (sum L_i,)
  3 logprobs       float32 (sum L_i,)   behaviour-policy log-prob of each sampled token
  4 versions       int32   (sum L_i,)   policy version that sampled each token
  5 rewards        float32 (G,)
  6 correct        bool    (G,)  (one byte each, 0 or 1)
  7 truncated      bool    (G,)

``decode_group`` returns numpy views straight onto the received frames (``np.frombuffer``: no copy,
read-only); copy before writing into them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vapo_async.transport.wire import (
    Frame,
    MessageError,
    MessageLimits,
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

ARRAYS: tuple[tuple[str, str], ...] = (
    ("prompt_ids", "<i4"),
    ("response_ids", "<i4"),
    ("logprobs", "<f4"),
    ("versions", "<i4"),
    ("rewards", "<f4"),
    ("correct", "|b1"),
    ("truncated", "|b1"),
)
"""Array frames in wire order with their exact numpy dtype strings."""
DTYPES = dict(ARRAYS)
N_FRAMES = 1 + len(ARRAYS)


@dataclass
class RolloutGroup:
    """One prompt with G responses. Invariants: every per-response list has G arrays and
    ``len(response_ids[i]) == len(logprobs[i]) == len(versions[i]) == L_i``; ``rewards``,
    ``correct``, ``truncated`` have shape (G,); token ids lie in [0, V); log-probs are finite and
    <= 0; versions are >= 0 and non-decreasing within a response (weights only move forward)."""

    lease_id: int
    prompt_index: int
    generator_id: str
    prompt_ids: np.ndarray
    """int32 (P,)."""
    response_ids: list[np.ndarray]
    """G arrays, int32 (L_i,)."""
    logprobs: list[np.ndarray]
    """G arrays, float32 (L_i,): behaviour-policy log-prob of each sampled token."""
    versions: list[np.ndarray]
    """G arrays, int32 (L_i,): policy version that sampled each token."""
    rewards: np.ndarray
    """float32 (G,)."""
    correct: np.ndarray
    """bool (G,)."""
    truncated: np.ndarray
    """bool (G,): response hit the max-token limit."""
    finish_reasons: list[str] = field(default_factory=list)
    """G strings from the engine ("stop", "length", ...) or empty."""
    gen_time_s: float = 0.0
    """Wall time the generator spent on this group."""
    admission_index: int = -1
    """Set by the controller on receipt (its admission slot k); not sent on the wire."""
    received_at: float = 0.0
    """``time.monotonic()`` on receipt by the controller; not sent on the wire."""

    @property
    def group_size(self) -> int:
        """G."""
        return len(self.response_ids)

    @property
    def lengths(self) -> list[int]:
        """[L_0, ..., L_{G-1}]."""
        return [int(r.shape[0]) for r in self.response_ids]

    def oldest_version(self) -> int:
        """Smallest policy version of any token (-1 when every response is empty)."""
        mins = [int(v.min()) for v in self.versions if v.size]
        return min(mins) if mins else -1

    def nbytes(self) -> int:
        """Payload bytes of the array frames."""
        arrays = [self.prompt_ids, self.rewards, self.correct, self.truncated]
        arrays += self.response_ids + self.logprobs + self.versions
        return int(sum(a.nbytes for a in arrays))


def _concat(parts: list[np.ndarray], dtype: str) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(p).reshape(-1) for p in parts]).astype(dtype, copy=False)


def _as_frame(a: np.ndarray, dtype: str) -> memoryview:
    arr = np.ascontiguousarray(np.asarray(a).reshape(-1).astype(dtype, copy=False))
    return memoryview(arr.view(np.uint8))


def encode_group(g: RolloutGroup) -> list[bytes | memoryview]:
    """Frames of ``g`` (header + 7 arrays). Raises ``ValueError`` if ``g`` breaks its invariants.
    The array frames are memoryviews (send with ``copy=False``)."""
    G = g.group_size
    lengths = g.lengths
    if len(g.logprobs) != G or len(g.versions) != G:
        raise ValueError(f"group has {G} responses but {len(g.logprobs)} logprob / {len(g.versions)} version arrays")
    for name, parts in (("logprobs", g.logprobs), ("versions", g.versions)):
        if [int(np.asarray(p).shape[0]) for p in parts] != lengths:
            raise ValueError(f"{name} lengths differ from response lengths {lengths}")
    for name in ("rewards", "correct", "truncated"):
        if np.asarray(getattr(g, name)).shape != (G,):
            raise ValueError(f"{name} must have shape ({G},), got {np.asarray(getattr(g, name)).shape}")
    if g.finish_reasons and len(g.finish_reasons) != G:
        raise ValueError(f"finish_reasons has {len(g.finish_reasons)} entries, expected {G}")
    header = {
        "kind": "group",
        "lease_id": int(g.lease_id),
        "prompt_index": int(g.prompt_index),
        "generator_id": g.generator_id,
        "group_size": G,
        "prompt_len": int(np.asarray(g.prompt_ids).shape[0]),
        "lengths": lengths,
        "dtypes": DTYPES,
        "finish_reasons": list(g.finish_reasons),
        "gen_time_s": float(g.gen_time_s),
    }
    return [
        encode_header(header),
        _as_frame(g.prompt_ids, "<i4"),
        _as_frame(_concat(g.response_ids, "<i4"), "<i4"),
        _as_frame(_concat(g.logprobs, "<f4"), "<f4"),
        _as_frame(_concat(g.versions, "<i4"), "<i4"),
        _as_frame(g.rewards, "<f4"),
        _as_frame(np.asarray(g.correct, dtype=bool), "|b1"),
        _as_frame(np.asarray(g.truncated, dtype=bool), "|b1"),
    ]


def _array(view: memoryview, name: str, n: int) -> np.ndarray:
    dtype = np.dtype(DTYPES[name])
    if view.nbytes != n * dtype.itemsize:
        raise MessageError("length_mismatch", f"{name}: {view.nbytes} bytes, expected {n} x {dtype.itemsize}")
    if dtype == np.bool_:
        raw = np.frombuffer(view, dtype=np.uint8, count=n)
        if raw.size and int(raw.max()) > 1:
            raise MessageError("bool_value", f"{name} holds bytes other than 0/1")
    return np.frombuffer(view, dtype=dtype, count=n)


def _check_values(arrays: dict[str, np.ndarray], limits: MessageLimits, vocab_size: int | None,
                  max_version: int | None) -> None:
    for name in ("prompt_ids", "response_ids"):
        a = arrays[name]
        if a.size and (int(a.min()) < 0 or (vocab_size is not None and int(a.max()) >= vocab_size)):
            raise MessageError("token_range", f"{name} outside [0, {vocab_size}): [{a.min()}, {a.max()}]")
    lp = arrays["logprobs"]
    if not np.isfinite(lp).all():
        raise MessageError("logprob_nonfinite", f"{int((~np.isfinite(lp)).sum())} non-finite log-probs")
    if lp.size and float(lp.max()) > limits.logprob_tolerance:
        raise MessageError("logprob_positive", f"max log-prob {float(lp.max())} > 0")
    v = arrays["versions"]
    if v.size and int(v.min()) < 0:
        raise MessageError("version_negative", f"min version {int(v.min())}")
    if v.size and max_version is not None and int(v.max()) > max_version:
        raise MessageError("version_future", f"version {int(v.max())} > current {max_version}")
    if v.size > 1:
        steps = np.diff(v.astype(np.int64))
        steps[arrays["boundaries"]] = 0  # a new response may start at any version
        if int(steps.min()) < 0:
            raise MessageError("version_order", "versions decrease within a response")
    if not np.isfinite(arrays["rewards"]).all():
        raise MessageError("reward_nonfinite", "non-finite reward")


def decode_group(frames: Sequence[Frame], limits: MessageLimits, *, vocab_size: int | None = None,
                 max_version: int | None = None) -> RolloutGroup:
    """Validate and decode a ``group`` message (zero-copy views). Raises ``MessageError``.

    ``vocab_size`` bounds token ids (V); ``max_version`` is the receiver's current policy version
    (no token may claim a newer one)."""
    if len(frames) != N_FRAMES:
        raise MessageError("frame_count", f"group has {len(frames)} frames, expected {N_FRAMES}")
    views = check_frame_sizes(frames, limits)
    h = decode_header(views[0], limits)
    if h["kind"] != "group":
        raise MessageError("kind", f"expected group, got {h['kind'][:40]!r}")
    if get_map(h, "dtypes") != DTYPES:
        raise MessageError("dtype", f"dtypes {str(h['dtypes'])[:200]} != {DTYPES}")
    G = get_int(h, "group_size", 1, limits.max_group_size)
    P = get_int(h, "prompt_len", 1, limits.max_prompt_tokens)
    lengths = get_int_list(h, "lengths", limits.max_group_size, 0, limits.max_response_tokens)
    if len(lengths) != G:
        raise MessageError("length_mismatch", f"{len(lengths)} lengths for group_size {G}")
    reasons = get_list(h, "finish_reasons", G)
    if reasons and (len(reasons) != G or not all(isinstance(r, str) and len(r) <= limits.max_id_chars for r in reasons)):
        raise MessageError("field", "finish_reasons must be G short strings or empty")
    total = sum(lengths)
    arrays = {
        name: _array(view, name, n)
        for (name, _), view, n in zip(ARRAYS, views[1:], (P, total, total, total, G, G, G), strict=True)
    }
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    splits = np.asarray(starts[1:-1], dtype=np.int64)
    arrays["boundaries"] = splits[(splits > 0) & (splits < total)] - 1
    _check_values(arrays, limits, vocab_size, max_version)

    def split(a: np.ndarray) -> list[np.ndarray]:  # views, like np.split but without its overhead
        return [a[starts[i]:starts[i + 1]] for i in range(G)]

    return RolloutGroup(
        lease_id=get_int(h, "lease_id"),
        prompt_index=get_int(h, "prompt_index"),
        generator_id=get_str(h, "generator_id", limits.max_id_chars),
        prompt_ids=arrays["prompt_ids"],
        response_ids=split(arrays["response_ids"]),
        logprobs=split(arrays["logprobs"]),
        versions=split(arrays["versions"]),
        rewards=arrays["rewards"],
        correct=arrays["correct"],
        truncated=arrays["truncated"],
        finish_reasons=list(reasons),
        gen_time_s=get_float(h, "gen_time_s", 0.0, 1e9),
        received_at=time.monotonic(),
    )
