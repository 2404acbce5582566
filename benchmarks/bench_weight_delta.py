"""Benchmark: would delta encoding (XOR against the previous version + zstd) shorten weight delivery?

    python benchmarks/bench_weight_delta.py WEIGHTS_DIR [--name bench_weight_delta]

WEIGHTS_DIR holds versions ``v{version:08d}/`` published by a real training run (the learner's
``weights/`` folder, or a copy of it taken while it ran). For every pair of consecutive versions
(v - 1, v) and every ``*.safetensors`` file it measures, on this machine:

- the size of ``zstd(file(v) XOR file(v - 1))`` (levels 1 and 3) against the file, in the dtype the
  run published (fp32 on CPU) and after a cast of both versions to bf16 (what a GPU run publishes
  with ``weights.dtype=auto``); plain ``zstd(file(v))`` as the no-delta baseline;
- the time to encode (XOR + compress) and to decode (decompress + XOR) each file;
- the product's fetch (``ControllerClient.fetch_weights`` from a real ``Controller``, loopback, into
  tmpfs when there is one) of the whole version, timed in the same run: the ceiling delta must beat.

Delivery with delta = encode + fetch of the delta bytes (at the measured fetch rate) + decode;
without = fetch of the whole version. Verdict: delta shortens delivery or not, per dtype.
Results: benchmarks/results/NAME.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors.torch import load_file, save

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import RESULTS, run_meta  # noqa: E402

SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@dataclass(frozen=True)
class Prompt:
    prompt: str
    answer: str


def versions(root: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in root.glob("v*") if p.name[1:].isdigit() and (p / "MANIFEST.json").is_file())


def as_bf16_bytes(path: Path) -> bytes:
    """The file's tensors cast to bf16 and saved as safetensors (what weights.dtype=bf16 publishes)."""
    return save({k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in sorted(load_file(path).items())})


def xor(a: bytes, b: bytes) -> bytes:
    if len(a) != len(b):
        raise ValueError(f"files differ in size ({len(a)} vs {len(b)}): a delta needs the same layout")
    return (np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8)).tobytes()


def measure_pair(prev: bytes, cur: bytes, level: int) -> dict:
    """Delta and plain zstd sizes of ``cur`` and the encode/decode times (seconds)."""
    cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    t0 = time.perf_counter()
    delta = cctx.compress(xor(cur, prev))
    t1 = time.perf_counter()
    back = xor(dctx.decompress(delta, max_output_size=len(cur)), prev)
    t2 = time.perf_counter()
    if back != cur:
        raise AssertionError("delta round trip is not exact")
    plain = cctx.compress(cur)
    return {"bytes": len(cur), "delta_bytes": len(delta), "plain_zstd_bytes": len(plain),
            "encode_s": t1 - t0, "decode_s": t2 - t1}


def fetch_gbps(root: Path, version: int) -> float:
    """Loopback fetch rate of the product's ``ControllerClient.fetch_weights`` for one whole version."""
    from vapo_async.controller.config import ControllerConfig
    from vapo_async.controller.server import Controller
    from vapo_async.transport.client import ControllerClient
    from vapo_async.transport.config import RelayConfig, TransportConfig
    from vapo_async.transport.weights import announcement_for

    ann = announcement_for(root / f"v{version:08d}")
    with tempfile.TemporaryDirectory() as sock_dir, tempfile.TemporaryDirectory(dir=SHM) as cache:
        endpoint = f"ipc://{sock_dir}/ctl"
        ctl = Controller(ControllerConfig(transport=TransportConfig(endpoint=endpoint), weights_root=str(root)),
                         [Prompt("x", "1")], batch_groups=1, eta=0, vocab_size=10)
        ctl.start()
        ctl.announce(ann)
        client = ControllerClient(TransportConfig(endpoint=endpoint, relay=RelayConfig(enabled=False)), "bench")
        try:
            client.connect(timeout_s=30)
            t0 = time.perf_counter()
            client.fetch_weights(ann, Path(cache))
            return ann.bytes / (time.perf_counter() - t0) / 1e9
        finally:
            client.close()
            ctl.stop()


def run(root: Path, pairs: int) -> dict:
    vs = versions(root)
    consecutive = [(a, b) for a, b in zip(vs, vs[1:], strict=False) if b == a + 1][-pairs:]
    if not consecutive:
        raise SystemExit(f"{root}: no two consecutive complete versions (found {vs})")
    rows = []
    for a, b in consecutive:
        for f in sorted((root / f"v{b:08d}").glob("*.safetensors")):
            prev_path = root / f"v{a:08d}" / f.name
            for dtype in ("published", "bf16"):
                prev = prev_path.read_bytes() if dtype == "published" else as_bf16_bytes(prev_path)
                cur = f.read_bytes() if dtype == "published" else as_bf16_bytes(f)
                for level in (1, 3):
                    rows.append({"versions": [a, b], "file": f.name, "dtype": dtype, "level": level,
                                 **measure_pair(prev, cur, level)})
    return {"pairs": consecutive, "rows": rows, "fetch_gbps": fetch_gbps(root, consecutive[-1][1])}


