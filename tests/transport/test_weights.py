"""Weight publishing and verification: real files, the reference safetensors reader, transformers."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from vapo_async.transport import safetensors_io
from vapo_async.transport.digest import hash_bytes
from vapo_async.transport.messages import WeightAnnouncement
from vapo_async.transport.publisher import WeightPublisher, WeightPublishError
from vapo_async.transport.weights import (
    MANIFEST,
    WeightsError,
    latest_published,
    verify_weights_dir,
)


@pytest.fixture(scope="module")
def model_sd(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    """State dict of the tiny model with its weights perturbed (so it differs from the base)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    return {k: v.detach() + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}


def _load_published(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("shard_bytes", [4 << 30, 300_000])
def test_publish_loads_in_transformers_bit_exact(tmp_path: Path, tiny_model_dir: Path, model_sd, shard_bytes: int) -> None:
    pub = WeightPublisher(tmp_path / "weights", tiny_model_dir, keep=2, shard_bytes=shard_bytes)
    ann = pub.publish(3, model_sd)
    d = Path(ann.path)
    assert d == (tmp_path / "weights" / "v00000003").resolve()
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    if shard_bytes == 4 << 30:
        assert shards == ["model.safetensors"]
    else:  # ~2 MB of fp32 weights in 300 KB shards
        assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(model_sd)
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(ann.files)
    assert verify_weights_dir(d, tmp_path / "weights", ann) == d
    loaded = _load_published(d)
    assert set(loaded) == set(model_sd)
    for k, v in model_sd.items():
        assert torch.equal(loaded[k], v), k
    assert ann.bytes == sum((d / f).stat().st_size for f in [*ann.files, MANIFEST])
    assert latest_published(tmp_path / "weights") == ann
    pub.close()


def test_safetensors_writer_matches_reference_reader(tmp_path: Path) -> None:
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f16": torch.randn(7).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6).t(),  # non-contiguous input
    }
    tensors["tied"] = tensors["f16"]  # shared storage: written twice, read back equal
    n, digest = safetensors_io.write_safetensors(tmp_path / "x.safetensors", tensors)
    assert n == (tmp_path / "x.safetensors").stat().st_size
    assert digest == hash_bytes((tmp_path / "x.safetensors").read_bytes(), "xxh3_128")
    n, digest = safetensors_io.write_safetensors(tmp_path / "x.safetensors", tensors, "sha256")
    import hashlib
    assert digest == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for k, v in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k


