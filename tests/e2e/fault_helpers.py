"""Helpers of the fault and fuzz tests: real generator processes, a learner stand-in, tampering.

- ``GeneratorPool``: real ``python -m vapo_async.generator`` processes (via ``learner.launch``)
  that can be SIGKILLed, SIGSTOPped / SIGCONTed and restarted under a fresh id per incarnation.
- ``StandIn``: the learner's side of a real ``Controller`` (next_batch -> mark_trained ->
  step_done with a real ``WeightPublisher`` announcement of a perturbed tiny model), recording every
  batch, how long each ``next_batch`` waited, and the version each batch was trained at.
- ``flip_byte`` / ``truncate``: corrupt a published weight directory after its checksum was taken.
- ``python tests/e2e/fault_helpers.py fuzz ...``: a fuzzer process that says hello (or not) and
  fires ``vapo_async.transport.fuzz`` messages at a controller, printing per-family counts as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SRC = Path(__file__).resolve().parents[2] / "src"
if str(SRC) not in sys.path:  # the fuzz entry point runs as a plain script
    sys.path.insert(0, str(SRC))

from vapo_async.transport.messages import MessageLimits  # noqa: E402

G, MAX_TOKENS = 2, 16
"""Responses per group and tokens per response of the fault runs (tiny, to keep CPU time low)."""


@dataclass(frozen=True)
class Prompt:
    """What the controller needs of a prompt record."""

    prompt: str
    answer: str


def prompts(n: int) -> list[Prompt]:
    """Arithmetic prompts in the tiny tokenizer's vocabulary (see tests/conftest.py)."""
    return [Prompt(f"Question: what is {a % 40} + {a % 13} * 2? Step:", str(a % 40 + 2 * (a % 13))) for a in range(n)]


def perturbed(base: dict[str, Any], version: int) -> dict[str, Any]:
    """Weights of policy ``version``: base + N(0, (0.05 * std)^2) seeded noise (a learner step)."""
    import torch

    g = torch.Generator().manual_seed(7919 + version)
    return {k: w + 0.05 * w.float().std().clamp_min(1e-3) * torch.randn(w.shape, generator=g)
            for k, w in base.items()}


def flip_byte(path: str | Path) -> None:
    """Corrupt ``path/model.safetensors`` in place (one byte in the middle inverted)."""
    f = Path(path) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def truncate(path: str | Path) -> None:
    """Cut ``path/model.safetensors`` to half its size (a copy that died midway)."""
    f = Path(path) / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)


# ---- generator processes ----


