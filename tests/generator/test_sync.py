"""The weight subscriber with a real engine and a real ControllerClient: bad weights are refused,
the engine keeps sampling exactly as before, and the refusals are counted by reason."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from genhelp import Published, generate
from msgspec.structs import replace

from vapo_async.common.sampling import GroupSamplingConfig
from vapo_async.generator.sync import WeightSync
from vapo_async.transport.client import ControllerClient
from vapo_async.transport.config import TransportConfig
from vapo_async.transport.messages import WeightAnnouncement

pytestmark = pytest.mark.vllm

GREEDY = GroupSamplingConfig(group_size=1, temperature=0.0, max_tokens=16)
PROMPTS = ["Question: what is 5 + 6 * 2? Step:", "Question: what is 30 + 1 * 2? Step:"]


def _tokens(engine) -> list[list[int]]:
    return [c.responses[0].token_ids.tolist() for c in generate(engine, PROMPTS, GREEDY)]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _moved(ann: WeightAnnouncement, dest: Path) -> WeightAnnouncement:
    """The same (valid) files and checksum, announced at a path outside the weights root."""
    target = dest / Path(ann.path).name
    shutil.copytree(ann.path, target)
    return replace(ann, path=str(target))


def test_bad_weights_are_refused_and_previous_weights_kept(engine, published: Published, tmp_path: Path) -> None:
    engine.reload(published.dir(1), 1)
    reference = _tokens(engine)
    cfg = TransportConfig(endpoint=f"ipc://{tmp_path}/no-controller", weights_root=str(published.root))
    client = ControllerClient(cfg, "sync-test")
    sync = WeightSync(client, engine, tmp_path / "cache", retry_s=0.0)
    try:
        flipped = published.publish(7)
        _flip_byte(Path(flipped.path) / "model.safetensors")
        truncated = published.publish(8)
        st = Path(truncated.path) / "model.safetensors"
        st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
        outside = _moved(published.publish(9), tmp_path / "elsewhere")
        _moved(published.publish(10), published.root.parent / "sibling")
        traversal = replace(published.anns[10], path=f"{published.root}/../sibling/v00000010")
        for ann in (flipped, truncated, outside, traversal):
            sync.offer(ann)
            assert sync.apply() is False
            assert engine.version == 1 and client.version == 0
            assert _tokens(engine) == reference
        assert sync.stats.refused == 4
        assert sync.stats.refused_reasons == {"checksum": 1, "size": 1, "outside_root": 2}

        good = published.publish(11)
        sync.offer(good)
        assert sync.apply() is True
        assert engine.version == 11 and client.version == 11
        after = generate(engine, PROMPTS, GREEDY)
        assert all((c.responses[0].versions == 11).all() for c in after)
        assert [c.responses[0].token_ids.tolist() for c in after] != reference
    finally:
        client.close()


def test_older_announcements_are_ignored_but_a_session_reset_goes_back(engine, published: Published,
                                                                        tmp_path: Path) -> None:
    engine.reload(published.dir(2), 2)
    cfg = TransportConfig(endpoint=f"ipc://{tmp_path}/no-controller", weights_root=str(published.root))
    client = ControllerClient(cfg, "sync-test-2")
    sync = WeightSync(client, engine, tmp_path / "cache", base_dir=published.dir(0), base_version=0)
    try:
        sync.offer(published.publish(1))
        assert not sync.pending() and sync.apply() is False  # never go back within a session
        sync.reset(1, published.anns[1])  # a learner restored from the version-1 checkpoint
        assert sync.apply() is True and engine.version == 1 and client.version == 1
        v1_tokens = _tokens(engine)
        sync.reset(0, None)  # ... or from before its first publish: the base weights
        assert sync.apply() is True and engine.version == 0
        base_tokens = _tokens(engine)
        assert base_tokens != v1_tokens
        engine.reload(published.dir(0), 0)
        assert _tokens(engine) == base_tokens
        with pytest.raises(ValueError, match="announces"):
            sync.reset(3, published.anns[1])
    finally:
        client.close()


def test_pruned_versions_and_wrong_layouts_never_reach_the_engine(engine, published: Published,
                                                                   tmp_path: Path) -> None:
    # fetch_timeout_s: a version gone from the shared directory is fetched from the controller (none here)
    cfg = TransportConfig(endpoint=f"ipc://{tmp_path}/no-controller", weights_root=str(published.root),
                          fetch_timeout_s=1.0)
    client = ControllerClient(cfg, "sync-test-3")
    sync = WeightSync(client, engine, tmp_path / "cache", base_dir=published.dir(0), retry_s=0.0)
    try:
        sync.offer(published.publish(40))
        assert sync.apply() is True
        pinned = tmp_path / "cache" / "v00000040"
        assert os.path.samefile(pinned / "model.safetensors", published.dir(40) / "model.safetensors")  # a link
        reference = _tokens(engine)
        shutil.rmtree(published.dir(40))  # the learner pruned the version the engine holds: the pin stays
        assert (pinned / "model.safetensors").stat().st_size > 0
        # verified files of the wrong layout: refused before the engine sees them (vLLM's in-place
        # reload cannot recover from a wrongly shaped tensor)
        wide = {k: v.clone() for k, v in published.base.items()}
        wide["model.norm.weight"] = torch.ones(wide["model.norm.weight"].shape[0] + 3)
        sync.offer(published.publisher.publish(41, wide))
        assert sync.apply() is False
        assert sync.stats.refused_reasons == {"layout": 1}
        assert engine.version == 40 and _tokens(engine) == reference
        # a version pruned before this generator got to it: refused, nothing loaded
        gone = published.publish(42)
        shutil.rmtree(gone.path)
        sync.offer(gone)
        assert sync.apply() is False and engine.version == 40 and _tokens(engine) == reference
        assert sync.stats.refused_reasons == {"layout": 1, "fetch_timeout": 1}
        sync.offer(published.publish(43))  # the newer version loads
        assert sync.apply() is True and engine.version == 43 and _tokens(engine) != reference
        kept = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith("v"))
        assert kept == ["v00000043"]  # the restore point of the next reload; refused pins are gone
    finally:
        client.close()
