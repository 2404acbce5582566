"""Malformed-message generator for wire fuzzing (tests, the soak benchmark, reliability checks).

``malformed_messages(rng, n, limits, vocab_size, version)`` yields ``(frames, family)`` pairs. Every
message is invalid by construction (each family breaks one rule the validator enforces), so a
controller that receives n of them from a session must count exactly n rejections.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgpack
import numpy as np

from vapo_async.transport.messages import encode_group
from vapo_async.transport.synthetic import random_group
from vapo_async.transport.wire import SCHEMA, MessageLimits

Frames = list[bytes]


def _valid(rng: np.random.Generator, vocab_size: int, version: int, generator_id: str) -> Frames:
    g = random_group(rng, lease_id=int(rng.integers(0, 2**40)), prompt_index=int(rng.integers(0, 1000)),
                     generator_id=generator_id, group_size=int(rng.integers(1, 9)), lengths=(2, 64),
                     vocab_size=vocab_size, version=version)
    return [bytes(f) for f in encode_group(g)]


def _set_header(frames: Frames, **changes: object) -> Frames:
    h = msgpack.unpackb(frames[0], raw=False)
    h.update(changes)
    return [msgpack.packb(h), *frames[1:]]


def _poke(frames: Frames, index: int, dtype: str, value: float, rng: np.random.Generator) -> Frames:
    a = np.frombuffer(frames[index], dtype).copy()
    a[int(rng.integers(0, a.size))] = value
    return [*frames[:index], a.tobytes(), *frames[index + 1:]]


def _families(limits: MessageLimits, vocab: int, version: int) -> dict[str, Callable[[np.random.Generator, Frames], Frames]]:
    return {
        "random_bytes": lambda r, f: [r.bytes(int(r.integers(0, 200))) for _ in range(int(r.integers(1, 10)))],
        "truncated_frame": lambda r, f: [*f[:3], f[3][: len(f[3]) - 4 * int(r.integers(1, 3))], *f[4:]],
        "frame_count": lambda r, f: f[: int(r.integers(2, 8))] if r.random() < 0.5 else [*f, b"\x00"],
        "dtype": lambda r, f: _set_header(f, dtypes={**msgpack.unpackb(f[0])["dtypes"], "response_ids": "<i8"}),
        "nan_logprob": lambda r, f: _poke(f, 3, "<f4", float(r.choice([np.nan, np.inf, -np.inf])), r),
        "positive_logprob": lambda r, f: _poke(f, 3, "<f4", float(r.uniform(0.01, 5.0)), r),
        "token_out_of_vocab": lambda r, f: _poke(f, 2, "<i4", int(r.integers(vocab, 2**31 - 1)), r),
        "future_version": lambda r, f: _poke(f, 4, "<i4", version + int(r.integers(1, 1000)), r),
        "oversized_frame": lambda r, f: [*f[:2], b"\x00" * (limits.max_frame_bytes + 4), *f[3:]],
        "schema": lambda r, f: _set_header(f, schema=SCHEMA + int(r.integers(1, 100))),
        "unknown_kind": lambda r, f: _set_header(f, kind=r.bytes(6).hex()),
        "field_type": lambda r, f: _set_header(f, prompt_len=str(r.integers(0, 9)), lengths=-1),
        "unknown_lease": lambda r, f: f,  # structurally valid, but no such lease was granted
    }


FAMILIES = tuple(_families(MessageLimits(), 2, 0))
"""Names of the malformed-message families, in generation order."""


def malformed_messages(rng: np.random.Generator, n: int, limits: MessageLimits, vocab_size: int, version: int,
                       generator_id: str = "fuzzer") -> Iterator[tuple[Frames, str]]:
    """``n`` invalid messages cycling through ``FAMILIES``; each mutates a fresh valid group."""
    families = _families(limits, vocab_size, version)
    names = list(families)
    for i in range(n):
        name = names[i % len(names)]
        yield families[name](rng, _valid(rng, vocab_size, version, generator_id)), name
