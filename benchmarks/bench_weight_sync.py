"""Benchmark: weight sync from the learner's optimizer step to a generator sampling with the new weights.

    python benchmarks/bench_weight_sync.py            # ~6-9 min on 2 CPU cores
    python benchmarks/bench_weight_sync.py --quick    # the smallest model only

For random Qwen2 models of ~4M, ~30M and ~120M parameters (configs below, fp32), in one process:
- a transformers copy is the "learner": one training step = forward + backward + AdamW step on a
  batch of ``STEP_BATCH`` x ``STEP_TOKENS`` tokens (the step time the stall is compared with; a real
  learner step is larger: more tokens, PPO epochs, a critic, so the ratio here is pessimistic);
- after each step its state dict is published with ``WeightPublisher.publish_async`` (the learner's
  *stall* is the time that call blocks the training thread: a CPU snapshot of the tensors; the
  safetensors write, fsync, manifest and rename run on the writer thread), announced by a real
  ``Controller`` on its PUB socket, received by a real ``ControllerClient``, verified (path inside the
  weights root, manifest checksum, every file's sha256) and loaded by ``WeightSync`` into a real
  vLLM engine (``VLLMEngine.reload``: pause -> reload_weights -> resume: the *reload pause*), which
  then samples one token (checked to carry the new version).
- ``end_to_end`` = from "state dict ready" to that first new-version token.
- bandwidths (bytes of the model / seconds) of the write, the sha256 verification, the reload and a
  chunked fetch over ZeroMQ (what a generator without the shared filesystem does), next to memcpy
  (``dst.copy_(src)`` of the same number of bytes, best of 10, measured in the same run).
Targets: learner stall <= 5% of a training step; reload pause <= 100 ms for the ~4M model.
Results: benchmarks/results/bench_weight_sync.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
STEP_BATCH, STEP_TOKENS = 4, 128


@dataclass(frozen=True)
class Size:
    name: str
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    versions: int


SIZES = [
    Size("~4M", 320, 256, 768, 4, 4, 2, 4),
    Size("~30M", 4096, 512, 1536, 8, 8, 4, 3),
    Size("~120M", 8192, 768, 2304, 14, 12, 4, 3),
]


@dataclass(frozen=True)
class Prompt:
    prompt: str
    answer: str


def make_model(size: Size, out: Path) -> tuple[Path, torch.nn.Module]:
    """A random Qwen2 HF directory for ``size`` (tiny BPE tokenizer; vocab padded to size.vocab)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vapo_async.data.hf_dir import save_model_dir, train_tokenizer

    texts = [f"Question: what is {a} + {b}? Answer: {a + b}" for a in range(50) for b in range(20)]
    tok = train_tokenizer(texts, vocab_size=300)
    cfg = Qwen2Config(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.inter,
                      num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      num_key_value_heads=size.kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    return save_model_dir(out, model, tok), model


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, vocab: int) -> float:
    """Forward + backward + AdamW step on a random (STEP_BATCH, STEP_TOKENS) batch; seconds."""
    ids = torch.randint(0, vocab, (STEP_BATCH, STEP_TOKENS))
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def memcpy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def wait_announcement(client, version: int, timeout_s: float = 30.0):
    from vapo_async.transport.messages import WeightAnnouncement

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for msg in client.poll(10):
            if isinstance(msg, WeightAnnouncement) and msg.version == version:
                return msg
    raise TimeoutError(f"announcement of version {version} not received")


def first_token_s(engine, version: int) -> float:
    from vapo_async.common.sampling import GroupSamplingConfig

    t0 = time.perf_counter()
    engine.submit(f"probe-{version}", "Question: what is 1 + 2?", GroupSamplingConfig(group_size=1, max_tokens=1))
    done = []
    while engine.has_work():
        done += engine.step()
    dt = time.perf_counter() - t0
    assert int(done[0].responses[0].versions[0]) == version, "sampled with the wrong weights"
    return dt