def test_read_layout_matches_reference_reader_and_names_bad_headers(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(5)}, str(tmp_path / "model-1.safetensors"))
    save_file({"c": torch.zeros(())}, str(tmp_path / "model-2.safetensors"))  # written by the reference
    layout = safetensors_io.read_layout(tmp_path)
    assert layout == {"a": (2, 3), "b": (5,), "c": ()}
    assert safetensors_io.layout_mismatch(layout, dict(layout)) == ""
    moved = {"a": (3, 2), "b": (5,), "d": (1,)}
    assert safetensors_io.layout_mismatch(layout, moved) == "missing ['c']; unexpected ['d']; a [3, 2] != [2, 3]"
    save_file({"b": torch.zeros(5)}, str(tmp_path / "model-3.safetensors"))
    with pytest.raises(ValueError, match=r"model-3.safetensors: tensors \['b'\] also appear"):
        safetensors_io.read_layout(tmp_path)
    (tmp_path / "model-3.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="model-3.safetensors: not a safetensors file"):
        safetensors_io.read_layout(tmp_path)
    (tmp_path / "model-3.safetensors").write_bytes((4).to_bytes(8, "little") + b"{oops")
    with pytest.raises(ValueError, match="model-3.safetensors: malformed safetensors header"):
        safetensors_io.read_layout(tmp_path)
    # with an index, only the shards it names count (model-3 is some other export beside them)
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-1.safetensors", "c": "model-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert safetensors_io.read_layout(tmp_path) == layout
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(ValueError, match="outside the directory"):
        safetensors_io.read_layout(tmp_path)
    assert safetensors_io.read_layout(tmp_path / "nothing-here") == {}


def test_keeps_last_k_versions_and_never_the_new_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    sd = {"w": torch.ones(4)}
    pub = WeightPublisher(tmp_path, tiny_model_dir, keep=2)
    for v in (1, 2, 3, 5):
        pub.publish(v, sd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003", "v00000005"]
    pub.publish(4, sd)  # out of order: still kept although it sorts below v5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000004", "v00000005"]
    with pytest.raises(WeightPublishError, match="already exists"):
        pub.publish(5, sd)
    with pytest.raises(ValueError, match="keep must be >= 2"):
        WeightPublisher(tmp_path, tiny_model_dir, keep=1)


@pytest.fixture()
def published(tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, WeightAnnouncement]:
    root = tmp_path / "weights"
    ann = WeightPublisher(root, tiny_model_dir, keep=2).publish(1, {"w": torch.arange(100.0)})
    return root, ann


def test_traversal_and_symlinks_refused(tmp_path: Path, published) -> None:
    root, ann = published
    outside = tmp_path / "elsewhere" / "v00000001"
    shutil.copytree(ann.path, outside)
    for path in (outside, root / ".." / "elsewhere" / "v00000001", root / "v00000001" / ".." / ".." / "elsewhere" / "v00000001"):
        with pytest.raises(WeightsError, match="outside_root"):
            verify_weights_dir(path, root, ann)
    (root / "v00000009").symlink_to(outside, target_is_directory=True)  # a link inside root pointing out
    with pytest.raises(WeightsError, match="symlink"):
        verify_weights_dir(root / "v00000009", root, WeightAnnouncement(9, "", ann.checksum, 0, ann.files))
    with pytest.raises(WeightsError, match="outside_root"):  # right root, wrong version directory
        verify_weights_dir(root / "v00000001", root, WeightAnnouncement(2, "", ann.checksum, 0, ann.files))


@pytest.mark.parametrize("damage,reason", [
    ("flip_byte", "checksum"), ("truncate", "size"), ("extra_file", "unexpected_files"),
    ("file_symlink", "symlink"), ("manifest_edit", "checksum"), ("wrong_announced_checksum", "checksum"),
])
def test_corrupted_weights_refused(published, damage: str, reason: str) -> None:
    root, ann = published
    d = Path(ann.path)
    model = d / "model.safetensors"
    if damage == "flip_byte":
        raw = bytearray(model.read_bytes())
        raw[-5] ^= 0xFF
        model.write_bytes(bytes(raw))
    elif damage == "truncate":
        model.write_bytes(model.read_bytes()[:-8])
    elif damage == "extra_file":
        (d / "evil.safetensors").write_bytes(b"x")
    elif damage == "file_symlink":
        target = root.parent / "copy.safetensors"
        shutil.copy(model, target)
        model.unlink()
        model.symlink_to(target)
    elif damage == "manifest_edit":
        (d / MANIFEST).write_text((d / MANIFEST).read_text().replace('"version": 1', '"version": 1 '))
    else:
        ann = WeightAnnouncement(ann.version, ann.path, "0" * 64, ann.bytes, ann.files)
    with pytest.raises(WeightsError) as e:
        verify_weights_dir(d, root, ann)
    assert e.value.reason == reason


def _no_partial_left(root: Path) -> None:
    assert [p.name for p in root.iterdir()] == [], "a partial or temporary directory was left behind"
    assert latest_published(root) is None


def test_disk_full_on_a_tiny_tmpfs_leaves_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); test_disk_full_simulated covers ENOSPC")
    try:
        pub = WeightPublisher(mnt, tiny_model_dir, keep=2)
        with pytest.raises(WeightPublishError, match="No space left on device"):
            pub.publish(1, {"w": torch.zeros(1 << 20)})  # 4 MB into 256 KB
        _no_partial_left(mnt)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(WeightPublishError, match="Read-only file system"):
            pub.publish(1, {"w": torch.zeros(10)})
        _no_partial_left(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_disk_full_simulated(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC injected at the lowest write (only for the disk-full case; everything else is real)."""
    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    pub = WeightPublisher(tmp_path, tiny_model_dir, keep=2)
    monkeypatch.setattr(safetensors_io, "write_safetensors", lambda path, *a: (path.write_bytes(b"x"), full()))
    with pytest.raises(WeightPublishError, match="could not publish weights version 1"):
        pub.publish(1, {"w": torch.zeros(10)})
    _no_partial_left(tmp_path)


def test_resolve_weights_pins_hard_links_and_verifies_them(tmp_path: Path, tiny_model_dir: Path,
                                                          caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from vapo_async.transport.client import ControllerClient
    from vapo_async.transport.config import TransportConfig

    root, cache = tmp_path / "weights", tmp_path / "cache"
    pub = WeightPublisher(root, tiny_model_dir, keep=2)
    client = ControllerClient(TransportConfig(endpoint=f"ipc://{tmp_path}/none", weights_root=str(root)), "pin")
    try:
        ann1 = pub.publish(1, {"w": torch.ones(4)})
        pinned = client.resolve_weights(ann1, cache)
        assert pinned == cache / "v00000001"
        assert os.path.samefile(pinned / "model.safetensors", Path(ann1.path) / "model.safetensors")
        pub.publish(2, {"w": torch.ones(4)})
        pub.publish(3, {"w": torch.ones(4)})  # keep=2: the learner prunes v1 ...
        assert not Path(ann1.path).exists()
        assert verify_weights_dir(pinned, cache, ann1) == pinned  # ... the pinned links still verify
        # a directory caught half pruned: the links are what is verified, and they are incomplete
        ann4 = pub.publish(4, {"w": torch.ones(4)})
        (Path(ann4.path) / "model.safetensors").unlink()
        with pytest.raises(WeightsError) as e:
            client.resolve_weights(ann4, cache)
        assert e.value.reason == "unexpected_files"
        with pytest.raises(ValueError, match="is the learner's weights directory"):
            client.resolve_weights(pub.publish(5, {"w": torch.ones(4)}), root)
        # no hard links (another filesystem): the learner's directory itself, one warning
        monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EXDEV, "cross-device")))
        ann6 = pub.publish(6, {"w": torch.ones(4)})
        with caplog.at_level("WARNING"):
            assert client.resolve_weights(ann6, cache) == Path(ann6.path)
            assert client.resolve_weights(ann6, cache) == Path(ann6.path)
        assert sum("cannot hard-link" in r.message for r in caplog.records) == 1
    finally:
        client.close()
        pub.close()


def test_plan_files_cuts_by_rank_then_by_size() -> None:
    f32 = torch.float32
    # 6 tensors of 400 bytes (100 fp32 each) = 2400 bytes; 2 ranks hold 1200 bytes each
    specs = [(f"t{i}", f32, (100,)) for i in range(6)]
    plan = safetensors_io.plan_files(specs, ranks=2, shard_bytes=1 << 20)
    assert [(f.name, f.rank, [e.name for e in f.entries]) for f in plan] == [
        ("model-00001-of-00002.safetensors", 0, ["t0", "t1", "t2"]),
        ("model-00002-of-00002.safetensors", 1, ["t3", "t4", "t5"])]
    # each rank's run cut again at 800 bytes: 2 tensors per file
    plan = safetensors_io.plan_files(specs, ranks=2, shard_bytes=800)
    assert [(f.rank, len(f.entries)) for f in plan] == [(0, 2), (0, 1), (1, 2), (1, 1)]
    assert plan[-1].name == "model-00004-of-00004.safetensors"
    assert safetensors_io.plan_files(specs, ranks=1)[0].name == "model.safetensors"
    # offsets follow the header: data_offsets of t1 are [400, 800] in its file
    f = safetensors_io.plan_files(specs, ranks=1)[0]
    assert [(e.begin, e.end) for e in f.entries[:2]] == [(0, 400), (400, 800)] and f.data_bytes == 2400
    assert len(f.header) % 8 == 0 and f.total_bytes == len(f.header) + 2400


def test_a_format_1_manifest_is_still_verified(published) -> None:
    """Directories written before issue 18 (sha256 digests under the key ``sha256``) still load."""
    import hashlib

    root, ann = published
    d = Path(ann.path)
    files = {n: {"bytes": (d / n).stat().st_size, "sha256": hashlib.sha256((d / n).read_bytes()).hexdigest()}
             for n in ann.files}
    raw = json.dumps({"format": "vapo_async.weights/1", "version": 1, "files": files}, indent=1, sort_keys=True).encode()
    (d / MANIFEST).write_bytes(raw)
    old = WeightAnnouncement(1, ann.path, hashlib.sha256(raw).hexdigest(), ann.bytes, ann.files)
    assert verify_weights_dir(d, root, old) == d
    raw_model = bytearray((d / "model.safetensors").read_bytes())
    raw_model[-3] ^= 1
    (d / "model.safetensors").write_bytes(bytes(raw_model))
    with pytest.raises(WeightsError, match="does not match its sha256"):
        verify_weights_dir(d, root, old)
