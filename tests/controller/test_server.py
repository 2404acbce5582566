"""The controller over real sockets: hostile input, deadlines, sessions, refusals."""

from __future__ import annotations

import time
from collections import Counter

import msgpack
import numpy as np
import pytest
import zmq
from ctl_helpers import VOCAB, fake_announcement, run_learner, trained_ids

from vapo_async.controller.config import ControllerConfig
from vapo_async.transport.fuzz import FAMILIES, malformed_messages
from vapo_async.transport.messages import (
    ErrorReply,
    Hello,
    Lease,
    MessageLimits,
    Request,
    Welcome,
    decode_from_controller,
    encode_group,
)
from vapo_async.transport.synthetic import random_group


class RawGenerator:
    """A bare DEALER speaking the protocol by hand (to misbehave precisely). Every instance is
    closed after its test even when the test fails first (conftest's ``_close_raw_generators``): a context
    left to the garbage collector blocks in ``term()`` inside whichever test runs next."""

    live: list[RawGenerator] = []

    def __init__(self, endpoint: str, generator_id: str, session: str = "s1") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.generator_id = generator_id
        self.session = session
        RawGenerator.live.append(self)

    def hello(self, max_prompts: int = 8) -> Welcome:
        self.sock.send_multipart(Hello(self.generator_id, self.session, max_prompts).to_frames())
        msg = self.recv()
        assert isinstance(msg, Welcome)
        return msg

    def recv(self, timeout_ms: int = 5000) -> object:
        assert self.sock.poll(timeout_ms), "no reply from the controller"
        return decode_from_controller(self.sock.recv_multipart(), MessageLimits())

    def lease(self, credit: int) -> Lease:
        self.sock.send_multipart(Request(credit).to_frames())
        msg = self.recv()
        assert isinstance(msg, Lease)
        return msg

    def send_group(self, lease: Lease, index: int, version: int = 0, generator_id: str | None = None) -> None:
        g = random_group(np.random.default_rng(index), lease_id=lease.lease_id, prompt_index=index,
                         generator_id=generator_id or self.generator_id, group_size=2, lengths=(3, 8),
                         vocab_size=VOCAB, version=version)
        self.sock.send_multipart(encode_group(g), copy=False)

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(0)
            self.ctx.term()


