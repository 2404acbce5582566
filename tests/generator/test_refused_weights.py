"""A generator that refuses a weight version tells the controller, which re-issues the leases that
need it instead of waiting on that generator (real vLLM engine, real controller over ipc, real
corrupted weight directory written by the real ``WeightPublisher``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from genhelp import Published, version_state_dict

from vapo_async.common.sampling import GroupSamplingConfig
from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.server import Controller
from vapo_async.generator.loop import GeneratorLoop
from vapo_async.generator.sync import WeightSync
from vapo_async.rewards import RewardConfig, build_reward_fn
from vapo_async.transport.client import ControllerClient
from vapo_async.transport.config import TransportConfig
from vapo_async.transport.messages import (
    MessageError,
    MessageLimits,
    WeightsRefused,
    decode_from_generator,
)
from vapo_async.transport.publisher import WeightPublisher
from vapo_async.transport.synthetic import ScriptedGenerator

pytestmark = pytest.mark.vllm

B, G = 2, 2


@dataclass(frozen=True)
class Prompt:
    prompt: str
    answer: str


PROMPTS = [Prompt(f"Question: what is {a} + 1 * 2? Step:", str(a + 2)) for a in range(20)]


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_weights_refused_message_is_validated() -> None:
    limits = MessageLimits()
    msg = WeightsRefused(version=5, held=4, reason="checksum", return_leases=(7, 9))
    assert decode_from_generator(msg.to_frames(), limits, vocab_size=10, max_version=5) == msg
    for bad in (WeightsRefused(5, 4, "Not A Token"), WeightsRefused(-1, 4, "checksum")):
        with pytest.raises(MessageError):
            decode_from_generator(bad.to_frames(), limits, vocab_size=10, max_version=5)


def test_refused_version_is_reported_and_its_leases_reissued(engine, published: Published, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    root = tmp_path / "weights"
    pub = WeightPublisher(root, tiny_model_dir, keep=10)
    ann1 = pub.publish(1, version_state_dict(published.base, 1))
    engine.reload(Path(ann1.path), 1)  # the shared engine starts this test at version 1
    ccfg = ControllerConfig(transport=TransportConfig(endpoint=f"ipc://{tmp_path}/ctl"), lease_timeout_s=60.0,
                            weights_root=str(root.resolve()), sampling={"n": G, "max_tokens": 8})
    ctl = Controller(ccfg, PROMPTS, batch_groups=B, eta=0, vocab_size=engine.vocab_size)
    ctl.announce(ann1)
    ctl.start()
    client = ControllerClient(TransportConfig(endpoint=ctl.endpoint), "refuser", max_prompts=B)
    sync = WeightSync(client, engine, tmp_path / "cache", retry_s=60.0)  # no retry within this test
    reward_fn = build_reward_fn(RewardConfig())
    loop = GeneratorLoop(client, engine, sync, reward_fn, GroupSamplingConfig(group_size=G, max_tokens=8), B)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            loop.run(client.connect(10))
        except BaseException as e:  # re-raised by the test below
            errors.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    healthy: ScriptedGenerator | None = None
    try:
        first = ctl.next_batch(B, timeout_s=60)
        assert {int(v.min()) for g in first for v in g.versions} == {1}
        ctl.mark_trained(first)

        bad = pub.publish(2, version_state_dict(published.base, 2))
        _flip_byte(Path(bad.path) / "model.safetensors")  # corrupted on disk after publishing
        leases_before = ctl.metrics()["controller/leases"]
        ctl.step_done(bad)  # eta = 0: the B new slots are leased with min_version 2
        _wait(lambda: ctl.metrics().get("controller/weights_refused", 0) == 1, "the refusal report")
        _wait(lambda: ctl.accounting()["pending"] == B, "the leases to come back")
        m, acc = ctl.metrics(), ctl.accounting()
        assert m["controller/weights_refused/checksum"] == 1
        # B = 2 slots admitted for step 1, leased once (1 lease of 2 prompts), handed back: both
        # pending again, none leased; the old behaviour kept them leased (heartbeats) for lease_max_s
        assert m["controller/leases"] == leases_before + 1 and acc["leased"] == 0 and acc["reissued"] == B
        assert engine.version == 1 and sync.stats.refused == 1 and loop.stats.leases_handed_back == 1
        time.sleep(1.0)  # it asks for no credit while refusing: no lease ping-pong
        assert ctl.metrics()["controller/leases"] == leases_before + 1 and ctl.accounting()["leased"] == 0
        assert "refuser refused weights version 2" in str(ctl.state.describe())

        # a generator that can load version 2 gets the re-issued prompts: nothing waits on the refuser
        healthy = ScriptedGenerator(TransportConfig(endpoint=ctl.endpoint), "healthy", group_size=G, max_prompts=B)
        threading.Thread(target=healthy.run, kwargs={"connect_timeout_s": 10, "max_groups": B}, daemon=True).start()
        second = ctl.next_batch(B, timeout_s=30)
        assert {g.generator_id for g in second} == {"healthy"} and {g.oldest_version() for g in second} == {2}
        ctl.mark_trained(second)

        # a good newer version: the refuser loads it and asks for work again
        ann3 = pub.publish(3, version_state_dict(published.base, 3))
        ctl.step_done(ann3)
        third = ctl.next_batch(B, timeout_s=60)
        assert {g.generator_id for g in third} == {"refuser"}
        assert {int(v.min()) for g in third for v in g.versions} == {3} and engine.version == 3
        ctl.mark_trained(third)
        assert ctl.metrics()["controller/weights_refused"] == 1  # counted once
        assert not errors, errors
    finally:
        loop.stop()
        thread.join(30)
        if healthy is not None:
            healthy.stop_event.set()
            time.sleep(0.2)
            healthy.close()
        loop.close()
        client.close()
        reward_fn.close()
        ctl.stop()
        pub.close()
