"""``RolloutBatch``: N prompts and their S sampled responses, the one type from vLLM to the loss.

Notation: N groups (= prompts), G_k responses of group k, S = sum_k G_k responses, P_k prompt
length of group k, L_i length of response i.

Storage is ragged and flat. Every field of ``FIELDS`` is one numpy array whose first dimension
runs over its level: prompt tokens (sum_k P_k), response tokens (sum_i L_i), responses (S) or
groups (N), in group order and, within a group, response order. ``prompt_lens`` (N,),
``group_sizes`` (N,) and ``response_lens`` (S,) cut them. A group is a batch with N = 1: the
generator makes one per prompt (``from_group``), the wire carries one per message
(``transport.rollout``), the controller queues them and the learner concatenates them (``concat``),
filters whole groups (``take_groups``) and hands responses to ranks and micro-batches
(``select_responses``, ``flat`` / ``from_flat`` for the scatter).

Adding a per-token field is one line in ``FIELDS``, a producer that fills it (the generator's
``make_group``, or the learner for a learner-side field) and a consumer: encoding, decoding,
concatenation, selection and the learner's scatter all read the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np

from vapo_async.transport.wire import MAX_GROUP_SIZE, Id, Index, ShortStr

PROMPT, TOKEN, RESPONSE, GROUP = "prompt_token", "token", "response", "group"
"""The levels a field can live on (what its first dimension counts)."""


@dataclass(frozen=True)
class Field:
    """One array of a ``RolloutBatch``."""

    name: str
    dtype: str
    """Exact numpy dtype string (little-endian on the wire)."""
    level: str
    """PROMPT (sum_k P_k,), TOKEN (sum_i L_i,), RESPONSE (S,) or GROUP (N,)."""
    wire: bool
    """Sent by the generator (one frame each, in table order); else filled with ``fill`` on receipt."""
    doc: str
    fill: float = 0


FIELDS: tuple[Field, ...] = (
    Field("prompt_ids", "<i4", PROMPT, True, "prompt token ids"),
    Field("response_ids", "<i4", TOKEN, True, "sampled token ids, in [0, V)"),
    Field("logprobs", "<f4", TOKEN, True, "behaviour-policy log-prob of each sampled token (finite, <= 0)"),
    Field("versions", "<i4", TOKEN, True, "policy version that sampled each token (>= 0, non-decreasing "
          "within a response: weights only move forward)"),
    Field("rewards", "<f4", RESPONSE, True, "verifier reward R_i (the learner adds DAPO's length shaping)"),
    Field("correct", "|b1", RESPONSE, True, "the answer was right (positive examples of VAPO eq. 9)"),
    Field("truncated", "|b1", RESPONSE, True, "the response hit the max-token limit"),
    Field("seq_adv", "<f4", RESPONSE, False, "learner: sequence-level (GRPO/DAPO group) advantage, 0 unused"),
    Field("admission", "<i8", GROUP, False, "controller: admission slot k of the group (-1 before receipt)", fill=-1),
)
"""Every array of a batch, declared once (everything below and in ``rollout.py`` reads it at call time)."""


def field_named(name: str) -> Field:
    """The ``FIELDS`` entry ``name``."""
    for f in FIELDS:
        if f.name == name:
            return f
    raise KeyError(f"no rollout field {name!r}")


def wire_fields() -> tuple[Field, ...]:
    """The fields a generator sends, in frame order."""
    return tuple(f for f in FIELDS if f.wire)


class GroupInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Who sampled a group and for which lease; travels in the ``group`` message header."""

    lease_id: Index
    prompt_index: Index
    """Dataset index of the prompt."""
    generator_id: Id
    gen_time_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] = 0.0
    """Wall time the generator spent on the group."""
    finish_reasons: Annotated[tuple[ShortStr, ...], msgspec.Meta(max_length=MAX_GROUP_SIZE)] = ()
    """G strings from the engine ("stop", "length", ...) or empty."""