def bench_size(size: Size, tmp: Path) -> dict:
    from vapo_async.common.engine import EngineConfig
    from vapo_async.controller.config import ControllerConfig
    from vapo_async.controller.server import Controller
    from vapo_async.generator.engine import VLLMEngine
    from vapo_async.generator.sync import WeightSync
    from vapo_async.transport.client import ControllerClient
    from vapo_async.transport.config import TransportConfig
    from vapo_async.transport.weights import WeightPublisher

    base, model = make_model(size, tmp / "base")
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    root = tmp / "weights"
    pub = WeightPublisher(root, base, keep=3)
    endpoint = f"ipc://{tmp}/ctl"
    ctl = Controller(ControllerConfig(transport=TransportConfig(endpoint=endpoint), weights_root=str(root)),
                     [Prompt("x", "1")], batch_groups=1, eta=0, vocab_size=size.vocab)
    ctl.start()
    client = ControllerClient(TransportConfig(endpoint=endpoint), f"bench-{size.layers}")
    t0 = time.perf_counter()
    engine = VLLMEngine(base, EngineConfig(max_model_len=256), version=0)
    engine_start_s = time.perf_counter() - t0
    sync = WeightSync(client, engine, tmp / "cache")
    rows = []
    try:
        client.connect(timeout_s=30)
        train_step(model, opt, size.vocab)  # warm-up (allocations, AdamW state)
        first_token_s(engine, 0)  # warm-up: a running generator has sampled before
        for v in range(1, size.versions + 1):
            step_s = train_step(model, opt, size.vocab)
            sd = model.state_dict()
            t_ready = time.perf_counter()
            fut = pub.publish_async(v, sd)
            stall_s = time.perf_counter() - t_ready
            ann = fut.result()
            t_written = time.perf_counter()
            ctl.announce(ann)
            msg = wait_announcement(client, v)
            t_received = time.perf_counter()
            sync.offer(msg)
            assert sync.apply(), "weights refused"
            t_loaded = time.perf_counter()
            sample_s = first_token_s(engine, v)
            rows.append({
                "version": v, "train_step_s": step_s, "stall_s": stall_s, "write_s": t_written - t_ready - stall_s,
                "announce_s": t_received - t_written, "verify_s": sync.stats.last_resolve_s,
                "reload_pause_s": sync.stats.last_pause_s, "first_token_s": sample_s,
                "end_to_end_s": t_loaded - t_ready + sample_s, "bytes": ann.bytes,
            })
            print(f"{size.name} v{v}: " + ", ".join(f"{k} {val:.4f}" for k, val in rows[-1].items()
                                                   if k.endswith("_s")), flush=True)
        t0 = time.perf_counter()
        client.fetch_weights(ann, tmp / "fetched")
        fetch_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
        client.close()
        ctl.stop()
        pub.close()
    nbytes = rows[-1]["bytes"]
    best = {k: min(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
    med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0] if k.endswith("_s")}
    return {
        "size": size.name, "params": n_params, "bytes": nbytes, "config": size.__dict__,
        "engine_start_s": engine_start_s, "runs": rows, "best": best, "median": med,
        "stall_fraction_of_step": med["stall_s"] / med["train_step_s"],
        "bandwidth_gbps": {
            "memcpy": memcpy_gbps(nbytes), "snapshot_copy": nbytes / med["stall_s"] / 1e9,
            "write": nbytes / med["write_s"] / 1e9, "verify_sha256": nbytes / med["verify_s"] / 1e9,
            "reload": nbytes / med["reload_pause_s"] / 1e9, "zmq_fetch": nbytes / fetch_s / 1e9,
        },
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    parts = ["train_step_s", "stall_s", "write_s", "verify_s", "reload_pause_s", "first_token_s", "end_to_end_s"]
    xs = range(len(results))
    w = 0.8 / len(parts)
    for i, p in enumerate(parts):  # side by side (log scale): a stacked log plot would mislead
        a1.bar([x + i * w for x in xs], [r["median"][p] for r in results], w, label=p.removesuffix("_s"))
    a1.set_xticks([x + 0.4 - w / 2 for x in xs], [f"{r['size']}\n{r['params'] / 1e6:.1f}M params" for r in results])
    a1.set_yscale("log")
    a1.set_ylabel("seconds (median over versions)")
    a1.set_title("weight sync: state dict ready -> first new-version token")
    a1.legend(fontsize=7)
    kinds = ["memcpy", "snapshot_copy", "write", "verify_sha256", "reload", "zmq_fetch"]
    width = 0.8 / len(kinds)
    for i, k in enumerate(kinds):
        a2.bar([x + i * width for x in xs], [r["bandwidth_gbps"][k] for r in results], width, label=k)
    a2.set_xticks([x + 0.4 - width / 2 for x in xs], [r["size"] for r in results])
    a2.set_yscale("log")
    a2.set_ylabel("GB/s (model bytes / seconds)")
    a2.set_title("bandwidth vs memcpy (same run)")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(results: list[dict], load: float) -> str:
    rows = ["| model | params | MB | train step s | learner stall s (% of step) | write s | announce s | "
            "verify s | reload pause s | first token s | end to end s |", "|---" * 11 + "|"]
    for r in results:
        m = r["median"]
        rows.append(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['bytes'] / 1e6:.0f} | {m['train_step_s']:.3f} | "
                    f"{m['stall_s']:.4f} ({100 * r['stall_fraction_of_step']:.1f}%) | {m['write_s']:.3f} | "
                    f"{m['announce_s']:.4f} | {m['verify_s']:.3f} | {m['reload_pause_s']:.3f} | "
                    f"{m['first_token_s']:.3f} | {m['end_to_end_s']:.3f} |")
    bw = ["| model | memcpy | snapshot copy | write | verify (sha256) | reload | ZeroMQ fetch |", "|---" * 7 + "|"]
    for r in results:
        b = r["bandwidth_gbps"]
        bw.append(f"| {r['size']} | " + " | ".join(f"{b[k]:.2f}" for k in
                  ("memcpy", "snapshot_copy", "write", "verify_sha256", "reload", "zmq_fetch")) + " |")
    small = results[0]
    verdict = ("Targets: learner stall <= 5% of a training step: "
               + ", ".join(f"{r['size']} {100 * r['stall_fraction_of_step']:.1f}%" for r in results)
               + f"; reload pause <= 100 ms for the ~4M model: {1000 * small['median']['reload_pause_s']:.0f} ms "
               f"(best {1000 * small['best']['reload_pause_s']:.0f} ms).")
    notes = ("Notes: the learner's stall is ``publish_async``'s CPU snapshot into freshly allocated tensors "
             "(first-touch page faults; a reused snapshot buffer would run at memcpy speed); everything after it "
             "runs off the training thread. ``write`` includes fsync and the sha256 of every file. ``verify`` "
             "re-hashes every file on the generator. ``ZeroMQ fetch`` is the chunked download a generator "
             "without the shared filesystem does (4 MiB chunks, window 4, controller thread in this process). "
             "All processes share the cores with other jobs (see the load average), so absolute times are noisy.")
    return ("# bench_weight_sync\n\nMedians over published versions; training step = fwd + bwd + AdamW on "
            f"{STEP_BATCH} x {STEP_TOKENS} tokens (fp32, CPU); {os.cpu_count()} shared cores, load average at end "
            f"{load:.1f}.\n\n" + "\n".join(rows) + "\n\nBandwidth, GB/s (model bytes / time):\n\n"
            + "\n".join(bw) + "\n\n" + verdict + "\n\n" + notes + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--redraw", action="store_true", help="rewrite the markdown and PNG from the saved JSON")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.redraw:
        saved = json.loads((RESULTS / "bench_weight_sync.json").read_text())
        (RESULTS / "bench_weight_sync.md").write_text(markdown(saved["results"], saved["machine"]["load_avg_end"][0]))
        plot(saved["results"], RESULTS / "bench_weight_sync.png")
        return
    results = []
    for size in SIZES[:1] if args.quick else SIZES:
        with tempfile.TemporaryDirectory() as d:
            results.append(bench_size(size, Path(d)))
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_end": os.getloadavg()},
           "train_step_batch": [STEP_BATCH, STEP_TOKENS], "results": results}
    (RESULTS / "bench_weight_sync.json").write_text(json.dumps(out, indent=1))
    md = markdown(results, os.getloadavg()[0])
    (RESULTS / "bench_weight_sync.md").write_text(md)
    plot(results, RESULTS / "bench_weight_sync.png")
    print(md)


if __name__ == "__main__":
    main()
