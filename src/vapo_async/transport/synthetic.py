"""Synthetic rollouts and a scripted generator (no engine): for tests, benchmarks and learner
stand-ins. ``python -m vapo_async.transport.synthetic --endpoint ipc:///tmp/ctl --id gen-0``
runs one as a process (SIGTERM -> bye with its leases handed back, then exit).

The scripted generator follows the real generator's rules: it holds version
max(lease.min_version, announced versions) (it "reloads" instantly), stamps every token with it,
and keeps its credit at ``max_prompts - queued``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections import deque

import numpy as np

from vapo_async.transport.client import ControllerClient
from vapo_async.transport.config import TransportConfig
from vapo_async.transport.messages import (
    GroupInfo,
    Lease,
    LeasePrompt,
    RolloutBatch,
    WeightAnnouncement,
    Welcome,
)

log = logging.getLogger(__name__)


def random_group(rng: np.random.Generator, *, lease_id: int, prompt_index: int, generator_id: str,
                 group_size: int, lengths: tuple[int, int], vocab_size: int, version: int,
                 prompt_len: int = 32) -> RolloutBatch:
    """A valid group with G responses of random lengths in [lengths[0], lengths[1]]."""
    ls = rng.integers(lengths[0], lengths[1] + 1, size=group_size)
    correct = rng.random(group_size) < 0.5
    info = GroupInfo(lease_id=lease_id, prompt_index=prompt_index, generator_id=generator_id, gen_time_s=0.0,
                     finish_reasons=tuple("length" if n >= lengths[1] else "stop" for n in ls))
    return RolloutBatch.from_group(
        info,
        prompt_ids=rng.integers(0, vocab_size, prompt_len).astype(np.int32),
        response_ids=[rng.integers(0, vocab_size, n).astype(np.int32) for n in ls],
        logprobs=[np.log(rng.uniform(1e-6, 1.0, n)).astype(np.float32) for n in ls],
        versions=[np.full(n, version, np.int32) for n in ls],
        rewards=np.where(correct, 1.0, -1.0).astype(np.float32),
        correct=correct,
        truncated=ls >= lengths[1],
    )


class ScriptedGenerator:
    """Answers leases with random groups after ``delay_s`` each (see module docstring)."""

    def __init__(self, cfg: TransportConfig, generator_id: str, *, group_size: int = 4, max_prompts: int = 4,
                 delay_s: float = 0.0, lengths: tuple[int, int] = (4, 16), seed: int = 0) -> None:
        self.client = ControllerClient(cfg, generator_id, max_prompts=max_prompts)
        self.generator_id = generator_id
        self.group_size = group_size
        self.max_prompts = max_prompts
        self.delay_s = delay_s
        self.lengths = lengths
        self.rng = np.random.default_rng(seed)
        self.version = 0
        self.vocab_size = 0
        self.queue: deque[tuple[Lease, LeasePrompt]] = deque()
        self.sent = 0
        self.stop_event = threading.Event()

    def run(self, connect_timeout_s: float | None = 30.0, max_groups: int | None = None) -> None:
        """Serve leases until ``stop_event`` is set (or ``max_groups`` were sent), then say bye."""
        welcome = self.client.connect(connect_timeout_s)
        self._on_welcome(welcome)
        due = time.monotonic() + self.delay_s
        while not self.stop_event.is_set() and (max_groups is None or self.sent < max_groups):
            wait_ms = max(0, int((due - time.monotonic()) * 1000)) if self.queue else 50
            for msg in self.client.poll(wait_ms):
                self._on_message(msg)
            if self.queue and time.monotonic() >= due:
                lease, prompt = self.queue.popleft()
                group = random_group(self.rng, lease_id=lease.lease_id, prompt_index=prompt.index,
                                     generator_id=self.generator_id, group_size=self.group_size,
                                     lengths=self.lengths, vocab_size=self.vocab_size, version=self.version)
                if self.client.send_group(group):
                    self.sent += 1
                self.client.request(max(0, self.max_prompts - len(self.queue)))
                due = time.monotonic() + self.delay_s
        self.client.bye(sorted({lease.lease_id for lease, _ in self.queue}))

    def close(self) -> None:
        """Close the client sockets."""
        self.client.close()

    def _on_welcome(self, welcome: Welcome) -> None:
        self.queue.clear()  # leases of an earlier controller incarnation are void
        self.vocab_size = welcome.vocab_size
        self.version = welcome.version  # a learner restored from a checkpoint may roll back
        self.group_size = int(welcome.sampling.get("n", self.group_size))
        self.client.request(self.max_prompts)

    def _on_message(self, msg: object) -> None:
        if isinstance(msg, Welcome):
            self._on_welcome(msg)
        elif isinstance(msg, Lease):
            self.version = max(self.version, msg.min_version)
            self.queue.extend((msg, p) for p in msg.prompts)
        elif isinstance(msg, WeightAnnouncement):
            self.version = max(self.version, msg.version)


def main(argv: list[str]) -> int:
    """CLI: run one scripted generator until SIGTERM/SIGINT."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-prompts", type=int, default=4)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    gen = ScriptedGenerator(TransportConfig(endpoint=args.endpoint), args.id, group_size=args.group_size,
                            max_prompts=args.max_prompts, delay_s=args.delay, seed=args.seed)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: gen.stop_event.set())
    print(f"scripted generator {args.id} running", flush=True)
    try:
        gen.run(connect_timeout_s=None)
    finally:
        gen.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
