"""Background weight publishing (learner/publish.py) and step reports (learner/reports.py), one process.

Real files, the reference safetensors reader, the real verification consumers run, the real
controller state machine. A slow writer is made by delaying the real ``write_image`` (fault
injection: everything else runs as in a run).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2ForCausalLM

import vapo_async.learner.publish as publish_mod
from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.state import ControllerState
from vapo_async.learner.publish import WeightPublishing
from vapo_async.learner.reports import StepReports
from vapo_async.transport.publisher import WeightPublishError
from vapo_async.transport.weights import MANIFEST, published_versions, verify_weights_dir


@pytest.fixture()
def actor(tiny_model_dir: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _files(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))


def _expected(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_submitted_versions_are_bit_exact_and_announced_complete(tmp_path: Path, tiny_model_dir: Path, actor,
                                                                  dtype: torch.dtype) -> None:
    pub = WeightPublishing(tmp_path / "weights", str(tiny_model_dir), keep=3, rank=0, dtype=dtype,
                           shard_bytes=400_000)  # ~2 MB of fp32: several shard files
    seen: list[tuple[int, bool]] = []
    root = (tmp_path / "weights").resolve()
    pub.on_published = lambda ann: seen.append((ann.version, verify_weights_dir(ann.path, root, ann) is not None))
    expected = {}
    for v in (1, 2):
        _perturb(actor, v)
        stall = pub.submit(actor, v)
        expected[v] = _expected(actor, dtype)  # taken now: the actor changes again right after submit
        assert stall < 5.0
    pub.flush()
    assert seen[-1] == (2, True) and all(ok for _, ok in seen)
    d = root / "v00000002"
    got = _files(d)
    assert set(got) == set(expected[2])
    for k, v in expected[2].items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert len(list(d.glob("model-*-of-*.safetensors"))) > 2
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")
    manifest = json.loads((d / MANIFEST).read_text())
    assert manifest["hash"] == "xxh3_128" and "model.safetensors.index.json" in manifest["files"]
    assert not list(root.glob(".tmp-*")) and not list(d.glob(".rank-*"))
    # transformers loads the sharded, cast version
    hf = Qwen2ForCausalLM.from_pretrained(d, dtype=torch.float32)
    for k, v in expected[2].items():
        assert torch.equal(hf.state_dict()[k], v.float()), k
    pub.close()


def test_deltas_of_sharded_bf16_versions_rebuild_them(tmp_path: Path, tiny_model_dir: Path, actor) -> None:
    """weights.delta: each shard of version 2 has a delta against version 1 that decodes to it exactly."""
    from vapo_async.transport.delta import decode_file
    from vapo_async.transport.digest import hash_file

    pub = WeightPublishing(tmp_path / "weights", str(tiny_model_dir), keep=3, rank=0, dtype=torch.bfloat16,
                           shard_bytes=200_000, delta_level=1)
    anns = []
    pub.on_published = anns.append
    for v in (1, 2):
        with torch.no_grad():  # an update a hundredth of bf16's resolution for most values: few bytes change
            for p in actor.parameters():
                p.add_(1e-5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(v)))
        pub.submit(actor, v)
        pub.flush()
    pub.close()
    root = (tmp_path / "weights").resolve()
    assert [a.delta_base for a in anns] == [-1, 1] and anns[1].delta_checksum
    shards = sorted(p.name for p in (root / "v00000002").glob("model-*.safetensors"))
    deltas = sorted(p.name for p in (root / "deltas" / "v00000002").glob("*.xor.zst"))
    assert len(shards) > 1 and deltas == [s + ".xor.zst" for s in shards]
    for s in shards:
        d = root / "deltas" / "v00000002" / (s + ".xor.zst")
        assert d.stat().st_size < (root / "v00000002" / s).stat().st_size / 3
        out = tmp_path / s
        assert decode_file(d, root / "v00000001" / s, out, "xxh3_128") == hash_file(root / "v00000002" / s, "xxh3_128")


def test_latest_wins_under_a_slow_writer(tmp_path: Path, tiny_model_dir: Path, actor,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real = publish_mod.write_image
    gate, entered = threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        entered.set()
        gate.wait(timeout=30)  # the writer is stuck on version 1 until the test lets it go
        return real(*args, **kwargs)

    monkeypatch.setattr(publish_mod, "write_image", slow)
    pub = WeightPublishing(tmp_path / "weights", str(tiny_model_dir), keep=3, rank=0)
    announced: list[int] = []
    root = (tmp_path / "weights").resolve()

    def on_published(ann) -> None:
        assert (Path(ann.path) / MANIFEST).is_file() and not list(root.glob(f".tmp-v{ann.version:08d}"))
        verify_weights_dir(ann.path, root, ann)
        announced.append(ann.version)

    pub.on_published = on_published
    t0 = time.perf_counter()
    for v in range(1, 6):
        pub.submit(actor, v)  # v1 goes to the writer; v2, v3, v4 are each replaced by the next
        assert v > 1 or entered.wait(timeout=30)
        assert not (root / f"v{v:08d}").exists()
    assert time.perf_counter() - t0 < 10, "submit waited for the writer"
    gate.set()
    pub.flush()
    assert announced == [1, 5]
    assert pub.stats.skipped == 3 and pub.stats.published == 2
    assert list(published_versions(root)) == [1, 5]
    pub.close()


def test_writer_error_is_raised_on_the_training_thread(tmp_path: Path, tiny_model_dir: Path, actor) -> None:
    root = tmp_path / "weights"
    pub = WeightPublishing(root, str(tiny_model_dir), keep=3, rank=0)
    pub.publish(actor, 1)
    (root / ".tmp-v00000002").write_text("in the way")  # version 2's directory cannot be made
    pub.submit(actor, 2)
    with pytest.raises(WeightPublishError, match="weight writer failed.*v00000002"):
        pub.flush()
    with pytest.raises(WeightPublishError):
        pub.submit(actor, 3)  # and stays failed: the run stops
    pub.close()  # already raised on the training thread: not again
    assert list(published_versions(root)) == [1]


def _controller(eta: int = 0) -> ControllerState:
    from vapo_async.data import PromptRecord

    prompts = [PromptRecord(prompt=f"q{i}", answer=str(i), uid=f"t:{i}") for i in range(8)]
    return ControllerState(ControllerConfig(), prompts, batch_groups=2, eta=eta, vocab_size=100, controller_id="t")


def test_step_reports_wait_for_their_version(tmp_path: Path, tiny_model_dir: Path, actor) -> None:
    from vapo_async.transport.publisher import WeightPublisher

    pub = WeightPublisher(tmp_path / "w", tiny_model_dir, keep=10)
    anns = {v: pub.publish(v, {"w": torch.full((2,), float(v))}) for v in range(4)}
    state = _controller()
    state.announce(anns[0])
    reports = StepReports(state, announced=0)
    reports.add(1, trained=2)  # step 0 made version 1, not written yet: admission does not move
    assert state.admission.steps_done == 0 and reports.waiting() == 1
    reports.add(None, trained=2)  # step 1 made no version (a skipped batch): waits behind step 0
    assert state.admission.steps_done == 0 and reports.waiting() == 2
    reports.published(anns[1])  # both released, version 1 announced before the slots open
    assert state.admission.steps_done == 2 and state.version == 1
    reports.add(2, trained=2)
    reports.add(3, trained=1)  # version 2 is skipped (latest wins): version 3 releases both
    reports.published(anns[3])
    assert state.admission.steps_done == 4 and state.version == 3 and state.admission.shortfall == 1
    with pytest.raises(ValueError, match="published after version 3"):
        reports.published(anns[2])


def test_a_version_written_before_its_step_reports_is_announced_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    from vapo_async.transport.publisher import WeightPublisher

    pub = WeightPublisher(tmp_path / "w", tiny_model_dir, keep=10)
    a0, a1 = (pub.publish(v, {"w": torch.zeros(2)}) for v in (0, 1))
    state = _controller()
    state.announce(a0)
    reports = StepReports(state, announced=0)
    reports.published(a1)  # the writer was faster than the training thread's report
    assert state.version == 1 and state.admission.steps_done == 0
    reports.add(1, trained=2)
    assert state.admission.steps_done == 1 and reports.waiting() == 0
