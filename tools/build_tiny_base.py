"""Build (or find in the cache) the tiny base model of the embedded default.

    python tools/build_tiny_base.py                      # default config, default cache
    python tools/build_tiny_base.py --out DIR            # build into DIR, no cache
    python tools/build_tiny_base.py seed=1 train_steps=50 cache_dir=/tmp/tb

Any ``key=value`` sets a ``TinyBaseConfig`` field (see vapo_async/data/tiny_base.py). Prints the
model directory and the build info (JSON) on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from vapo_async.data.tiny_base import INFO_FILE, TinyBaseConfig, build_tiny_base, ensure_tiny_base


def parse_overrides(items: list[str]) -> TinyBaseConfig:
    """``key=value`` strings -> a TinyBaseConfig (values converted to the field's default type)."""
    fields = {f.name: f for f in dataclasses.fields(TinyBaseConfig)}
    values: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"build_tiny_base: bad override {item!r}; fields: {sorted(fields)}")
        default = fields[key].default
        if raw.lower() in ("none", "null"):
            values[key] = None
        elif isinstance(default, bool):
            values[key] = raw.lower() in ("1", "true", "yes")
        elif isinstance(default, int):
            values[key] = int(raw)
        elif isinstance(default, float):
            values[key] = float(raw)
        else:
            values[key] = raw
    return TinyBaseConfig(**values)  # type: ignore[arg-type]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="build into this directory instead of the cache")
    parser.add_argument("overrides", nargs="*", help="TinyBaseConfig fields as key=value")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    cfg = parse_overrides(args.overrides)
    t0 = time.perf_counter()
    if args.out:
        build_tiny_base(cfg, args.out)
        path = args.out
    else:
        path = ensure_tiny_base(cfg)
    info = json.loads((path / INFO_FILE).read_text())
    print(json.dumps({"path": str(path), "seconds": round(time.perf_counter() - t0, 2), **info}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
