"""Live wire fuzzing (issue 6, "Bad input"): 10,200 malformed messages of all 13 families
(``vapo_async.transport.fuzz``) fired from three fuzzer *processes* at a controller's socket while
a run is training: an honest scripted generator streams groups, the learner stand-in consumes them
and advances versions. Two fuzzers say hello first (their messages reach the per-session checks),
one never does (every message must still be counted).

Checks: the controller never fails (its thread is alive, ``next_batch`` keeps working); every
malformed message is rejected and counted exactly once (``transport/rejected`` = messages sent);
training is unaffected: every admitted prompt is trained exactly once, only the honest generator's
groups are trained, and each trained group is byte-identical to what that generator sent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from fault_helpers import prompts

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.server import Controller
from vapo_async.transport.config import TransportConfig
from vapo_async.transport.fuzz import FAMILIES
from vapo_async.transport.messages import (
    MessageLimits,
    RolloutBatch,
    WeightAnnouncement,
    encode_group,
)
from vapo_async.transport.synthetic import ScriptedGenerator

pytestmark = pytest.mark.slow

HELPERS = Path(__file__).resolve().parent / "fault_helpers.py"
VOCAB, B, ETA, G = 500, 4, 1, 4
PER_FUZZER = 3400
LIMITS = MessageLimits(max_frame_bytes=256 << 10)
"""Small frame limit so that the ~780 oversized frames (limit + 4 bytes each) stay cheap to send."""


def _wire(g: RolloutBatch) -> bytes:
    return b"".join(bytes(f) for f in encode_group(g))


class RecordingGenerator(ScriptedGenerator):
    """The honest generator; remembers the exact bytes of every group it sent."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.sent_bytes: dict[tuple[int, int], bytes] = {}
        send = self.client.send_group

        def send_and_record(group: RolloutBatch) -> bool:
            ok = send(group)
            if ok:
                self.sent_bytes[(group.lease_id, group.prompt_index)] = _wire(group)
            return ok

        self.client.send_group = send_and_record  # type: ignore[method-assign]


def _fuzzer(endpoint: str, seed: int, anonymous: bool) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(HELPERS), "fuzz", "--endpoint", endpoint, "--n", str(PER_FUZZER), "--seed", str(seed),
           "--vocab", str(VOCAB), "--max-frame-bytes", str(LIMITS.max_frame_bytes), "--id", f"fuzz-{seed}"]
    return subprocess.Popen(cmd + (["--anonymous"] if anonymous else []), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _ann(version: int) -> WeightAnnouncement:
    return WeightAnnouncement(version, f"/nonexistent/v{version:08d}", "0" * 64, 0, ())


def test_ten_thousand_malformed_messages_during_a_run(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/ctl"
    transport = TransportConfig(endpoint=endpoint, limits=LIMITS)
    cfg = ControllerConfig(transport=transport, lease_timeout_s=5.0, sampling={"n": G})
    ctl = Controller(cfg, prompts(500), batch_groups=B, eta=ETA, vocab_size=VOCAB)
    ctl.start()
    honest = RecordingGenerator(TransportConfig(endpoint=endpoint), "honest", group_size=G, max_prompts=4,
                                delay_s=0.002, lengths=(4, 48), seed=1)
    gen_thread = threading.Thread(target=honest.run, kwargs={"connect_timeout_s": 20}, daemon=True)
    gen_thread.start()
    batches: list[list[RolloutBatch]] = []
    try:
        batches.append(ctl.next_batch(B, 30))  # the run is going before the attack starts
        ctl.mark_trained(batches[-1])
        ctl.step_done(_ann(1))
        t0 = time.monotonic()
        fuzzers = [_fuzzer(endpoint, seed, anonymous=seed == 2) for seed in range(3)]
        during = 0
        while any(f.poll() is None for f in fuzzers):
            batch = ctl.next_batch(B, 30)
            ctl.mark_trained(batch)
            batches.append(batch)
            ctl.step_done(_ann(ctl.version + 1))
            during += 1
        fuzz_s = time.monotonic() - t0
        reports = []
        for f in fuzzers:
            out, err = f.communicate(timeout=30)
            assert f.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
        for _ in range(ETA + 1):  # drain: no more steps, train what was admitted
            batch = ctl.next_batch(B, 30)
            ctl.mark_trained(batch)
            batches.append(batch)
        sent = sum((Counter(r["sent"]) for r in reports), Counter())
        probes = sum(r["probes"] for r in reports)  # anonymous heartbeats: rejected as well
        total = sum(sent.values()) + probes
        deadline = time.monotonic() + 30
        while ctl.metrics()["transport/rejected"] < total and time.monotonic() < deadline:
            time.sleep(0.05)
        m = ctl.metrics()
        acc = ctl.accounting()
    finally:
        honest.stop_event.set()
        gen_thread.join(10)
        honest.close()
        ctl.stop()

    assert set(sent) == set(FAMILIES) and sum(sent.values()) == 3 * PER_FUZZER >= 10_000
    assert ctl._error is None  # the controller thread never failed
    assert m["transport/rejected"] == total, {k: v for k, v in m.items() if k.startswith("transport/")}
    # validation comes before the session check, so these reasons count every fuzzer's messages
    assert m["transport/rejected/frame_too_large"] == sent["oversized_frame"]
    assert m["transport/rejected/logprob_positive"] == sent["positive_logprob"]
    assert m["transport/rejected/token_range"] == sent["token_out_of_vocab"]
    # well-formed groups: an unknown lease for the greeted fuzzers, an unknown session for the other
    assert m["transport/rejected/unknown_session"] >= reports[2]["sent"]["unknown_lease"] + probes
    assert m["transport/rejected/unknown_lease"] + m["transport/rejected/unknown_session"] >= sent["unknown_lease"]
    assert during >= 3, f"only {during} steps trained while {total} messages arrived in {fuzz_s:.1f} s"
    # training unaffected: exactly once, only honest groups, byte for byte what was sent
    groups = [g for b in batches for g in b]
    assert sorted(g.admission_index for g in groups) == list(range(acc["admitted"]))
    assert acc["trained"] == acc["admitted"] == len(groups) and acc.get("duplicates", 0) == 0, acc
    assert {g.generator_id for g in groups} == {"honest"}
    for g in groups:
        assert _wire(g) == honest.sent_bytes[(g.lease_id, g.prompt_index)]
    rate = total / fuzz_s
    print(f"\nlive fuzz: {total} malformed messages in {fuzz_s:.1f} s ({rate:.0f}/s) during {during} training "
          f"steps; rejected {int(m['transport/rejected'])}; {len(groups)} groups trained exactly once")
