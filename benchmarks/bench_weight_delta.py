"""Benchmark: does delta encoding (``weights.delta``: XOR against the previous version + zstd) shorten delivery?

    python benchmarks/bench_weight_delta.py WEIGHTS_DIR [--pairs 4] [--name bench_weight_delta]

WEIGHTS_DIR holds versions ``v{version:08d}/`` published by a real training run (the learner's
``weights/`` folder, or a copy taken while it ran). For the last ``--pairs`` pairs of consecutive
versions (v - 1, v), in the dtype the run published (fp32 on CPU) and cast to bf16 (what a GPU run
publishes with ``weights.dtype=auto``), it runs the product's path end to end:

- ``WeightPublisher.publish`` (``finish_version`` -> ``transport/delta.write_deltas``: what the
  learner's writer thread runs) writes v - 1, then v with deltas; the same v is also published
  without deltas into another root, so the difference is the learner-side encoding cost;
- a real ``Controller`` serves both; ``ControllerClient.fetch_weights`` (relay off, cache in tmpfs
  when there is one) fetches v twice: by a generator that holds v - 1 (deltas: ``decode_file``
  against its copy, checked against the manifest) and by one that holds nothing (whole files).

Delivery with deltas = the learner's extra encoding time + the fetch with deltas; without = the
whole fetch. The compression ratio is the model files' bytes over their deltas' bytes.
Results: benchmarks/results/NAME.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import RESULTS, run_meta  # noqa: E402

SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
LEVEL = 1


@dataclass(frozen=True)
class Prompt:
    prompt: str
    answer: str


def versions(root: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in root.glob("v*") if p.name[1:].isdigit() and (p / "MANIFEST.json").is_file())


def tensors(version_dir: Path, dtype: str) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(version_dir.glob("*.safetensors")):
        sd.update(load_file(f))
    if dtype == "bf16":
        sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    return sd


def one_pair(src: Path, a: int, b: int, dtype: str, tmp: Path) -> dict:
    """Publish a and b (with and without deltas), then fetch b with and without the base held."""
    from vapo_async.controller.config import ControllerConfig
    from vapo_async.controller.server import Controller
    from vapo_async.transport.client import ControllerClient
    from vapo_async.transport.config import RelayConfig, TransportConfig
    from vapo_async.transport.publisher import WeightPublisher

    base_files = src / f"v{a:08d}"
    sd_a, sd_b = tensors(src / f"v{a:08d}", dtype), tensors(src / f"v{b:08d}", dtype)
    plain = WeightPublisher(tmp / "plain", base_files, keep=3)
    plain.publish(a, sd_a)
    t0 = time.perf_counter()
    plain.publish(b, sd_b)
    publish_plain_s = time.perf_counter() - t0
    pub = WeightPublisher(tmp / "delta", base_files, keep=3, delta_level=LEVEL)
    ann_a = pub.publish(a, sd_a)
    t0 = time.perf_counter()
    ann_b = pub.publish(b, sd_b)
    publish_delta_s = time.perf_counter() - t0
    meta = json.loads((pub.root / "deltas" / f"v{b:08d}" / "DELTA.json").read_text())
    model_bytes = sum(json.loads((Path(ann_b.path) / "MANIFEST.json").read_text())["files"][n]["bytes"]
                      for n in meta["files"])
    delta_bytes = sum(e["bytes"] for e in meta["files"].values())
    endpoint = f"ipc://{tmp}/ctl"
    ctl = Controller(ControllerConfig(transport=TransportConfig(endpoint=endpoint), weights_root=str(pub.root)),
                     [Prompt("x", "1")], batch_groups=1, eta=0, vocab_size=10)
    ctl.start()
    ctl.announce(ann_a)
    ctl.announce(ann_b)
    out = {"versions": [a, b], "dtype": dtype, "model_bytes": model_bytes, "delta_bytes": delta_bytes,
           "version_bytes": ann_b.bytes, "publish_plain_s": publish_plain_s, "publish_delta_s": publish_delta_s}
    try:
        for who in ("holds_base", "fresh"):
            client = ControllerClient(TransportConfig(endpoint=endpoint, relay=RelayConfig(enabled=False)), who)
            cache = Path(tempfile.mkdtemp(dir=SHM or tmp))
            try:
                client.connect(timeout_s=30)
                if who == "holds_base":
                    client.fetch_weights(ann_a, cache)
                before = ctl.metrics().get("transport/fetch_bytes", 0.0)
                t0 = time.perf_counter()
                client.fetch_weights(ann_b, cache)
                out[f"fetch_{who}_s"] = time.perf_counter() - t0
                out[f"sent_{who}_bytes"] = ctl.metrics()["transport/fetch_bytes"] - before
                out[f"delta_files_{who}"] = client.fetch_stats.delta_files
            finally:
                client.close()
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        ctl.stop()
    if out["delta_files_holds_base"] != len(meta["files"]):
        raise RuntimeError(f"the generator holding v{a} did not use the deltas: {out}")
    return out


def run(root: Path, pairs: int) -> dict:
    vs = versions(root)
    consecutive = [(a, b) for a, b in zip(vs, vs[1:], strict=False) if b == a + 1][-pairs:]
    if not consecutive:
        raise SystemExit(f"{root}: no two consecutive complete versions (found {vs})")
    rows = []
    for a, b in consecutive:
        for dtype in ("published", "bf16"):
            with tempfile.TemporaryDirectory() as d:
                rows.append(one_pair(root, a, b, dtype, Path(d)))
                print(json.dumps(rows[-1]), flush=True)
    return {"pairs": consecutive, "rows": rows}


def summarise(res: dict) -> list[dict]:
    out = []
    for dtype in ("published", "bf16"):
        rs = [r for r in res["rows"] if r["dtype"] == dtype]
        model, delta = sum(r["model_bytes"] for r in rs), sum(r["delta_bytes"] for r in rs)
        encode = sum(max(0.0, r["publish_delta_s"] - r["publish_plain_s"]) for r in rs) / len(rs)
        with_delta = encode + sum(r["fetch_holds_base_s"] for r in rs) / len(rs)
        without = sum(r["fetch_fresh_s"] for r in rs) / len(rs)
        out.append({"dtype": dtype, "pairs": len(rs), "version_mb": rs[0]["version_bytes"] / 1e6,
                    "delta_ratio": model / delta, "learner_extra_s": encode,
                    "fetch_with_delta_s": sum(r["fetch_holds_base_s"] for r in rs) / len(rs),
                    "sent_with_delta_mb": sum(r["sent_holds_base_bytes"] for r in rs) / len(rs) / 1e6,
                    "sent_whole_mb": sum(r["sent_fresh_bytes"] for r in rs) / len(rs) / 1e6,
                    "delivery_with_delta_s": with_delta, "delivery_without_s": without,
                    "shortens": with_delta < without})
    return out


def markdown(res: dict, summary: list[dict], meta: dict, root: Path) -> str:
    rows = ["| dtype | pairs | version MB | delta ratio | learner's extra encode s | fetch with delta s | "
            "MB sent with delta | MB sent whole | delivery with delta s | without s | shortens |", "|---" * 11 + "|"]
    for s in summary:
        rows.append(f"| {s['dtype']} | {s['pairs']} | {s['version_mb']:.1f} | {s['delta_ratio']:.2f}x | "
                    f"{s['learner_extra_s']:.3f} | {s['fetch_with_delta_s']:.3f} | {s['sent_with_delta_mb']:.2f} | "
                    f"{s['sent_whole_mb']:.2f} | {s['delivery_with_delta_s']:.3f} | {s['delivery_without_s']:.3f} | "
                    f"{'yes' if s['shortens'] else 'no'} |")
    return ("# bench_weight_delta\n\n"
            f"Commit {meta['commit']}, {meta['date']}, {meta['machine']}; load average at start "
            f"{meta['load_avg_start']}, at end {meta['load_avg_end']}. Consecutive versions {res['pairs']} of a real "
            f"training run ({root}). ``published``: the tensors as the run wrote them (fp32 on CPU); ``bf16``: cast "
            f"to bf16 first. zstd level {LEVEL}. Means over pairs; every figure times the product's functions "
            "(``WeightPublisher.publish`` with and without ``delta_level``, ``ControllerClient.fetch_weights`` over a "
            "real controller on loopback, into tmpfs).\n\n" + "\n".join(rows) + "\n")


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [s["dtype"] for s in summary]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    x = np.arange(len(summary))
    ax[0].bar(x, [s["delta_ratio"] for s in summary], 0.5)
    ax[0].set_xticks(x, labels)
    ax[0].set_ylabel("model bytes / delta bytes")
    ax[1].bar(x - 0.2, [s["delivery_without_s"] for s in summary], 0.4, label="whole version")
    ax[1].bar(x + 0.2, [s["delivery_with_delta_s"] for s in summary], 0.4, label="encode + fetch with deltas")
    ax[1].set_xticks(x, labels)
    ax[1].set_ylabel("delivery s")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("weights", type=Path, help="a run's weights folder (v00000001/, v00000002/, ...)")
    ap.add_argument("--pairs", type=int, default=4, help="the last N consecutive pairs")
    ap.add_argument("--name", default="bench_weight_delta")
    args = ap.parse_args()
    meta = run_meta(f"{args.pairs} pairs", "XOR delta + zstd of consecutive weight versions", ["published", "bf16"])
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
