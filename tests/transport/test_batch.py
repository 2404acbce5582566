"""RolloutBatch: the FIELDS table drives construction, the wire codec, concatenation, selection and
the learner's flat arrays; hand-made values with the expected layout written out."""

from __future__ import annotations

import numpy as np
import pytest

from vapo_async.transport import batch as table
from vapo_async.transport.batch import TOKEN, Field, GroupInfo, RolloutBatch, batches_equal
from vapo_async.transport.messages import MessageLimits, decode_from_generator
from vapo_async.transport.rollout import decode_group, encode_group

LIMITS = MessageLimits()


def _g0(**extra: object) -> RolloutBatch:
    # prompt [5, 6, 7]; three responses of lengths 2, 1, 0 (an empty response is legal)
    return RolloutBatch.from_group(
        GroupInfo(lease_id=3, prompt_index=10, generator_id="g", gen_time_s=0.5, finish_reasons=("stop", "length", "stop")),
        prompt_ids=[5, 6, 7], response_ids=[[1, 2], [3], []], logprobs=[[-0.5, -0.25], [-1.0], []],
        versions=[[2, 2], [1], []], rewards=[1.0, -1.0, 1.0], correct=[True, False, True],
        truncated=[False, True, False], **extra)


def _g1(**extra: object) -> RolloutBatch:
    # prompt [8]; one response of length 3
    return RolloutBatch.from_group(
        GroupInfo(lease_id=4, prompt_index=11, generator_id="h"), prompt_ids=[8], response_ids=[[9, 9, 4]],
        logprobs=[[-0.125, -2.0, -3.0]], versions=[[0, 1, 1]], rewards=[0.5], correct=[True], truncated=[False],
        **extra)


def test_a_group_is_flat_with_offsets() -> None:
    g = _g0()
    assert (g.n_groups, g.n_responses) == (1, 3)
    assert g.response_lens.tolist() == [2, 1, 0] and g.prompt_lens.tolist() == [3]
    assert g.response_ids.tolist() == [1, 2, 3] and g.response_ids.dtype == np.dtype("<i4")
    assert g.logprobs.tolist() == [-0.5, -0.25, -1.0]
    assert [r.tolist() for r in g.split("versions")] == [[2, 2], [1], []]
    assert g.seq_lens.tolist() == [5, 4, 3]  # P + L_i
    # fields a generator does not fill take their table fill value
    assert g.seq_adv.tolist() == [0.0, 0.0, 0.0] and g.admission.tolist() == [-1]
    assert g.oldest_version() == 1 and (g.lease_id, g.prompt_index, g.group_size) == (3, 10, 3)


def test_wire_round_trip_is_bit_exact() -> None:
    g = _g0()
    frames = encode_group(g)
    assert len(frames) == 1 + len(table.wire_fields())  # a header and one frame per wire field
    assert bytes(frames[2]) == np.array([1, 2, 3], "<i4").tobytes()  # response_ids, in table order
    out = decode_from_generator([bytes(f) for f in frames], LIMITS, vocab_size=16, max_version=2)
    assert isinstance(out, RolloutBatch) and batches_equal(out, g)


def test_concat_then_split_gives_the_groups_back() -> None:
    a, b = _g0(), _g1()
    ab = RolloutBatch.concat([a, b])
    assert ab.prompt_ids.tolist() == [5, 6, 7, 8] and ab.group_sizes.tolist() == [3, 1]
    assert ab.response_ids.tolist() == [1, 2, 3, 9, 9, 4] and ab.group_of_response.tolist() == [0, 0, 0, 1]
    left, right = ab.groups()
    assert batches_equal(left, a) and batches_equal(right, b)
    assert batches_equal(ab.take_groups([1, 0]), RolloutBatch.concat([b, a]))
    flat = RolloutBatch.from_flat(ab.flat())
    assert all(x.tobytes() == y.tobytes() for x, y in zip(flat.flat(), ab.flat(), strict=True))


def test_select_responses_makes_groups_of_one_with_their_prompt() -> None:
    ab = RolloutBatch.concat([_g0(), _g1()])
    part = ab.select_responses([3, 0, 2], with_info=True)
    # response 3 = group 1's only one; 0 and 2 = group 0's first and (empty) last
    assert part.group_sizes.tolist() == [1, 1, 1] and part.prompt_lens.tolist() == [1, 3, 3]
    assert part.prompt_ids.tolist() == [8, 5, 6, 7, 5, 6, 7]
    assert part.response_ids.tolist() == [9, 9, 4, 1, 2] and part.response_lens.tolist() == [3, 2, 0]
    assert part.rewards.tolist() == [0.5, 1.0, 1.0]
    assert [i.finish_reasons for i in part.info] == [(), ("stop",), ("stop",)]
    assert [i.lease_id for i in part.info] == [4, 3, 3]


def test_one_table_line_adds_a_field_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new per-token field (here a sampled-token entropy) needs its table line, a producer
    (``from_group``'s argument) and a consumer: wire, concat, selection and flat arrays follow."""
    monkeypatch.setattr(table, "FIELDS", (*table.FIELDS, Field("entropy", "<f4", TOKEN, True, "test field")))
    a = _g0(entropy=[[0.5, 0.25], [0.125], []])
    b = _g1(entropy=[[1.0, 2.0, 4.0]])
    frames = encode_group(a)
    assert len(frames) == 9 and bytes(frames[-1]) == np.array([0.5, 0.25, 0.125], "<f4").tobytes()
    back = decode_group([bytes(f) for f in frames], LIMITS, vocab_size=16, max_version=2)
    assert back.entropy.tolist() == [0.5, 0.25, 0.125] and batches_equal(back, a)
    ab = RolloutBatch.concat([back, b])
    assert ab.entropy.tolist() == [0.5, 0.25, 0.125, 1.0, 2.0, 4.0]
    assert ab.select_responses([3, 1]).entropy.tolist() == [1.0, 2.0, 4.0, 0.125]
    assert RolloutBatch.from_flat(ab.flat()).entropy.tolist() == ab.entropy.tolist()
    assert RolloutBatch.flat_dtypes()[-1] == "<f4"
    # a producer that omits it gets the fill value, and the wire declares its dtype
    assert _g1().entropy.tolist() == [0.0, 0.0, 0.0]


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="logprobs lengths differ"):
        RolloutBatch.from_group(GroupInfo(lease_id=0, prompt_index=0, generator_id="g"), prompt_ids=[1],
                                response_ids=[[1, 2]], logprobs=[[-1.0]], versions=[[0, 0]], rewards=[0.0],
                                correct=[False], truncated=[False])
    with pytest.raises(ValueError, match="rewards: expected"):
        _g0().replace(rewards=np.zeros(2))