def test_fuzzed_messages_are_all_counted_and_training_is_unaffected(make_controller, start_generator, endpoint,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    n_fuzz = 2000
    limits = MessageLimits(max_frame_bytes=64 << 10)
    B, steps, eta = 4, 6, 1
    ctl = make_controller(n_prompts=40, batch_groups=B, eta=eta)
    ctl.cfg.transport.limits = limits  # small frames so oversized ones stay cheap to send
    start_generator("good", group_size=2, max_prompts=4)
    fuzzer = RawGenerator(endpoint, "fuzzer")
    fuzzer.hello()
    anonymous = RawGenerator(endpoint, "anon")  # never says hello
    sent = Counter()
    for frames, family in malformed_messages(np.random.default_rng(0), n_fuzz, limits, VOCAB, version=0):
        fuzzer.sock.send_multipart(frames)
        sent[family] += 1
    anonymous.sock.send_multipart([msgpack.packb({"schema": 1, "kind": "heartbeat"})])
    batches = run_learner(ctl, steps + eta + 1, B, steps=steps)
    deadline = time.monotonic() + 10
    while ctl.metrics()["transport/rejected"] < n_fuzz + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    m = ctl.metrics()
    assert set(sent) == set(FAMILIES)
    assert m["transport/rejected"] == n_fuzz + 1  # every malformed message counted, nothing else
    assert m["transport/rejected/unknown_session"] == 1
    assert m["transport/rejected/unknown_lease"] == sent["unknown_lease"]
    assert m["transport/rejected/frame_too_large"] == sent["oversized_frame"]
    assert m["transport/rejected/logprob_positive"] == sent["positive_logprob"]
    acc = ctl.accounting()
    assert acc["trained"] == acc["admitted"] == (steps + eta + 1) * B
    assert trained_ids(batches) == list(range(acc["admitted"]))
    # logged with the sender, rate-limited: one line per reason within log_interval_s (10 s)
    lines = [r.getMessage() for r in caplog.records if "rejected message" in r.getMessage()]
    reasons = [k for k in m if k.startswith("transport/rejected/")]
    assert len(reasons) <= len(lines) <= len(reasons) + 1 and len(lines) < 50
    assert sum("fuzzer" in line for line in lines) == len(lines) - 1  # all but the anonymous heartbeat
    fuzzer.close()
    anonymous.close()


def test_lease_not_returned_before_deadline_is_reissued(make_controller, start_generator, endpoint) -> None:
    ctl = make_controller(n_prompts=20, batch_groups=2, eta=0, lease_timeout_s=0.4)
    hung = RawGenerator(endpoint, "hung")
    hung.hello()
    lease = hung.lease(2)  # takes both admissible prompts, then goes silent (socket stays open)
    assert len(lease.prompts) == 2
    t0 = time.monotonic()
    start_generator("healthy", group_size=2, max_prompts=2)
    batch = ctl.next_batch(2, timeout_s=10)
    assert time.monotonic() - t0 >= 0.35  # only after the deadline passed
    assert sorted(g.prompt_index for g in batch) == sorted(p.index for p in lease.prompts)
    assert {g.generator_id for g in batch} == {"healthy"}
    ctl.mark_trained(batch)
    acc = ctl.accounting()
    assert acc["reissued"] == 2 and acc["leases_expired"] == 1
    hung.close()


def test_heartbeats_keep_a_lease_until_the_hard_deadline(make_controller, endpoint) -> None:
    # timeouts 10x the heartbeat period: a loaded CI machine may delay a heartbeat by a second
    ctl = make_controller(batch_groups=1, eta=0, lease_timeout_s=1.5, lease_max_s=3.0)
    gen = RawGenerator(endpoint, "slow")
    gen.hello()
    lease = gen.lease(1)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.5:  # heartbeats every 0.15 s: alive past lease_timeout_s, lease kept
        gen.sock.send_multipart([msgpack.packb({"schema": 1, "kind": "heartbeat"})])
        time.sleep(0.15)
        assert ctl.accounting()["leased"] == 1
    time.sleep(1.0)  # past lease_max_s: a wedged sampler loses the lease despite heartbeats
    assert ctl.accounting()["reissued"] == 1
    gen.send_group(lease, lease.prompts[0].index)  # a late answer is still accepted, once
    assert len(ctl.next_batch(1, 5)) == 1
    gen.close()


def test_silent_session_without_leases_is_forgotten_after_session_timeout(make_controller, endpoint) -> None:
    ctl = make_controller(lease_timeout_s=0.5, session_timeout_s=5.0)  # not 2 x 0.5 = 1 s
    gen = RawGenerator(endpoint, "quiet")
    t0 = time.monotonic()  # before the hello: the controller's clock for the session starts after it
    gen.hello()
    time.sleep(2.5)  # silent past 2 x lease_timeout_s but within session_timeout_s: still known
    assert ctl.metrics()["controller/generators"] == 1
    while ctl.metrics()["controller/generators"] == 1:
        assert time.monotonic() - t0 < 15, "a silent session was never forgotten"
        time.sleep(0.05)
    assert time.monotonic() - t0 > 5.0
    gen.sock.send_multipart(Request(1).to_frames())
    reply = gen.recv()
    assert isinstance(reply, ErrorReply) and reply.reason == "unknown_session"
    gen.close()


def test_session_timeout_must_be_zero_or_two_heartbeats() -> None:
    with pytest.raises(ValueError, match="session_timeout_s must be 0"):
        ControllerConfig(session_timeout_s=-1.0)
    with pytest.raises(ValueError, match=r"at least two heartbeat periods \(30 s\), got 20"):
        ControllerConfig(lease_timeout_s=60.0, session_timeout_s=20.0)  # heartbeats every 15 s


def test_restart_with_new_session_and_bye_reissue_at_once(make_controller, endpoint) -> None:
    ctl = make_controller(batch_groups=2, eta=1, lease_timeout_s=30)
    first = RawGenerator(endpoint, "gen", session="old")
    first.hello()
    assert len(first.lease(3).prompts) == 3
    again = RawGenerator(endpoint, "gen", session="new")  # the same generator restarted
    again.hello()
    acc = ctl.accounting()  # immediately, not after 30 s; one lease of 3 items released
    assert acc["reissued"] == 3 and acc["leases_released"] == 1 and acc.get("leases_expired", 0) == 0
    lease = again.lease(4)
    assert len(lease.prompts) == 4  # 3 re-issued + 1 new (capacity (1 + 1) * 2 = 4)
    again.sock.send_multipart([msgpack.packb({"schema": 1, "kind": "bye", "return_leases": [lease.lease_id]})])
    deadline = time.monotonic() + 5
    while ctl.accounting()["reissued"] < 7 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ctl.accounting()["pending"] == 4 and ctl.metrics()["controller/generators"] == 0
    assert ctl.accounting()["leases_released"] == 2  # the bye returned the second one
    first.close()
    again.close()


@pytest.mark.parametrize("case", ["stale_version", "wrong_group_size", "foreign_generator_id", "other_owner"])
def test_refused_groups(make_controller, endpoint, case: str) -> None:
    ctl = make_controller(batch_groups=1, eta=0, sampling={"n": 2})

    ctl.announce(fake_announcement(1))
    gen = RawGenerator(endpoint, "gen")
    gen.hello()
    lease = gen.lease(1)
    assert lease.min_version == 1 and lease.weights is not None and lease.weights.version == 1
    index = lease.prompts[0].index
    if case == "stale_version":
        gen.send_group(lease, index, version=0)
    elif case == "wrong_group_size":
        g = random_group(np.random.default_rng(0), lease_id=lease.lease_id, prompt_index=index, generator_id="gen",
                         group_size=3, lengths=(2, 4), vocab_size=VOCAB, version=1)
        gen.sock.send_multipart(encode_group(g))
    elif case == "foreign_generator_id":
        gen.send_group(lease, index, version=1, generator_id="someone-else")
    else:
        other = RawGenerator(endpoint, "other")
        other.hello()
        other.send_group(lease, index, version=1)
        other.close()
    reason = {"stale_version": "version_stale", "wrong_group_size": "group_size",
              "foreign_generator_id": "generator_id_mismatch", "other_owner": "wrong_owner"}[case]
    ack = gen.recv() if case != "other_owner" else None
    if ack is not None:
        assert ack.status == "rejected" and ack.reason == reason
    deadline = time.monotonic() + 5
    while ctl.metrics().get(f"transport/rejected/{reason}", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ctl.metrics()[f"transport/rejected/{reason}"] == 1
    assert ctl.metrics()["controller/buffered"] == 0
    gen.close()


def test_controller_thread_failure_surfaces_in_next_batch(make_controller) -> None:
    ctl = make_controller()
    ctl.state.ledger.leases = None  # corrupt internal state: the next housekeeping pass raises
    with pytest.raises(RuntimeError, match="controller thread failed"):
        ctl.next_batch(4, timeout_s=5)
