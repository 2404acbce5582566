"""The weight relay between fetching generators: real controller, real relay servers and sockets.

Each test publishes one version (~1.2 MB in 64 KiB chunks) and has ``ControllerClient``s fetch it
into their own caches, as generators on hosts without the learner's directory do.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.relay import RelayChains
from vapo_async.controller.server import Controller
from vapo_async.transport.client import ControllerClient
from vapo_async.transport.config import CurveConfig, RelayConfig, TransportConfig
from vapo_async.transport.keys import create_keys
from vapo_async.transport.messages import RelayJoin
from vapo_async.transport.publisher import WeightPublisher
from vapo_async.transport.weights import MANIFEST

CHUNK = 64 << 10


@dataclass(frozen=True)
class _Prompt:
    prompt: str
    answer: str


@dataclass
class Served:
    ctl: Controller
    ann: object
    endpoint: str
    tmp: Path

    def client(self, name: str, stall_s: float = 5.0, **kw) -> ControllerClient:
        cfg = TransportConfig(endpoint=self.endpoint, fetch_chunk_bytes=CHUNK,
                              relay=RelayConfig(stall_s=stall_s), **kw)
        c = ControllerClient(cfg, name)
        c.connect(timeout_s=10)
        return c

    def fetched(self) -> int:
        return int(self.ctl.metrics().get("transport/fetch_bytes", 0))


@pytest.fixture()
def served(tmp_path: Path, tiny_model_dir: Path):
    pub = WeightPublisher(tmp_path / "run" / "weights", tiny_model_dir, keep=3)
    torch.manual_seed(0)
    ann = pub.publish(1, {"w": torch.randn(300_000), "b": torch.randn(7)})
    endpoint = f"ipc://{tmp_path}/ctl"
    ctl = Controller(ControllerConfig(transport=TransportConfig(endpoint=endpoint), republish_s=0.2),
                     [_Prompt("q", "a")] * 4, batch_groups=2, eta=0, vocab_size=100)
    ctl.start()
    ctl.announce(ann)
    yield Served(ctl, ann, endpoint, tmp_path)
    ctl.stop()
    pub.close()


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def _manifest_bytes(ann) -> int:
    return (Path(ann.path) / MANIFEST).stat().st_size


def test_chain_order_skips_the_dead_and_keeps_places() -> None:
    chains = RelayChains()
    alive = {b"a", b"b", b"c"}

    def join(ident: bytes, version: int = 1) -> str:
        return chains.join(ident, RelayJoin(version, f"tcp://h-{ident.decode()}:1"), alive.__contains__, {1, 2}).address

    assert join(b"a") == ""                # the first fetches from the controller
    assert join(b"b") == "tcp://h-a:1"     # then each from the one before it
    assert join(b"c") == "tcp://h-b:1"
    alive.discard(b"b")
    assert join(b"c") == "tcp://h-a:1"     # b died: c asks again and gets the live one before b
    assert join(b"a") == ""                # a asking again keeps its place: no cycle a <-> c
    assert chains.members(1) == [b"a", b"b", b"c"]
    assert join(b"c", version=2) == ""     # another version, another chain
    chains.join(b"a", RelayJoin(3, "tcp://x:1"), alive.__contains__, {3})  # 1 and 2 no longer served
    assert chains.members(1) == [] and chains.members(2) == [] and chains.members(3) == [b"a"]


def test_three_generators_in_turn_each_byte_leaves_once(served: Served) -> None:
    ann, m = served.ann, _manifest_bytes(served.ann)
    clients = [served.client(f"gen-{i}") for i in range(3)]
    try:
        for i, c in enumerate(clients):
            got = c.fetch_weights(ann, served.tmp / f"cache-{i}")
            assert _same_files(got, Path(ann.path))
        # the learner sent the version once, plus the small manifest to each later generator:
        assert served.fetched() == ann.bytes + 2 * m
        assert clients[0].fetch_stats.controller_bytes == ann.bytes and clients[0].fetch_stats.peer_bytes == 0
        for c in clients[1:]:  # gen-1 from gen-0, the late gen-2 from gen-1
            assert (c.fetch_stats.controller_bytes, c.fetch_stats.peer_bytes) == (m, ann.bytes - m)
            assert not c.fetch_stats.fallbacks
        assert clients[0].relay.counts["served_bytes"] == ann.bytes - m
        assert served.ctl.metrics()["transport/relay_peer_assigned"] == 2
    finally:
        for c in clients:
            c.close()


def test_concurrent_generators_are_pipelined_through_the_chain(served: Served) -> None:
    ann, m = served.ann, _manifest_bytes(served.ann)
    clients = [served.client(f"gen-{i}") for i in range(4)]
    results: dict[int, Path | BaseException] = {}

    def fetch(i: int) -> None:
        try:
            results[i] = clients[i].fetch_weights(ann, served.tmp / f"cache-{i}")
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert all(isinstance(results[i], Path) and _same_files(results[i], Path(ann.path)) for i in range(4)), results
        assert served.fetched() == ann.bytes + 3 * m  # 1.0x the version (+ 3 manifests) for 4 generators
        assert sum(c.fetch_stats.peer_bytes for c in clients) == 3 * (ann.bytes - m)
    finally:
        for c in clients:
            c.close()


def test_a_dead_peer_is_left_for_the_controller(served: Served) -> None:
    ann = served.ann
    a, b = served.client("gen-a"), served.client("gen-b", stall_s=1.0)
    try:
        a.fetch_weights(ann, served.tmp / "cache-a")
        a.relay.close()  # a's relay server is gone, its session is still alive: b is sent to it
        got = b.fetch_weights(ann, served.tmp / "cache-b")
        assert _same_files(got, Path(ann.path))
        assert dict(b.fetch_stats.fallbacks) == {"fetch_timeout": 1} and b.fetch_stats.peer_bytes == 0
        assert served.fetched() == 2 * ann.bytes  # the repair path sent b everything
    finally:
        a.relay = None  # closed above
        a.close()
        b.close()


def test_pruned_peer_refuses_and_corrupt_peer_bytes_are_refetched(served: Served) -> None:
    ann = served.ann
    a, b, c = served.client("gen-a"), served.client("gen-b"), served.client("gen-c")
    try:
        got_a = a.fetch_weights(ann, served.tmp / "cache-a")
        model = got_a / "model.safetensors"
        raw = bytearray(model.read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # a's copy rots after its own verification
        model.write_bytes(bytes(raw))
        got_b = b.fetch_weights(ann, served.tmp / "cache-b")  # from a: model.safetensors fails its digest
        assert _same_files(got_b, Path(ann.path))
        assert b.fetch_stats.fallbacks == {"checksum": 1}
        shutil.rmtree(got_b)  # b moved on and pruned the version: c, sent to b, is refused
        got_c = c.fetch_weights(ann, served.tmp / "cache-c")
        assert _same_files(got_c, Path(ann.path))
        assert c.fetch_stats.fallbacks == {"fetch_unavailable": 1}
        assert b.relay.counts["refused/fetch_unavailable"] >= 1
    finally:
        for x in (a, b, c):
            x.close()


def test_relay_off_fetches_everything_from_the_controller(served: Served) -> None:
    ann = served.ann
    cfgs = [TransportConfig(endpoint=served.endpoint, fetch_chunk_bytes=CHUNK, relay=RelayConfig(enabled=False))
            for _ in range(2)]
    clients = [ControllerClient(cfg, f"gen-{i}") for i, cfg in enumerate(cfgs)]
    try:
        for i, c in enumerate(clients):
            c.connect(timeout_s=10)
            c.fetch_weights(ann, served.tmp / f"cache-{i}")
            assert c.relay is None
        assert served.fetched() == 2 * ann.bytes
    finally:
        for c in clients:
            c.close()


def test_relay_over_curve_serves_only_authorized_generators(tmp_path: Path, tiny_model_dir: Path) -> None:
    keys = tmp_path / "keys"
    pairs = {n: create_keys(keys / n, n) for n in ("controller", "a", "b", "stranger")}
    authorized = keys / "authorized"
    authorized.mkdir()
    for n in ("a", "b"):
        shutil.copy(pairs[n][0], authorized / f"{n}.key")
    pub = WeightPublisher(tmp_path / "weights", tiny_model_dir, keep=2)
    ann = pub.publish(1, {"w": torch.randn(200_000)})
    endpoint = "tcp://127.0.0.1:0"
    server_curve = CurveConfig(server_secret_file=str(pairs["controller"][1]), authorized_keys_dir=str(authorized))
    ctl = Controller(ControllerConfig(transport=TransportConfig(endpoint=endpoint, curve=server_curve),
                                      republish_s=0.2), [_Prompt("q", "a")], batch_groups=1, eta=0, vocab_size=10)
    ctl.start()
    ctl.announce(ann)

    def client(name: str, allowed_dir: Path | None) -> ControllerClient:
        curve = CurveConfig(server_public_file=str(pairs["controller"][0]), client_secret_file=str(pairs[name][1]),
                            authorized_keys_dir=None if allowed_dir is None else str(allowed_dir))
        cfg = TransportConfig(endpoint=ctl.endpoint, curve=curve, fetch_chunk_bytes=CHUNK,
                              relay=RelayConfig(stall_s=1.0))
        c = ControllerClient(cfg, f"gen-{name}")
        c.connect(timeout_s=10)
        return c

    # the controller admits all three (the stranger's key is added there) but a's relay only a and b
    shutil.copy(pairs["stranger"][0], tmp_path / "stranger.key")
    ctl_keys = tmp_path / "ctl_authorized"
    shutil.copytree(authorized, ctl_keys)
    shutil.copy(pairs["stranger"][0], ctl_keys / "stranger.key")
    ctl.stop()
    server_curve.authorized_keys_dir = str(ctl_keys)
    ctl = Controller(ControllerConfig(transport=TransportConfig(endpoint=endpoint, curve=server_curve),
                                      republish_s=0.2), [_Prompt("q", "a")], batch_groups=1, eta=0, vocab_size=10)
    ctl.start()
    ctl.announce(ann)
    a, b, s = client("a", authorized), client("b", authorized), client("stranger", None)
    try:
        assert a.relay is None
        a.fetch_weights(ann, tmp_path / "cache-a")
        assert a.relay is not None and a.relay.public_key  # CURVE server key = a's own key
        got = b.fetch_weights(ann, tmp_path / "cache-b")  # b from a, encrypted, b's key admitted
        assert _same_files(got, Path(ann.path)) and b.fetch_stats.peer_bytes > 0 and not b.fetch_stats.fallbacks
        got = s.fetch_weights(ann, tmp_path / "cache-s")  # sent to b, whose relay refuses its key
        assert _same_files(got, Path(ann.path)) and s.fetch_stats.peer_bytes == 0
        assert dict(s.fetch_stats.fallbacks) == {"fetch_timeout": 1}
    finally:
        for c in (a, b, s):
            c.close()
        ctl.stop()
        pub.close()


def test_chunks_lost_between_peers_are_asked_again(served: Served) -> None:
    """Every 5th chunk from the peer is dropped on arrival (as a lossy link would): the receiver
    asks again from where its file ends and finishes from the peer, with no fallback."""
    from vapo_async.transport.fetch import FetchStats, Peer, fetch_weights
    from vapo_async.transport.messages import Chunk
    from vapo_async.transport.relay import PeerLink

    ann, m = served.ann, _manifest_bytes(served.ann)
    a, b = served.client("gen-a"), served.client("gen-b", stall_s=2.0)
    link = None
    try:
        a.fetch_weights(ann, served.tmp / "cache-a")
        link = PeerLink(b.cfg, b._ctx, a.relay.address, a.relay.public_key)
        seen = {"chunks": 0, "dropped": 0}

        def lossy_recv(timeout_ms: int):
            msg = link.recv(timeout_ms)
            if isinstance(msg, Chunk):
                seen["chunks"] += 1
                if seen["chunks"] % 5 == 0:
                    seen["dropped"] += 1
                    return None
            return msg

        stats = FetchStats()
        got = fetch_weights(b._send, b._recv_chunk, ann, served.tmp / "cache-b", b.cfg,
                            Peer(link.send, lossy_recv, link.address), None, stats)
        assert _same_files(got, Path(ann.path))
        assert seen["dropped"] >= 3 and not stats.fallbacks
        assert stats.peer_bytes == ann.bytes - m and stats.controller_bytes == m  # lost bytes came again, once
    finally:
        if link is not None:
            link.close()
        a.close()
        b.close()


def test_a_peer_this_generator_cannot_reach_safely_is_skipped(served: Served) -> None:
    """A peer with a CURVE key for a generator without keys, or a plain-text peer off loopback:
    no link is made (the fetch then goes to the controller), and the fallback is counted."""
    import zmq

    from vapo_async.transport.messages import RelayPeer

    c = served.client("gen-a")
    try:
        key = zmq.curve_keypair()[0].decode()
        assert c._peer_link(served.ann, RelayPeer(1, "tcp://127.0.0.1:9", key)) is None
        assert c._peer_link(served.ann, RelayPeer(1, "tcp://10.255.0.9:9", "")) is None
        assert c.fetch_stats.fallbacks == {"relay_link": 2}
    finally:
        c.close()