def _offsets(lens: np.ndarray) -> np.ndarray:
    """(n + 1,) exclusive prefix sums of ``lens`` (n,)."""
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def gather_ranges(flat: np.ndarray, off: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Concatenate the ranges [off[i], off[i + 1]) of ``flat`` for i in ``idx`` (vectorised)."""
    lens = off[1:][idx] - off[:-1][idx]
    total = int(lens.sum())
    if total == 0:
        return flat[:0].copy()
    # position of every output element = start of its range + its place within the range
    shift = off[:-1][idx] - _offsets(lens)[:-1]
    return flat[np.repeat(shift, lens) + np.arange(total)]


@dataclass
class RolloutBatch:
    """N groups of responses, flat (see the module docstring). Fields of ``FIELDS`` read as
    attributes (``batch.logprobs``); arrays decoded from the wire are read-only views."""

    prompt_lens: np.ndarray
    """(N,) int64 P_k."""
    group_sizes: np.ndarray
    """(N,) int64 G_k."""
    response_lens: np.ndarray
    """(S,) int64 L_i."""
    data: dict[str, np.ndarray]
    """Every ``FIELDS`` array by name."""
    info: list[GroupInfo] = field(default_factory=list)
    """(N,) per-group metadata; empty on learner ranks that received arrays only."""

    def __post_init__(self) -> None:
        if int(self.group_sizes.sum()) != len(self.response_lens) or len(self.group_sizes) != len(self.prompt_lens):
            raise ValueError(f"group sizes {self.group_sizes.tolist()[:8]} do not cut {len(self.response_lens)} "
                             f"responses of {len(self.prompt_lens)} prompts")
        for f in FIELDS:
            a = self.data.get(f.name)
            if a is None or a.shape != (self.count(f.level),) or a.dtype != np.dtype(f.dtype):
                got = None if a is None else (a.shape, a.dtype.str)
                raise ValueError(f"{f.name}: expected ({self.count(f.level)},) {f.dtype}, got {got}")
        if self.info and len(self.info) != self.n_groups:
            raise ValueError(f"{len(self.info)} GroupInfo for {self.n_groups} groups")

    def __getattr__(self, name: str) -> np.ndarray:
        data = self.__dict__.get("data")
        if data is not None and name in data:
            return data[name]
        raise AttributeError(f"RolloutBatch has no attribute {name!r}")

    # ---- shape ----

    @property
    def n_groups(self) -> int:
        """N."""
        return len(self.prompt_lens)

    @property
    def n_responses(self) -> int:
        """S."""
        return len(self.response_lens)

    def count(self, level: str) -> int:
        """Length of a field on ``level``."""
        return {PROMPT: int(self.prompt_lens.sum()), TOKEN: int(self.response_lens.sum()),
                RESPONSE: self.n_responses, GROUP: self.n_groups}[level]

    @property
    def group_of_response(self) -> np.ndarray:
        """(S,) int64 group k of every response."""
        return np.repeat(np.arange(self.n_groups, dtype=np.int64), self.group_sizes)

    @property
    def seq_lens(self) -> np.ndarray:
        """(S,) P_k(i) + L_i: prompt plus response tokens of each response's sequence."""
        return self.prompt_lens[self.group_of_response] + self.response_lens

    def split(self, name: str) -> list[np.ndarray]:
        """Field ``name`` cut into views: per response for TOKEN fields, per group otherwise."""
        level = field_named(name).level
        lens = {TOKEN: self.response_lens, PROMPT: self.prompt_lens, RESPONSE: self.group_sizes}.get(
            level, np.ones(self.n_groups, dtype=np.int64))
        off, a = _offsets(lens), self.data[name]
        return [a[off[i]:off[i + 1]] for i in range(len(lens))]

    def response(self, name: str, i: int) -> np.ndarray:
        """TOKEN field ``name`` of response i (a view)."""
        off = _offsets(self.response_lens)
        return self.data[name][off[i]:off[i + 1]]

    def oldest_version(self) -> int:
        """Smallest policy version of any response token (-1 when there is none)."""
        v = self.data["versions"]
        return int(v.min()) if v.size else -1

    def nbytes(self) -> int:
        """Payload bytes of the wire fields (the array frames of its group messages)."""
        return int(sum(self.data[f.name].nbytes for f in wire_fields()))

    # ---- one group (a received message) ----

    def _one(self) -> GroupInfo:
        if self.n_groups != 1 or not self.info:
            raise ValueError(f"a single group with its GroupInfo was expected, got {self.n_groups} groups")
        return self.info[0]

    @property
    def lease_id(self) -> int:
        """Lease of a single group."""
        return self._one().lease_id

    @property
    def prompt_index(self) -> int:
        """Dataset index of a single group's prompt."""
        return self._one().prompt_index

    @property
    def generator_id(self) -> str:
        """Sampler of a single group."""
        return self._one().generator_id

    @property
    def admission_index(self) -> int:
        """Admission slot of a single group (set by the controller on receipt)."""
        self._one()
        return int(self.data["admission"][0])

    @admission_index.setter
    def admission_index(self, k: int) -> None:
        self._one()
        self.data["admission"] = np.array([k], dtype=np.int64)

    @property
    def group_size(self) -> int:
        """G of a single group."""
        self._one()
        return int(self.group_sizes[0])

    # ---- construction ----

    @staticmethod
    def from_group(info: GroupInfo, **values: Any) -> RolloutBatch:
        """One group: PROMPT fields as one array, TOKEN fields as G arrays (one per response),
        RESPONSE fields as (G,) arrays, GROUP fields as scalars; fields left out take ``fill``."""
        G = len(values["response_ids"])
        lens = np.array([len(r) for r in values["response_ids"]], dtype=np.int64)
        data = {}
        for f in FIELDS:
            v = values.get(f.name)
            if v is None:
                n = {PROMPT: len(values["prompt_ids"]), TOKEN: int(lens.sum()), RESPONSE: G, GROUP: 1}[f.level]
                data[f.name] = np.full(n, f.fill, dtype=f.dtype)
            elif f.level == TOKEN:
                if [len(p) for p in v] != lens.tolist():
                    raise ValueError(f"{f.name} lengths differ from response lengths {lens.tolist()}")
                data[f.name] = np.concatenate([np.asarray(p).reshape(-1) for p in v] or [np.zeros(0)]).astype(f.dtype)
            else:
                data[f.name] = np.asarray(v).reshape(-1).astype(f.dtype)
        return RolloutBatch(np.array([len(values["prompt_ids"])], dtype=np.int64), np.array([G], dtype=np.int64),
                            lens, data, [info])

    @staticmethod
    def concat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """The groups of ``batches`` in order, as one batch."""
        def cat(parts: list[np.ndarray], dtype: str) -> np.ndarray:
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        infos = [i for b in batches for i in b.info]
        return RolloutBatch(
            cat([b.prompt_lens for b in batches], "<i8"), cat([b.group_sizes for b in batches], "<i8"),
            cat([b.response_lens for b in batches], "<i8"),
            {f.name: cat([b.data[f.name] for b in batches], f.dtype) for f in FIELDS},
            infos if all(b.info or not b.n_groups for b in batches) else [])

    def _take(self, groups: np.ndarray, responses: np.ndarray, sizes: np.ndarray, with_info: bool) -> RolloutBatch:
        """Responses ``responses`` as groups ``groups`` (their source groups) of ``sizes``."""
        index = {PROMPT: (_offsets(self.prompt_lens), groups), TOKEN: (_offsets(self.response_lens), responses)}
        data = {}
        for f in FIELDS:
            a = self.data[f.name]
            data[f.name] = gather_ranges(a, *index[f.level]) if f.level in index else \
                a[groups if f.level == GROUP else responses]
        info = []
        if self.info and with_info:
            first, starts = _offsets(self.group_sizes), _offsets(sizes)
            for k, g in enumerate(groups.tolist()):
                reasons = self.info[g].finish_reasons
                local = responses[starts[k]:starts[k + 1]] - first[g]
                info.append(msgspec.structs.replace(
                    self.info[g], finish_reasons=tuple(reasons[j] for j in local) if reasons else ()))
        return RolloutBatch(self.prompt_lens[groups], sizes, self.response_lens[responses], data, info)

    def take_groups(self, idx: Sequence[int] | np.ndarray) -> RolloutBatch:
        """Whole groups ``idx`` (in that order)."""
        g = np.asarray(idx, dtype=np.int64).reshape(-1)
        return self._take(g, gather_ranges(np.arange(self.n_responses), _offsets(self.group_sizes), g),
                          self.group_sizes[g], with_info=True)

    def groups(self) -> list[RolloutBatch]:
        """Every group as a batch of one."""
        return [self.take_groups([k]) for k in range(self.n_groups)]

    def select_responses(self, idx: Sequence[int] | np.ndarray, with_info: bool = False) -> RolloutBatch:
        """Responses ``idx`` (in that order), each as a group of one with its prompt; ``info``
        only ``with_info`` (rank shares and micro-batches need the arrays alone)."""
        r = np.asarray(idx, dtype=np.int64).reshape(-1)
        return self._take(self.group_of_response[r], r, np.ones(len(r), dtype=np.int64), with_info)

    def replace(self, **arrays: np.ndarray) -> RolloutBatch:
        """A batch sharing everything but the given fields."""
        return RolloutBatch(self.prompt_lens, self.group_sizes, self.response_lens,
                            {**self.data, **{k: np.asarray(v, dtype=field_named(k).dtype) for k, v in arrays.items()}},
                            self.info)

    # ---- flat arrays (the learner's scatter): lengths, then FIELDS in table order ----

    @staticmethod
    def flat_dtypes() -> list[str]:
        """dtype of each array of ``flat``."""
        return ["<i8", "<i8", "<i8", *(f.dtype for f in FIELDS)]

    def flat(self) -> list[np.ndarray]:
        """The arrays that rebuild the batch (without ``info``)."""
        return [self.prompt_lens, self.group_sizes, self.response_lens, *(self.data[f.name] for f in FIELDS)]

    @staticmethod
    def from_flat(arrays: Sequence[np.ndarray]) -> RolloutBatch:
        """Inverse of ``flat`` (``info`` empty)."""
        return RolloutBatch(arrays[0], arrays[1], arrays[2], {f.name: a for f, a in zip(FIELDS, arrays[3:], strict=True)})

    @staticmethod
    def empty() -> RolloutBatch:
        """No groups."""
        return RolloutBatch.concat([])


def batches_equal(a: RolloutBatch, b: RolloutBatch) -> bool:
    """Bit-equal arrays (dtype included) and equal ``info``."""
    return a.info == b.info and all(x.dtype == y.dtype and x.tobytes() == y.tobytes()
                                    for x, y in zip(a.flat(), b.flat(), strict=True))
