"""A real generator process (``python -m vapo_async.generator`` via ``launch``) against a real
Controller over ipc: it starts before the controller, its groups arrive and validate, weights flow
to it after a step, it follows a controller restart back to the base weights, refuses corrupted
weights and at once hands back the leases that need them (the controller counts the refusal and
re-issues them), and leaves cleanly on SIGTERM (exit 0, no process of its group left)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from genhelp import Published, hf, hf_logprobs, version_state_dict
from transformers import AutoTokenizer

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.server import Controller
from vapo_async.learner.launch import (
    GeneratorHandle,
    start_local_generators,
    stop_generators,
    tail,
)
from vapo_async.transport.config import TransportConfig
from vapo_async.transport.messages import RolloutBatch
from vapo_async.transport.publisher import WeightPublisher

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

G, MAX_TOKENS, B = 2, 16, 2


@dataclass(frozen=True)
class Prompt:
    prompt: str
    answer: str


PROMPTS = [Prompt(f"Question: what is {a} + {a % 7} * 2? Step:", str(a + 2 * (a % 7))) for a in range(40)]


def _controller(endpoint: str, root: Path) -> Controller:
    cfg = ControllerConfig(transport=TransportConfig(endpoint=endpoint), lease_timeout_s=60.0,
                           weights_root=str(root), sampling={"n": G, "max_tokens": MAX_TOKENS})
    ctl = Controller(cfg, PROMPTS, batch_groups=B, eta=0, vocab_size=320)
    ctl.start()
    return ctl


def _wait(cond, what: str, handle: GeneratorHandle, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert handle.alive(), f"generator exited while waiting for {what}:\n{tail(handle)}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{tail(handle)}"
        time.sleep(0.2)


def _check(groups: list[RolloutBatch], tokenizer, version: int) -> None:
    for g in groups:
        assert g.generator_id == "local-0" and g.group_size == G
        np.testing.assert_array_equal(g.prompt_ids, tokenizer.encode(PROMPTS[g.prompt_index].prompt))
        for ids, lp, v, reason in zip(g.split("response_ids"), g.split("logprobs"), g.split("versions"),
                                      g.info[0].finish_reasons, strict=True):
            assert 1 <= len(ids) <= MAX_TOKENS and len(lp) == len(ids)
            assert (v == version).all(), f"versions {v} != {version}"
            assert np.isfinite(lp).all() and (lp <= 0).all()
            assert reason in ("stop", "length")
        np.testing.assert_array_equal(g.truncated, [r == "length" for r in g.info[0].finish_reasons])
        np.testing.assert_array_equal(g.rewards, np.where(g.correct, 1.0, -1.0))


def test_generator_process_with_controller(published: Published, tiny_model_dir: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/ctl"
    overrides = {"model": published.dir(0), "engine.max_model_len": 256, "max_prompts": B,
                 "stats_interval_s": 2, "weights_cache": tmp_path / "cache"}
    (h,) = start_local_generators(1, endpoint, overrides, log_dir=tmp_path / "logs")
    controllers: list[Controller] = []
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    try:
        _wait(lambda: "connecting to controller" in h.log_path.read_text(), "engine start", h)
        time.sleep(1.0)  # the generator is saying hello to nobody
        ctl = _controller(endpoint, published.root)
        controllers.append(ctl)
        first = ctl.next_batch(B, timeout_s=120)
        _check(first, tokenizer, 0)
        g = first[0]
        ref = np.concatenate([hf_logprobs(hf(published.dir(0)), g.prompt_ids, r, 1.0) for r in g.split("response_ids")])
        assert np.abs(ref - g.logprobs).mean() < 1e-3
        ctl.mark_trained(first)
        ctl.step_done(published.publish(1))  # eta = 0: the next leases require version 1
        second = ctl.next_batch(B, timeout_s=120)
        _check(second, tokenizer, 1)
        ctl.mark_trained(second)

        # learner restart without a checkpoint: a new controller at version 0, another weights root
        ctl.stop()
        root2 = tmp_path / "weights2"
        ctl = _controller(endpoint, root2)
        controllers.append(ctl)
        third = ctl.next_batch(B, timeout_s=120)
        _check(third, tokenizer, 0)  # the generator went back to its base weights
        ctl.mark_trained(third)

        # corrupted version 1 under the new root: refused, reported, its leases handed back at once
        pub2 = WeightPublisher(root2, tiny_model_dir, keep=3)
        ann = pub2.publish(1, version_state_dict(published.base, 1))
        path = Path(ann.path) / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        ctl.step_done(ann)
        _wait(lambda: ctl.metrics().get("controller/weights_refused/checksum") == 1
              and ctl.metrics()["controller/pending"] == B, "refusal report and re-issue", h, timeout_s=60)
        assert "keeping weights version 0" in h.log_path.read_text()
        assert ctl.metrics()["controller/leased"] == 0  # nothing waits on this generator for version 1
    finally:
        codes = stop_generators([h], timeout_s=60)
    try:
        assert codes == [0], tail(h)
        with pytest.raises(ProcessLookupError):
            os.killpg(h.pid, 0)  # nothing of the generator's process group is left
        ctl = controllers[-1]
        deadline = time.monotonic() + 10
        while ctl.metrics()["controller/leased"] and time.monotonic() < deadline:
            time.sleep(0.1)
        acc = ctl.accounting()
        assert acc["leased"] == 0 and acc["pending"] == B, acc  # handed back, ready for re-issue
        log_text = h.log_path.read_text()
        assert "weights version 1 refused (checksum): 1 leases handed back" in log_text
        assert "leaving: 0 leases handed back" in log_text
        assert log_text.count("new controller session") == 1  # the restart, not duplicate welcomes
    finally:
        for c in controllers:
            c.stop()