@dataclass
class GeneratorPool:
    """Real generator processes; slot ``s`` runs incarnations ``{s}0``, ``{s}1``, ... (one id each,
    so groups and leases can be attributed to an incarnation)."""

    endpoint: str
    overrides: dict[str, Any]
    log_dir: Path
    slot_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Extra overrides of one slot (e.g. an in-process engine)."""
    handles: dict[str, Any] = field(default_factory=dict)
    """Current incarnation per slot: slot -> GeneratorHandle."""
    incarnation: Counter[str] = field(default_factory=Counter)
    dead: list[Any] = field(default_factory=list)

    def start(self, slot: str, extra: dict[str, Any] | None = None) -> str:
        """Start the next incarnation of ``slot`` (``extra``: more overrides); returns its id."""
        from vapo_async.learner.launch import start_local_generators

        prefix = f"{slot}{self.incarnation[slot]}"
        self.incarnation[slot] += 1
        overrides = {**self.overrides, **self.slot_overrides.get(slot, {}), **(extra or {})}
        (h,) = start_local_generators(1, self.endpoint, overrides, log_dir=self.log_dir / prefix, id_prefix=prefix)
        self.handles[slot] = h
        return h.generator_id

    def id(self, slot: str) -> str:
        return self.handles[slot].generator_id

    def log(self, slot: str) -> str:
        return self.handles[slot].log_path.read_text(errors="replace")

    def signal(self, slot: str, sig: int) -> None:
        """Send ``sig`` to the generator process itself (not its engine core)."""
        os.kill(self.handles[slot].pid, sig)

    def kill(self, slot: str) -> Any:
        """SIGKILL the generator process (no bye); returns its handle."""
        h = self.handles[slot]
        os.kill(h.pid, signal.SIGKILL)
        h.process.wait(10)
        self.dead.append(h)
        return h

    def check_alive(self) -> None:
        from vapo_async.learner.launch import tail

        for slot, h in self.handles.items():
            assert h.alive(), f"generator {slot} ({h.generator_id}) exited:\n{tail(h, 40)}"

    def close(self) -> list[int]:
        from vapo_async.common.procs import kill_group
        from vapo_async.learner.launch import stop_generators

        codes = stop_generators(list(self.handles.values()), timeout_s=30)
        for h in self.dead:
            kill_group(h.pid, 2.0)
            h._log_file.close()
        return codes


def group_members(pgid: int) -> list[str]:
    """'pid name' of every live process of process group ``pgid`` (a generator's session)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(f"{p.pid} {p.info['name']}")
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


# ---- controller-side inspection ----


def active_items(ctl: Any, generator_id: str) -> list[int]:
    """Items currently leased (active leases, not received) to the session of ``generator_id``."""
    with ctl._lock:
        ident = ctl.state.sessions.by_generator.get(generator_id)
        if ident is None:
            return []
        out = []
        for lease_id in ctl.state.ledger.by_owner.get(ident, ()):
            lease = ctl.state.ledger.leases[lease_id]
            out += [lease.items[p] for p in lease.open if lease.active]
        return sorted(out)


def received(ctl: Any, items: list[int]) -> bool:
    """Every item in ``items`` has been received (buffered, consumed or done)."""
    with ctl._lock:
        return all(ctl.state.ledger.state_of(i) not in ("pending", "leased") for i in items)


# ---- learner stand-in ----


@dataclass
class StandIn:
    """The learner's side of a controller: take a batch, "train", publish the next version."""

    ctl: Any
    publisher: Any
    base: dict[str, Any]
    batch_groups: int
    eta: int
    timeout_s: float
    batches: list[list[Any]] = field(default_factory=list)
    waits: list[tuple[float, float]] = field(default_factory=list)
    """(time the wait ended, seconds ``next_batch`` blocked) per batch."""
    trained_at: list[int] = field(default_factory=list)
    """Controller version when each batch was trained."""
    step_s: float = 1.0
    """Least wall time of one step (a learner's forward/backward; paces version churn)."""
    tampered: dict[int, str] = field(default_factory=dict)
    """Versions published and then corrupted: version -> how."""
    dropped: list[Any] = field(default_factory=list)
    """Groups dropped as staler than eta (the learner's ``async/dropped_stale``)."""

    def take(self, timeout_s: float | None = None) -> list[Any]:
        """One global batch like the learner's ``RolloutStream``: groups staler than eta versions
        (current version minus the oldest token's) are dropped (``mark_dropped``) and topped up."""
        t0 = time.monotonic()
        kept: list[Any] = []
        while len(kept) < self.batch_groups:
            groups = self.ctl.next_batch(self.batch_groups - len(kept), self.timeout_s if timeout_s is None else timeout_s)
            is_stale = [self.ctl.version - g.oldest_version() > self.eta for g in groups]
            stale = [g for g, s in zip(groups, is_stale, strict=True) if s]
            if stale:
                self.ctl.mark_dropped(stale)
                self.dropped += stale
            kept += [g for g, s in zip(groups, is_stale, strict=True) if not s]
        self.waits.append((time.monotonic(), time.monotonic() - t0))
        self.trained_at.append(self.ctl.version)
        self.ctl.mark_trained(kept)
        self.batches.append(kept)
        return kept

    def step(self, tamper: Callable[[str], None] | None = None, timeout_s: float | None = None) -> list[Any]:
        """One training step: a batch, then the next version published (optionally corrupted
        after its manifest was written, i.e. a bad disk) and announced with ``step_done``."""
        t0 = time.monotonic()
        batch = self.take(timeout_s)
        time.sleep(max(0.0, self.step_s - (time.monotonic() - t0)))  # "training"
        version = self.ctl.version + 1
        ann = self.publisher.publish(version, perturbed(self.base, version))
        if tamper is not None:
            tamper(ann.path)
            self.tampered[version] = tamper.__name__
        self.ctl.step_done(ann)
        return batch

    def republish(self) -> int:
        """Publish the current weights again as a new version (what a learner does when its
        generators report the latest version unusable); announced without a training step."""
        version = self.ctl.version + 1
        self.ctl.announce(self.publisher.publish(version, perturbed(self.base, version)))
        return version

    def drain(self) -> None:
        """Train what admission already let in (no more steps): afterwards nothing is in flight."""
        while (acc := self.ctl.accounting())["admitted"] > acc["trained"] + acc.get("dropped", 0):
            self.take()

    def groups(self) -> list[Any]:
        return [g for b in self.batches for g in b]

    def by_generator(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for g in self.groups():
            out.setdefault(g.generator_id, []).append(g)
        return out

    def assert_exactly_once(self) -> dict[str, Any]:
        """Quiescent accounting: every admitted item trained (or dropped as stale) exactly once,
        nothing in flight."""
        acc = self.ctl.accounting()
        trained = sorted(g.admission_index for g in self.groups())
        dropped = sorted(g.admission_index for g in self.dropped)
        assert sorted(trained + dropped) == list(range(acc["admitted"])), "a prompt was lost or trained twice"
        assert acc["trained"] == len(trained) and acc.get("dropped", 0) == len(dropped), acc
        assert acc["pending"] == acc["leased"] == acc["buffered"] == acc["consumed"] == 0, acc
        return acc

    def assert_versions(self) -> None:
        """Every trained token was sampled by a published, untampered version within eta of training
        (dropped stale groups included in the tampering check)."""
        for g in self.dropped:
            assert not set(np.unique(np.asarray(g.versions)).tolist()) & set(self.tampered)
        for batch, at in zip(self.batches, self.trained_at, strict=True):
            for g in batch:
                v = np.asarray(g.versions)
                assert v.max() <= at and v.min() >= at - self.eta, (g.generator_id, v.min(), v.max(), at)
                assert not set(np.unique(v).tolist()) & set(self.tampered), \
                    f"{g.generator_id} sampled with a refused version: {np.unique(v)}"


# ---- fuzzer process ----


def fuzz_main(argv: list[str]) -> int:
    """Send ``--n`` malformed messages from a session (hello first) or anonymously; print counts.
    An anonymous fuzzer first probes with heartbeats until the controller answers (each probe is
    one more rejected message, reported as ``probes``)."""
    import zmq

    from vapo_async.transport.fuzz import malformed_messages
    from vapo_async.transport.messages import Heartbeat, Hello, Welcome, decode_from_controller

    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--max-frame-bytes", type=int, required=True)
    p.add_argument("--id", default="fuzzer")
    p.add_argument("--anonymous", action="store_true", help="never say hello")
    args = p.parse_args(argv)
    limits = MessageLimits(max_frame_bytes=args.max_frame_bytes)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(args.endpoint)
    probes = 0
    if args.anonymous:  # wait until the controller is up: a heartbeat without hello -> error reply
        deadline = time.monotonic() + 60
        while not sock.poll(1000):
            assert time.monotonic() < deadline, "no controller"
            sock.send_multipart(Heartbeat().to_frames())
            probes += 1
        sock.recv_multipart()
    else:
        sock.send_multipart(Hello(args.id, f"fuzz{args.seed}", 1).to_frames())
        assert sock.poll(60_000), "no welcome"
        assert isinstance(decode_from_controller(sock.recv_multipart(), MessageLimits()), Welcome)
    sent: Counter[str] = Counter()
    t0 = time.monotonic()
    for frames, family in malformed_messages(np.random.default_rng(args.seed), args.n, limits, args.vocab, 0, args.id):
        sock.send_multipart(frames)
        sent[family] += 1
        while sock.poll(0):  # replies (error / rejected acks): read so nothing backs up
            sock.recv_multipart()
    print(json.dumps({"sent": dict(sent), "probes": probes, "seconds": time.monotonic() - t0}), flush=True)
    sock.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["fuzz"]:
        raise SystemExit("usage: fault_helpers.py fuzz --endpoint E --n N --vocab V --max-frame-bytes B")
    sys.exit(fuzz_main(sys.argv[2:]))
