"""The weight subscriber with a real engine and a real ControllerClient: bad weights are refused,
the engine keeps sampling exactly as before, and the refusals are counted by reason."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from genhelp import Published, generate

from vapo_async.generator.config import SamplingConfig
from vapo_async.generator.sync import WeightSync
from vapo_async.transport.client import ControllerClient
from vapo_async.transport.config import TransportConfig
from vapo_async.transport.messages import WeightAnnouncement

pytestmark = pytest.mark.vllm

GREEDY = SamplingConfig(group_size=1, temperature=0.0, max_tokens=16)
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
