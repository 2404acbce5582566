"""Wire format: bit-exact round trips (in memory and over a real socket) and every rejection."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from vapo_async.transport.batch import batches_equal
from vapo_async.transport.messages import (
    Ack,
    Bye,
    Chunk,
    ErrorReply,
    Fetch,
    Heartbeat,
    Hello,
    Lease,
    LeasePrompt,
    MessageError,
    MessageLimits,
    Request,
    RolloutBatch,
    WeightAnnouncement,
    Welcome,
    decode_announcement,
    decode_from_controller,
    decode_from_generator,
    decode_group,
    encode_group,
)
from vapo_async.transport.synthetic import random_group
from vapo_async.transport.wire import MAX_GROUP_SIZE, MAX_RESPONSE_TOKENS

V = 1000
LIMITS = MessageLimits()


def _group(seed: int = 0, G: int = 4, lengths: tuple[int, int] = (0, 50), version: int = 3) -> RolloutBatch:
    g = random_group(np.random.default_rng(seed), lease_id=7, prompt_index=11, generator_id="gen-a",
                     group_size=G, lengths=lengths, vocab_size=V, version=version)
    g.info[0] = msgspec.structs.replace(g.info[0], gen_time_s=1.25)
    return g


def _assert_bit_equal(a: RolloutBatch, b: RolloutBatch) -> None:
    assert a.info == b.info and a.info[0].gen_time_s == 1.25
    assert batches_equal(a, b)


@pytest.mark.parametrize("seed,G", [(0, 1), (1, 8), (2, 16)])
def test_group_round_trip_bit_exact_in_memory(seed: int, G: int) -> None:
    g = _group(seed, G)
    lp0 = g.response("logprobs", 0)
    lp0[:3] = np.array([-0.0, -1e-38, -3.4e38], np.float32)[: len(lp0[:3])]  # edge floats
    _assert_bit_equal(g, decode_group(encode_group(g), LIMITS, vocab_size=V, max_version=3))


def test_group_round_trip_over_ipc_socket_is_bit_exact_and_zero_copy(tmp_path) -> None:
    with zmq.Context() as ctx:  # destroyed (sockets closed) on exit, also after a failed assert
        rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        rx.bind(f"ipc://{tmp_path}/s")
        tx.connect(f"ipc://{tmp_path}/s")
        g = _group(3, G=16, lengths=(1500, 2000))  # ~200 KB of arrays: frames travel zero-copy
        tx.send_multipart(encode_group(g), copy=False)
        frames = rx.recv_multipart(copy=False)
        out = decode_group(frames, LIMITS, vocab_size=V, max_version=3)
        _assert_bit_equal(g, out)
        # the decoded arrays are views onto the received frames, not copies
        assert np.shares_memory(out.response_ids, np.frombuffer(frames[2].buffer, np.uint8))


def _frames(g: RolloutBatch | None = None) -> list:
    return [bytes(f) for f in encode_group(g or _group())]


def _header(frames: list) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def _with_header(frames: list, **changes: object) -> list:
    h = _header(frames)
    h.update(changes)
    return [msgpack.packb(h), *frames[1:]]


def _with_array(frames: list, index: int, values: np.ndarray) -> list:
    out = list(frames)
    out[index] = values.tobytes()
    return out


def _malformed() -> list[tuple[str, list, str]]:
    """(case, frames, expected reason) for every way a group can be wrong."""
    f = _frames()
    h = _header(f)
    total = sum(h["lengths"])
    ids = np.frombuffer(f[2], np.int32).copy()
    lp = np.frombuffer(f[3], np.float32).copy()
    ver = np.frombuffer(f[4], np.int32).copy()
    cases = [
        ("no frames", [], "frame_count"),
        ("missing frame", f[:-1], "frame_count"),
        ("extra frame", [*f, b"x"], "frame_count"),
        ("random header bytes", [b"\xc1\xff\x00", *f[1:]], "header_decode"),
        ("truncated header", [f[0][:-3], *f[1:]], "header_decode"),
        ("header is a list", [msgpack.packb([1, 2]), *f[1:]], "header_type"),
        ("wrong schema", _with_header(f, schema=2), "schema"),
        ("bool schema", _with_header(f, schema=True), "schema"),
        ("unknown kind", _with_header(f, kind="grup"), "kind"),
        ("int64 token ids", _with_header(f, dtypes={**h["dtypes"], "response_ids": "<i8"}), "dtype"),
        ("big-endian logprobs", _with_header(f, dtypes={**h["dtypes"], "logprobs": ">f4"}), "dtype"),
        ("truncated logprob frame", [*f[:3], f[3][:-4], *f[4:]], "length_mismatch"),
        ("lengths disagree", _with_header(f, lengths=[*h["lengths"][:-1], h["lengths"][-1] + 1]), "length_mismatch"),
        ("lengths count != G", _with_header(f, lengths=h["lengths"][:-1], info={**h["info"], "finish_reasons": []}),
         "length_mismatch"),
        ("no responses", _with_header(f, lengths=[]), "field_range"),
        ("wrong rewards shape", [*f[:5], f[5][:-4], *f[6:]], "length_mismatch"),
        ("token id == V", _with_array(f, 2, np.where(np.arange(total) == 0, V, ids).astype(np.int32)), "token_range"),
        ("negative token id", _with_array(f, 1, np.full(32, -1, np.int32)), "token_range"),
        ("NaN logprob", _with_array(f, 3, np.where(np.arange(total) == 1, np.nan, lp).astype(np.float32)), "logprob_nonfinite"),
        ("-inf logprob", _with_array(f, 3, np.where(np.arange(total) == 1, -np.inf, lp).astype(np.float32)), "logprob_nonfinite"),
        ("positive logprob", _with_array(f, 3, np.where(np.arange(total) == 2, 0.01, lp).astype(np.float32)), "logprob_positive"),
        ("future version", _with_array(f, 4, (ver + 1).astype(np.int32)), "version_future"),
        ("negative version", _with_array(f, 4, np.full(total, -1, np.int32)), "version_negative"),
        ("version goes back", _with_array(f, 4, np.where(np.arange(total) == 1, 2, 3).astype(np.int32)), "version_order"),
        ("NaN reward", _with_array(f, 5, np.array([np.nan, 1, 1, 1], np.float32)), "reward_nonfinite"),
        ("bool byte 2", _with_array(f, 6, np.array([2, 0, 1, 0], np.uint8)), "bool_value"),
        ("G too large", _with_header(f, lengths=[0] * (MAX_GROUP_SIZE + 1)), "field_range"),
        ("response too long", _with_header(f, lengths=[MAX_RESPONSE_TOKENS + 1] * 4), "field_range"),
        ("string lease id", _with_header(f, info={**h["info"], "lease_id": "7"}), "field"),
        ("negative lease id", _with_header(f, info={**h["info"], "lease_id": -7}), "field_range"),
        ("missing generator id", _with_header(f, info={**h["info"], "generator_id": None}), "field"),
        ("NaN gen time", _with_header(f, info={**h["info"], "gen_time_s": float("nan")}), "field_range"),
        ("finish reasons wrong count", _with_header(f, info={**h["info"], "finish_reasons": ["stop"]}), "field"),
        ("ext type in header", _with_header(f, info={**h["info"], "lease_id": msgpack.ExtType(1, b"x")}), "field"),
        ("group without info", _with_header(f, info=None), "field"),
    ]
    assert int(ver.max()) == 3 and total > 3  # preconditions of the cases above
    return cases


@pytest.mark.parametrize("case,frames,reason", _malformed(), ids=[c[0] for c in _malformed()])
def test_every_malformed_group_is_rejected_with_its_reason(case: str, frames: list, reason: str) -> None:
    with pytest.raises(MessageError) as e:
        decode_from_generator(frames, LIMITS, vocab_size=V, max_version=3)
    assert e.value.reason == reason, (case, str(e.value))


def test_size_limits() -> None:
    small = MessageLimits(max_frame_bytes=4096, max_header_bytes=256)
    big = _frames(_group(lengths=(2000, 2000)))  # 8 KB token frame
    with pytest.raises(MessageError, match="frame_too_large"):
        decode_group(big, small, vocab_size=V)
    long_header = _with_header(_frames(), padding="x" * 300)
    with pytest.raises(MessageError, match="header_too_large"):
        decode_group(long_header, small, vocab_size=V)


def test_logprob_tolerance_is_tiny_and_not_clamped() -> None:
    g = _group()
    g.response("logprobs", 1)[0] = 5e-7  # float round-off of log(1): accepted as is
    out = decode_group(encode_group(g), LIMITS, vocab_size=V, max_version=3)
    assert out.response("logprobs", 1)[0] == np.float32(5e-7)
    g.response("logprobs", 1)[0] = 2e-6
    with pytest.raises(MessageError, match="logprob_positive"):
        decode_group(encode_group(g), LIMITS, vocab_size=V, max_version=3)


ANN = WeightAnnouncement(4, "/run/weights/v00000004", "ab" * 32, 1234, ("config.json", "model.safetensors"))
CONTROL = [
    (Hello("gen-0", "s1", 8, 2), "g"), (Request(5), "g"), (Heartbeat(), "g"), (Bye((3, 4)), "g"),
    (Fetch(4, "model.safetensors", 4096, 1 << 20), "g"),
    (Welcome("c1", "s1", 4, ANN, "/run/weights", "tcp://127.0.0.1:5556", 320, 60.0, 15.0, {"n": 8, "temperature": 1.0}), "c"),
    (Welcome("c1", "s1", 0, None, "", "ipc:///tmp/x-pub", 320, 60.0, 15.0, {}), "c"),
    (Lease(9, 4, 60.0, (LeasePrompt(3, "What is 2+2?", "4"), LeasePrompt(5, "", "")), ANN), "c"),
    (Ack(9, 3, "duplicate"), "c"), (ErrorReply("unknown_session", "say hello"), "c"),
]


@pytest.mark.parametrize("msg,side", CONTROL, ids=[type(m).__name__ for m, _ in CONTROL])
def test_control_messages_round_trip(msg: object, side: str) -> None:
    frames = msg.to_frames()  # type: ignore[attr-defined]
    out = (decode_from_generator(frames, LIMITS, vocab_size=V, max_version=0) if side == "g"
           else decode_from_controller(frames, LIMITS))
    assert out == msg


def test_chunk_and_announcement_round_trip() -> None:
    c = decode_from_controller(Chunk(4, "model.safetensors", 8, 100, b"abc").to_frames(), LIMITS)
    assert isinstance(c, Chunk) and bytes(c.data) == b"abc" and (c.offset, c.size) == (8, 100)
    assert decode_announcement(ANN.to_frames(), LIMITS) == ANN


@pytest.mark.parametrize("header,reason", [
    ({"kind": "fetch", "version": 1, "file": "../../etc/passwd", "offset": 0, "length": 10}, "file_name"),
    ({"kind": "fetch", "version": 1, "file": ".hidden", "offset": 0, "length": 10}, "file_name"),
    ({"kind": "fetch", "version": 1, "file": "a", "offset": 0, "length": 1 << 30}, "field_range"),
    ({"kind": "request", "credit": -1}, "field_range"),
    ({"kind": "request", "credit": 1.5}, "field"),
    ({"kind": "hello", "generator_id": "", "session": "s", "max_prompts": 1, "version": 0}, "field_range"),
    ({"kind": "bye", "return_leases": "all"}, "field"),
    ({"kind": "welcome"}, "kind"),  # a controller-only kind sent by a generator
])
def test_malformed_control_messages(header: dict, reason: str) -> None:
    frames = [msgpack.packb({"schema": 1, **header})]
    with pytest.raises(MessageError) as e:
        decode_from_generator(frames, LIMITS, vocab_size=V, max_version=0)
    assert e.value.reason == reason


def test_announcement_file_names_and_checksum_are_checked() -> None:
    bad = {**msgspec.structs.asdict(ANN), "files": ["../model.safetensors"]}
    with pytest.raises(MessageError, match="file_name"):
        decode_announcement([msgpack.packb({"schema": 1, "kind": "weights", **bad})], LIMITS)
    bad = {**msgspec.structs.asdict(ANN), "checksum": "not-hex"}
    with pytest.raises(MessageError, match="field_range"):
        decode_announcement([msgpack.packb({"schema": 1, "kind": "weights", **bad})], LIMITS)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=9))
def test_random_frames_only_ever_raise_message_error(frames: list[bytes]) -> None:
    try:
        decode_from_generator(frames, LIMITS, vocab_size=V, max_version=3)
    except MessageError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 7), st.integers(0, 10_000), st.integers(0, 255), st.booleans())
def test_mutated_valid_groups_decode_or_raise_message_error(frame: int, pos: int, byte: int, cut: bool) -> None:
    frames = _frames()
    f = bytearray(frames[frame])
    if f:
        if cut:
            f = f[: pos % len(f)]
        else:
            f[pos % len(f)] = byte
    frames[frame] = bytes(f)
    try:
        g = decode_from_generator(frames, LIMITS, vocab_size=V, max_version=3)
    except MessageError:
        return
    assert isinstance(g, RolloutBatch) and int(g.response_ids.max(initial=0)) < V
