"""Delta-encoded weight versions: the codec, the publisher's deltas, and fetches that use them
(real controller, real ZeroMQ fetches; a generator holding the previous version)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.server import Controller
from vapo_async.transport.client import ControllerClient
from vapo_async.transport.config import RelayConfig, TransportConfig
from vapo_async.transport.delta import decode_file, encode_file
from vapo_async.transport.digest import hash_file
from vapo_async.transport.publisher import WeightPublisher
from vapo_async.transport.weights import WeightsError, deltas_dir

CHUNK = 64 << 10


@dataclass(frozen=True)
class _Prompt:
    prompt: str
    answer: str


def _weights(seed: int, step: float = 0.0) -> dict[str, torch.Tensor]:
    """A 'model' and, with ``step``, the same model after one small update of a tenth of its values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(200_000, generator=g)
    if step:
        w[::10] += step * torch.randn(20_000, generator=g)
    return {"w": w, "b": torch.zeros(8)}


def test_codec_round_trip_and_refusals(tmp_path: Path) -> None:
    save_file(_weights(0), tmp_path / "a.safetensors")
    save_file(_weights(0, step=1e-3), tmp_path / "b.safetensors")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    n, digest = encode_file(b, a, tmp_path / "d.zst", "xxh3_128")
    assert (n, digest) == ((tmp_path / "d.zst").stat().st_size, hash_file(tmp_path / "d.zst", "xxh3_128"))
    # 9 values in 10 are unchanged: their XOR is 0 and compresses away; the file is 800 kB
    assert n < b.stat().st_size / 4
    assert decode_file(tmp_path / "d.zst", a, tmp_path / "out", "xxh3_128") == hash_file(b, "xxh3_128")
    assert (tmp_path / "out").read_bytes() == b.read_bytes()
    # against another base the bytes come out wrong: the digest says so (fetch.py then fetches whole)
    save_file(_weights(1), tmp_path / "c.safetensors")
    assert decode_file(tmp_path / "d.zst", tmp_path / "c.safetensors", tmp_path / "out", "xxh3_128") != \
        hash_file(b, "xxh3_128")
    (tmp_path / "bad.zst").write_bytes(b"not zstd at all")
    with pytest.raises(WeightsError, match="zstd"):
        decode_file(tmp_path / "bad.zst", a, tmp_path / "out", "xxh3_128")
    save_file({"w": torch.zeros(10)}, tmp_path / "small.safetensors")
    with pytest.raises(WeightsError, match="decodes to"):  # a delta of an 800 kB file against a tiny base
        decode_file(tmp_path / "d.zst", tmp_path / "small.safetensors", tmp_path / "out", "xxh3_128")


@pytest.fixture()
def served(tmp_path: Path, tiny_model_dir: Path):
    """Versions 1 and 2 (one small update apart) published with deltas, behind a controller."""
    pub = WeightPublisher(tmp_path / "run" / "weights", tiny_model_dir, keep=3, delta_level=3)
    ann1 = pub.publish(1, _weights(0))
    ann2 = pub.publish(2, _weights(0, step=1e-3))
    endpoint = f"ipc://{tmp_path}/ctl"
    ctl = Controller(ControllerConfig(transport=TransportConfig(endpoint=endpoint), republish_s=0.2),
                     [_Prompt("q", "a")] * 4, batch_groups=2, eta=0, vocab_size=100)
    ctl.start()
    yield ctl, pub, ann1, ann2, endpoint
    ctl.stop()
    pub.close()


def _client(endpoint: str) -> ControllerClient:
    c = ControllerClient(TransportConfig(endpoint=endpoint, fetch_chunk_bytes=CHUNK, relay=RelayConfig(enabled=False)),
                         "gen-0")
    c.connect(timeout_s=10)
    return c


def test_publisher_writes_deltas_against_the_previous_version(served) -> None:
    _, pub, ann1, ann2, _ = served
    assert (ann1.delta_base, ann1.delta_checksum) == (-1, "")  # nothing before version 1 on disk
    assert ann2.delta_base == 1 and len(ann2.delta_checksum) == 64
    d = deltas_dir(pub.root, 2)
    assert sorted(p.name for p in d.iterdir()) == ["DELTA.json", "model.safetensors.xor.zst"]
    for v in (3, 4, 5):  # keep=3: versions 1 and 2 and their deltas are pruned with them
        pub.publish(v, _weights(0, step=1e-3 * v))
    assert sorted(p.name for p in (pub.root / "deltas").iterdir()) == ["v00000003", "v00000004", "v00000005"]


def test_a_generator_holding_the_base_fetches_the_delta(served, tmp_path: Path) -> None:
    ctl, _, ann1, ann2, endpoint = served
    client = _client(endpoint)
    try:
        ctl.announce(ann1)
        client.fetch_weights(ann1, tmp_path / "cache")
        before = ctl.metrics()["transport/fetch_bytes"]
        ctl.announce(ann2)
        got = client.fetch_weights(ann2, tmp_path / "cache")
        sent = ctl.metrics()["transport/fetch_bytes"] - before
        model = Path(ann2.path) / "model.safetensors"
        assert (got / "model.safetensors").read_bytes() == model.read_bytes()
        assert client.fetch_stats.delta_files == 1 and not client.fetch_stats.fallbacks
        assert sent < ann2.bytes - model.stat().st_size * 3 / 4  # the model file travelled as < 1/4 of itself
        assert not (tmp_path / "cache" / ".delta-v00000002").exists()
    finally:
        client.close()


def test_a_generator_without_the_base_or_with_a_rotten_one_fetches_whole(served, tmp_path: Path) -> None:
    ctl, _, ann1, ann2, endpoint = served
    ctl.announce(ann1)
    ctl.announce(ann2)  # both are served
    fresh = _client(endpoint)
    try:
        fresh.fetch_weights(ann2, tmp_path / "fresh")  # holds no version 1: the whole files, no fallback
        assert fresh.fetch_stats.delta_files == 0 and not fresh.fetch_stats.fallbacks
    finally:
        fresh.close()
    client = _client(endpoint)
    try:
        v1 = client.fetch_weights(ann1, tmp_path / "cache")
        raw = bytearray((v1 / "model.safetensors").read_bytes())
        raw[-100] ^= 0x01  # its copy of version 1 rots after verification
        (v1 / "model.safetensors").write_bytes(bytes(raw))
        got = client.fetch_weights(ann2, tmp_path / "cache")
        assert (got / "model.safetensors").read_bytes() == (Path(ann2.path) / "model.safetensors").read_bytes()
        assert client.fetch_stats.fallbacks == {"delta": 1} and client.fetch_stats.delta_files == 0
    finally:
        client.close()