def summarise(res: dict) -> list[dict]:
    out = []
    for dtype in ("published", "bf16"):
        for level in (1, 3):
            rs = [r for r in res["rows"] if r["dtype"] == dtype and r["level"] == level]
            full = sum(r["bytes"] for r in rs)
            delta = sum(r["delta_bytes"] for r in rs)
            enc, dec = sum(r["encode_s"] for r in rs), sum(r["decode_s"] for r in rs)
            without = full / (res["fetch_gbps"] * 1e9)
            with_delta = enc + delta / (res["fetch_gbps"] * 1e9) + dec
            out.append({"dtype": dtype, "level": level, "bytes": full, "delta_ratio": full / delta,
                        "plain_zstd_ratio": full / sum(r["plain_zstd_bytes"] for r in rs),
                        "encode_gbps": full / enc / 1e9, "decode_gbps": full / dec / 1e9,
                        "delivery_without_s": without, "delivery_with_delta_s": with_delta,
                        "shortens": with_delta < without})
    return out


def markdown(res: dict, summary: list[dict], meta: dict, root: Path) -> str:
    rows = ["| dtype | zstd level | MB (all pairs) | delta ratio | plain zstd ratio | encode GB/s | decode GB/s | "
            "delivery without delta s | with delta s | shortens |", "|---" * 10 + "|"]
    for s in summary:
        rows.append(f"| {s['dtype']} | {s['level']} | {s['bytes'] / 1e6:.1f} | {s['delta_ratio']:.2f}x | "
                    f"{s['plain_zstd_ratio']:.2f}x | {s['encode_gbps']:.2f} | {s['decode_gbps']:.2f} | "
                    f"{s['delivery_without_s']:.3f} | {s['delivery_with_delta_s']:.3f} | "
                    f"{'yes' if s['shortens'] else 'no'} |")
    return ("# bench_weight_delta\n\n"
            f"Commit {meta['commit']}, {meta['date']}, {meta['machine']}; load average at start "
            f"{meta['load_avg_start']}, at end {meta['load_avg_end']}. Versions of a real training run "
            f"({root}): consecutive pairs {res['pairs']}. ``published``: the files as the run wrote them "
            "(fp32 on CPU); ``bf16``: both versions cast to bf16 first. Delta = zstd(file(v) XOR file(v - 1)); "
            "times are one core's. The product's loopback fetch of one whole version ran at "
            f"{res['fetch_gbps']:.2f} GB/s in the same run; delivery = encode + delta bytes at that rate + "
            "decode, against the whole version at that rate.\n\n" + "\n".join(rows) + "\n")


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{s['dtype']}\nzstd {s['level']}" for s in summary]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(summary))
    ax[0].bar(x - 0.2, [s["delta_ratio"] for s in summary], 0.4, label="XOR delta + zstd")
    ax[0].bar(x + 0.2, [s["plain_zstd_ratio"] for s in summary], 0.4, label="zstd alone")
    ax[0].set_xticks(x, labels)
    ax[0].set_ylabel("compression ratio (x)")
    ax[0].legend()
    ax[1].bar(x - 0.2, [s["delivery_without_s"] for s in summary], 0.4, label="whole version")
    ax[1].bar(x + 0.2, [s["delivery_with_delta_s"] for s in summary], 0.4, label="delta (encode+send+decode)")
    ax[1].set_xticks(x, labels)
    ax[1].set_ylabel("delivery s (all pairs)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("weights", type=Path, help="a run's weights folder (v00000001/, v00000002/, ...)")
    ap.add_argument("--pairs", type=int, default=8, help="the last N consecutive pairs")
    ap.add_argument("--name", default="bench_weight_delta")
    args = ap.parse_args()
    meta = run_meta(f"{args.pairs} pairs", "XOR delta + zstd of consecutive weight versions", ["published", "bf16"])
    torch.set_num_threads(1)
    res = run(args.weights, args.pairs)
    summary = summarise(res)
    meta["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "summary": summary, **res}, indent=1))
    md = markdown(res, summary, meta, args.weights)
    (RESULTS / f"{args.name}.md").write_text(md)
    plot(summary, RESULTS / f"{args.name}.png")
    print(md)


if __name__ == "__main__":
    main()
