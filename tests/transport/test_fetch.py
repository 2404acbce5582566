"""Weight announcement and chunked fetch through a real controller over ipc."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.server import Controller
from vapo_async.transport.client import ControllerClient
from vapo_async.transport.config import TransportConfig
from vapo_async.transport.messages import Lease, WeightAnnouncement
from vapo_async.transport.publisher import WeightPublisher
from vapo_async.transport.weights import MANIFEST, WeightsError

CHUNK = 64 << 10


@dataclass(frozen=True)
class _Prompt:
    prompt: str
    answer: str


@pytest.fixture()
def served(tmp_path: Path, tiny_model_dir: Path):
    """A controller announcing version 1 (~2 MB: the tiny model, perturbed) and a connected client."""
    root = tmp_path / "run" / "weights"
    pub = WeightPublisher(root, tiny_model_dir, keep=3)
    torch.manual_seed(0)
    ann = pub.publish(1, {"w": torch.randn(300_000), "b": torch.randn(7)})
    endpoint = f"ipc://{tmp_path}/ctl"
    ctl = Controller(ControllerConfig(transport=TransportConfig(endpoint=endpoint), republish_s=0.2),
                     [_Prompt("q", "a")] * 4, batch_groups=2, eta=0, vocab_size=100)
    ctl.start()
    ctl.announce(ann)
    client = ControllerClient(TransportConfig(endpoint=endpoint, fetch_chunk_bytes=CHUNK), "gen-0")
    welcome = client.connect(timeout_s=10)
    assert welcome.weights == ann and Path(welcome.weights_root) == root.resolve()
    yield ctl, client, pub, ann
    client.close()
    ctl.stop()
    pub.close()


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_fetch_in_chunks_is_verified_and_identical(served, tmp_path: Path) -> None:
    ctl, client, _, ann = served
    got = client.fetch_weights(ann, tmp_path / "local")
    assert got == (tmp_path / "local" / "v00000001").resolve()
    assert _same_files(got, Path(ann.path))
    assert ctl.metrics()["transport/fetch_bytes"] == ann.bytes  # every byte exactly once
    assert not (tmp_path / "local" / ".part-v00000001").exists()
    again = client.fetch_weights(ann, tmp_path / "local")  # already there: verified, not refetched
    assert again == got and ctl.metrics()["transport/fetch_bytes"] == ann.bytes


def test_fetch_resumes_a_partial_download(served, tmp_path: Path) -> None:
    ctl, client, _, ann = served
    src = Path(ann.path)
    part = tmp_path / "local" / ".part-v00000001"
    part.mkdir(parents=True)
    shutil.copy(src / MANIFEST, part / MANIFEST)
    model = (src / "model.safetensors").read_bytes()
    (part / "model.safetensors").write_bytes(model[: len(model) // 2])  # an interrupted fetch
    got = client.fetch_weights(ann, tmp_path / "local")
    assert _same_files(got, src)
    # only the missing half of the model and the other files travelled
    skipped = (src / MANIFEST).stat().st_size + len(model) // 2
    assert ctl.metrics()["transport/fetch_bytes"] == ann.bytes - skipped


def test_fetch_refuses_corrupt_source_and_unknown_version(served, tmp_path: Path) -> None:
    _, client, _, ann = served
    model = Path(ann.path) / "model.safetensors"
    raw = bytearray(model.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    model.write_bytes(bytes(raw))
    with pytest.raises(WeightsError) as e:
        client.fetch_weights(ann, tmp_path / "local")
    assert e.value.reason == "checksum"
    assert not (tmp_path / "local" / "v00000001").exists()
    with pytest.raises(WeightsError, match="fetch_unknown_version"):
        client.fetch_weights(WeightAnnouncement(9, ann.path, ann.checksum, ann.bytes, ann.files), tmp_path / "x")


def test_resolve_uses_readable_path_and_refuses_traversal(served, tmp_path: Path) -> None:
    ctl, client, _, ann = served
    pinned = client.resolve_weights(ann, tmp_path / "local")  # hard links to the readable path
    assert pinned == tmp_path / "local" / "v00000001"
    assert os.path.samefile(pinned / "model.safetensors", Path(ann.path) / "model.safetensors")
    assert ctl.metrics().get("transport/fetch_bytes", 0) == 0  # shared filesystem: no fetch
    outside = tmp_path / "elsewhere" / "v00000001"
    shutil.copytree(ann.path, outside)
    evil = WeightAnnouncement(1, str(Path(client.weights_root()) / ".." / ".." / "elsewhere" / "v00000001"),
                              ann.checksum, ann.bytes, ann.files)
    with pytest.raises(WeightsError, match="outside_root"):
        client.resolve_weights(evil, tmp_path / "local")


def test_announcements_reach_generators_by_pub_and_by_lease(served) -> None:
    ctl, client, pub, _ = served
    ann2 = pub.publish(2, {"w": torch.zeros(10)})
    ctl.announce(ann2)
    client.request(1)
    seen: dict[type, object] = {}
    deadline = time.monotonic() + 5
    while len(seen) < 2 and time.monotonic() < deadline:
        for msg in client.poll(50):
            seen[type(msg)] = msg
    assert seen[WeightAnnouncement] == ann2  # sent at once, and re-sent every 0.2 s for late SUBs
    lease = seen[Lease]
    assert isinstance(lease, Lease) and lease.min_version == 2 and lease.weights == ann2
