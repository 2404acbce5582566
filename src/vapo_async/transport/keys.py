"""CURVE key files for the transport: ``python -m vapo_async.transport.keys DIR [NAME ...]``.

    python -m vapo_async.transport.keys keys/                  # controller + one "generator" pair
    python -m vapo_async.transport.keys keys/ node-a node-b    # a pair per generator host

Creates ``DIR/controller.key`` (public) and ``DIR/controller.key_secret`` (public + secret, mode
0600) unless they exist, a pair ``DIR/NAME.key`` / ``DIR/NAME.key_secret`` per generator NAME
(default: one named ``generator``), and copies each generator's public key into
``DIR/authorized/``, the directory the controller admits. It then prints the overrides each side
types. What travels to a generator host: ``controller.key`` and that host's ``NAME.key_secret``;
the controller's secret and the other hosts' secrets stay where they are.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import zmq.auth

CONTROLLER = "controller"
"""Name of the controller's key pair."""
AUTHORIZED = "authorized"
"""Sub-directory of the generators' public keys (``controller.transport.curve.authorized_keys_dir``)."""


def create_keys(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Create a CURVE key pair; returns (public_file, secret_file). Refuses to overwrite."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if (d / f"{name}.key").exists() or (d / f"{name}.key_secret").exists():
        raise FileExistsError(f"CURVE keys for {name!r} already exist in {d}")
    public, secret = zmq.auth.create_certificates(str(d), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def create_deployment(directory: str | Path, generators: list[str]) -> dict[str, Path]:
    """The controller's pair (kept when it exists), one pair per generator name (refused when it
    exists) and ``directory/authorized/NAME.key`` for each. Returns the files by role."""
    d = Path(directory).resolve()
    if CONTROLLER in generators:
        raise ValueError(f"{CONTROLLER!r} names the controller's own pair; choose other generator names")
    if not (d / f"{CONTROLLER}.key_secret").is_file():
        create_keys(d, CONTROLLER)
    (d / AUTHORIZED).mkdir(exist_ok=True)
    out = {"controller_secret": d / f"{CONTROLLER}.key_secret", "controller_public": d / f"{CONTROLLER}.key",
           "authorized": d / AUTHORIZED}
    for name in generators:
        public, secret = create_keys(d, name)
        shutil.copyfile(public, d / AUTHORIZED / public.name)
        out[f"{name}_secret"] = secret
    return out


def usage(files: dict[str, Path], generators: list[str]) -> str:
    """The overrides each side types, for the files ``create_deployment`` made."""
    lines = [
        "learner (binds; copy nothing):",
        f"  controller.transport.curve.server_secret_file={files['controller_secret']}",
        f"  controller.transport.curve.authorized_keys_dir={files['authorized']}",
    ]
    for name in generators:
        lines += [
            f"generator {name} (copy {files['controller_public'].name} and {name}.key_secret to its host):",
            f"  transport.curve.server_public_file={files['controller_public']}",
            f"  transport.curve.client_secret_file={files[f'{name}_secret']}",
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """CLI entry point."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 0 if argv else 2
    generators = argv[1:] or ["generator"]
    try:
        files = create_deployment(argv[0], generators)
    except (FileExistsError, ValueError) as e:
        print(f"vapo_async.transport.keys: error: {e}", file=sys.stderr)
        return 2
    print(usage(files, generators))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
