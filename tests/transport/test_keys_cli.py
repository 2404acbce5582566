"""``python -m vapo_async.transport.keys DIR`` as the README writes it, and the learner's one-line
refusal of an off-loopback bind without keys (naming the keys to set)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth

SRC = Path(__file__).resolve().parents[2] / "src"


def _keys(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "vapo_async.transport.keys", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_keys_command_makes_a_deployment_and_prints_the_overrides(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    out = _keys(str(d))
    assert out.returncode == 0, out.stderr
    names = sorted(p.name for p in d.iterdir())
    assert names == ["authorized", "controller.key", "controller.key_secret", "generator.key",
                     "generator.key_secret"]
    assert [p.name for p in (d / "authorized").iterdir()] == ["generator.key"]
    # the authorised copy is the generator's public key; secrets are private to the owner
    assert zmq.auth.load_certificate(str(d / "authorized" / "generator.key"))[0] == \
        zmq.auth.load_certificate(str(d / "generator.key_secret"))[0]
    for secret in ("controller.key_secret", "generator.key_secret"):
        assert stat.S_IMODE((d / secret).stat().st_mode) == 0o600
    for line in (f"controller.transport.curve.server_secret_file={d.resolve()}/controller.key_secret",
                 f"controller.transport.curve.authorized_keys_dir={d.resolve()}/authorized",
                 f"transport.curve.server_public_file={d.resolve()}/controller.key",
                 f"transport.curve.client_secret_file={d.resolve()}/generator.key_secret"):
        assert line in out.stdout
    # more generator hosts later: the controller pair is kept, the new public keys are authorised
    again = _keys(str(d), "node-b")
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (d / "authorized").iterdir()) == ["generator.key", "node-b.key"]
    # an existing generator name is refused with one line, nothing overwritten
    before = (d / "generator.key_secret").read_bytes()
    dup = _keys(str(d), "generator")
    assert dup.returncode == 2 and dup.stderr.count("\n") == 1 and "already exist" in dup.stderr
    assert (d / "generator.key_secret").read_bytes() == before


def test_learner_refuses_an_open_bind_without_keys_naming_them(tmp_path: Path) -> None:
    from vapo_async.learner.__main__ import check_overrides
    from vapo_async.learner.config import ConfigError

    with pytest.raises(ConfigError) as e:
        check_overrides(["controller.transport.endpoint=tcp://0.0.0.0:5555"])
    msg = str(e.value)
    assert "\n" not in msg
    assert "controller.transport.curve.server_secret_file" in msg
    assert "controller.transport.curve.authorized_keys_dir" in msg
    assert "python -m vapo_async.transport.keys" in msg
    with pytest.raises(ConfigError, match=r"controller\.transport\.curve\.server_secret_file=.*not found"):
        check_overrides(["controller.transport.endpoint=tcp://0.0.0.0:5555",
                         f"controller.transport.curve.server_secret_file={tmp_path}/none.key_secret",
                         f"controller.transport.curve.authorized_keys_dir={tmp_path}"])
