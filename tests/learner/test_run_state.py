"""The run state under a real single-device Trainer: the callbacks see the module's own ``RunState``
(no attribute of the module), each batch is pulled when its step starts (never prefetched), and a
resume restores step, version and the optimiser fingerprint and goes on counting from there."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from learner_helpers import make_groups

from vapo_async.algo.presets import preset
from vapo_async.learner.checkpoint import LAST, Checkpointing
from vapo_async.learner.config import LearnerConfig
from vapo_async.learner.metrics import TensorBoardMetrics
from vapo_async.learner.module import LearnerModule
from vapo_async.learner.rollouts import RolloutBatches
from vapo_async.learner.state import RunState
from vapo_async.learner.stream import ListSource
from vapo_async.transport.batch import RolloutBatch


class RecordingSource(ListSource):
    """A ListSource that records (steps reported done, version) at every pull."""

    def __init__(self, groups: Sequence[RolloutBatch]) -> None:
        super().__init__(groups)
        self.pulls: list[tuple[int, int]] = []

    def next_batch(self, n_groups: int, timeout_s: float | None = None) -> list[RolloutBatch]:
        self.pulls.append((self.steps, self.version))
        return super().next_batch(n_groups, timeout_s)


class Seen(L.Callback):
    """What a callback built with the state reads at each step end, beside Lightning's counters."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.rows: list[tuple[int, int, int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        assert self.state.last is not None
        self.rows.append((self.state.step, self.state.version, self.state.last.step, trainer.global_step))


def _module(model_dir: Path, run_dir: Path, source: ListSource) -> LearnerModule:
    cfg = LearnerConfig()
    cfg.algo = dataclasses.replace(preset("vapo"), batch_groups=3, group_size=4, mini_batches=1, warmup_steps=0,
                                   value_warmup_steps=0, actor_lr=1e-3, critic_lr=1e-3, eta=0)
    cfg.batching.micro_batch_tokens = 64
    cfg.sampling.max_tokens = 14
    return LearnerModule(cfg, str(model_dir), run_dir, source=source)


def _trainer(steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=callbacks)


def test_callbacks_read_the_modules_state_and_batches_are_pulled_when_the_step_starts(tiny_model_dir, tmp_path):
    source = RecordingSource(make_groups(6, 4, vocab=300, seed=5))
    module = _module(tiny_model_dir, tmp_path, source)
    seen = Seen(module.state)
    metrics = TensorBoardMetrics(module.cfg.logging, tokenizer=None, state=module.state)
    trainer = _trainer(3, [metrics, seen])
    trainer.fit(module)
    module.publishing.close()
    assert metrics.state is module.state and module.rollouts.state is module.state
    # after step k (0-based): k + 1 steps done, version k + 1 (every step trains the actor), and
    # Lightning's global_step counts training steps, not the optimizer steps inside them
    assert seen.rows == [(1, 1, 0, 1), (2, 2, 1, 2), (3, 3, 2, 3)]
    # step k pulled its batch after step k - 1 was reported done with its new version: nothing
    # prefetched, and with eta = 0 the learner waited for the background writer to announce it
    assert source.pulls == [(0, 0), (1, 1), (2, 2)]
    assert module.state.last.metrics["async/staleness_mean"] == 0.0
    assert module.state.weights is not None and module.state.weights.version == 3
    assert isinstance(module.train_dataloader().dataset, RolloutBatches)


def test_resume_restores_step_version_and_fingerprint(tiny_model_dir, tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    first = _module(tiny_model_dir, tmp_path, ListSource(make_groups(6, 4, vocab=300, seed=5)))
    saver = Checkpointing(ckpt_dir, every_n_steps=1, fingerprint=True, state=first.state)
    _trainer(2, [saver]).fit(first)
    first.publishing.close()
    saved = torch.load(ckpt_dir / LAST, weights_only=True, map_location="cpu")
    assert saved["global_step"] == 2
    assert {k: saved["vapo"][k] for k in ("step", "version", "warmup_stopped_at")} == \
        {"step": 2, "version": 2, "warmup_stopped_at": None}
    assert saved["vapo"]["optimizer_sha256"] == first.state.optimizer_sha256 is not None

    source = ListSource(make_groups(6, 4, vocab=300, seed=5))
    source.version = 2  # as the restored controller: rollouts of the restored version
    second = _module(tiny_model_dir, tmp_path, source)
    resumed = Checkpointing(ckpt_dir, every_n_steps=1, fingerprint=True, state=second.state)
    seen = Seen(second.state)
    trainer = _trainer(3, [resumed, seen])
    trainer.fit(second, ckpt_path=str(ckpt_dir / LAST), weights_only=True)
    second.publishing.close()
    assert second.state.restored_optimizer_sha256 == first.state.optimizer_sha256
    assert seen.rows == [(3, 3, 2, 3)]  # one more step, counted on from the checkpoint
    assert trainer.global_step == 3
    final = torch.load(ckpt_dir / LAST, weights_only=True, map_location="cpu")
    assert final["global_step"] == 3 and final["vapo"]["step"] == 3 and final["vapo"]["version"] == 3


def test_run_state_checkpoint_section_round_trips():
    state = RunState(step=7, version=5, warmup_stopped_at=3, optimizer_sha256="ab" * 32)
    other = RunState()
    other.restore(state.to_checkpoint())
    assert (other.step, other.version, other.warmup_stopped_at) == (7, 5, 3)
    assert other.restored_optimizer_sha256 == "ab" * 32 and other.optimizer_sha256 is None
