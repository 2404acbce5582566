"""CURVE key files for the transport: ``python -m vapo_async.transport.keys DIR NAME [NAME ...]``.

Creates ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (public + secret, mode 0600) per
name with ``zmq.auth.create_certificates``. Typical set-up: one ``controller`` pair; one pair per
generator host, whose ``.key`` files are copied into the controller's ``authorized_keys_dir``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import zmq.auth


def create_keys(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Create a CURVE key pair; returns (public_file, secret_file). Refuses to overwrite."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if (d / f"{name}.key").exists() or (d / f"{name}.key_secret").exists():
        raise FileExistsError(f"CURVE keys for {name!r} already exist in {d}")
    public, secret = zmq.auth.create_certificates(str(d), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def main(argv: list[str]) -> int:
    """CLI entry point."""
    if len(argv) < 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    for name in argv[1:]:
        public, secret = create_keys(argv[0], name)
        print(f"{name}: public {public}, secret {secret}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
