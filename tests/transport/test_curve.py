"""CURVE authentication and the loopback/insecure rules, with real sockets on 127.0.0.1."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.server import Controller
from vapo_async.transport.client import ControllerClient
from vapo_async.transport.config import CurveConfig, TransportConfig
from vapo_async.transport.keys import create_keys
from vapo_async.transport.messages import WeightAnnouncement
from vapo_async.transport.sockets import InsecureEndpointError, is_local_endpoint


@dataclass(frozen=True)
class _Prompt:
    prompt: str
    answer: str


@pytest.mark.parametrize("endpoint,local", [
    ("ipc:///tmp/x", True), ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:1", True),
    ("tcp://localhost:5555", True), ("tcp://[::1]:5555", True), ("tcp://0.0.0.0:5555", False),
    ("tcp://*:5555", False), ("tcp://10.0.0.7:5555", False), ("tcp://node12:5555", False),
    ("tcp://eth0:5555", False),
])
def test_endpoint_classification(endpoint: str, local: bool) -> None:
    assert is_local_endpoint(endpoint) is local


def _controller(endpoint: str, curve: CurveConfig | None = None, allow_insecure: bool = False) -> Controller:
    t = TransportConfig(endpoint=endpoint, curve=curve or CurveConfig(), allow_insecure=allow_insecure)
    return Controller(ControllerConfig(transport=t, republish_s=0.2), [_Prompt("q", "a")], batch_groups=1, eta=0,
                      vocab_size=10)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("controller", "good", "stranger"):
        out[name + ".key"], out[name + ".key_secret"] = create_keys(d / name, name)
    authorized = d / "authorized"
    authorized.mkdir()
    (authorized / "good.key").write_bytes(out["good.key"].read_bytes())
    out["authorized"] = authorized
    return out


def test_curve_on_loopback_admits_only_authorised_keys(keys: dict[str, Path]) -> None:
    server = CurveConfig(server_secret_file=str(keys["controller.key_secret"]),
                         authorized_keys_dir=str(keys["authorized"]), force=True)
    ctl = _controller("tcp://127.0.0.1:*", server)
    ctl.start()
    try:
        def client(secret: str | None, force: bool = False) -> ControllerClient:
            curve = CurveConfig(server_public_file=str(keys["controller.key"]), client_secret_file=secret, force=force)
            return ControllerClient(TransportConfig(endpoint=ctl.endpoint, curve=curve), f"g{time.monotonic_ns()}")

        good = client(str(keys["good.key_secret"]))
        welcome = good.connect(timeout_s=10)
        assert welcome.vocab_size == 10
        for refused in (client(str(keys["stranger.key_secret"])), client(None)):  # unknown key; no CURVE at all
            with pytest.raises(TimeoutError, match="CURVE keys refused"):
                refused.connect(timeout_s=1.0)
            refused.close()
        with pytest.raises(InsecureEndpointError, match="force"):
            client(None, force=True)
        ann = WeightAnnouncement(1, "/w/v00000001", "a" * 64, 1, ())
        ctl.announce(ann)  # the PUB socket is CURVE-protected too: the good client still gets it
        got = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got = [m for m in good.poll(50) if isinstance(m, WeightAnnouncement)]
        assert got == [ann]
        assert ctl.metrics()["controller/generators"] == 1
        good.close()
    finally:
        ctl.stop()


def test_a_key_copied_in_later_is_admitted_without_a_restart(keys: dict[str, Path], tmp_path: Path) -> None:
    """The controller re-reads authorized_keys_dir when it changes: a generator host added while the
    learner runs joins; removing its key refuses its next connection."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    server = CurveConfig(server_secret_file=str(keys["controller.key_secret"]), authorized_keys_dir=str(authorized),
                         force=True)
    ctl = _controller("tcp://127.0.0.1:*", server)
    ctl.start()
    try:
        def connect(timeout_s: float) -> None:
            curve = CurveConfig(server_public_file=str(keys["controller.key"]),
                                client_secret_file=str(keys["stranger.key_secret"]))
            c = ControllerClient(TransportConfig(endpoint=ctl.endpoint, curve=curve), f"g{time.monotonic_ns()}")
            try:
                c.connect(timeout_s=timeout_s)
            finally:
                c.close()

        with pytest.raises(TimeoutError, match="CURVE keys refused"):
            connect(1.0)  # not authorised yet
        (authorized / "stranger.key").write_bytes(keys["stranger.key"].read_bytes())
        connect(10.0)  # copied in while the controller runs: admitted
        (authorized / "stranger.key").unlink()
        with pytest.raises(TimeoutError, match="CURVE keys refused"):
            connect(1.0)
    finally:
        ctl.stop()


def test_refuses_to_bind_off_loopback_without_keys(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(InsecureEndpointError, match="allow_insecure"):
        _controller("tcp://0.0.0.0:*").start()
    with caplog.at_level(logging.WARNING):
        ctl = _controller("tcp://0.0.0.0:*", allow_insecure=True)
        ctl.start()
        ctl.stop()
    assert any("INSECURE" in r.message for r in caplog.records)


def test_client_refuses_remote_endpoint_without_keys() -> None:
    with pytest.raises(InsecureEndpointError, match="connect"):
        ControllerClient(TransportConfig(endpoint="tcp://10.255.255.1:5555"), "g0")


def test_missing_key_files_are_named(tmp_path: Path) -> None:
    server = CurveConfig(server_secret_file=str(tmp_path / "nope.key_secret"), authorized_keys_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nope.key_secret"):
        _controller("tcp://127.0.0.1:*", server).start()
