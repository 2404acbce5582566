"""bench_transport: rollout groups/s and MB/s over loopback (tcp 127.0.0.1 and ipc) vs memcpy.

    python benchmarks/bench_transport.py            # ~1 min on 2 cores
    python benchmarks/bench_transport.py --quick    # fewer sizes, shorter runs
    python benchmarks/bench_transport.py --report-only   # rebuild md/png from the JSON

Per (G, L) configuration (prompt P = 256 tokens, every response exactly L tokens):
- ``tcp`` / ``ipc``: a sender *process* builds frames with ``encode_group`` and sends them with
  ``copy=False`` from a DEALER; this process receives on a ROUTER with ``copy=False`` and runs
  ``decode_from_generator`` (all validation: dtypes, lengths, token range, finite/<=0 log-probs,
  versions). Timed from the first to the last of N groups after a warm-up.
- ``decode``: the same encode + decode + validation in one process, no socket (the CPU floor of the
  wire format).
- ``memcpy``: ``np.copyto`` of the same number of payload bytes, measured in the same run (the raw
  in-process copy the issue asks to compare with).
Not included: the controller's lease bookkeeping (microseconds per group, measured separately by
the controller tests' timings) and generation itself.

Writes benchmarks/results/bench_transport.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vapo_async.transport.messages import MessageLimits, decode_from_generator, encode_group  # noqa: E402
from vapo_async.transport.synthetic import random_group  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
VOCAB = 151_936  # Qwen2.5 vocabulary: realistic token-id range for the validation pass
PROMPT_LEN = 256
LIMITS = MessageLimits()


def make_group(G: int, L: int):
    return random_group(np.random.default_rng(0), lease_id=1, prompt_index=0, generator_id="bench", group_size=G,
                        lengths=(L, L), vocab_size=VOCAB, version=0, prompt_len=PROMPT_LEN)


def sender(endpoint: str, G: int, L: int, n: int) -> None:
    """Subprocess entry point: send n groups as fast as the socket takes them."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(endpoint)
    g = make_group(G, L)
    for _ in range(n):
        sock.send_multipart(encode_group(g), copy=False)
    sock.send_multipart([b"done"])
    sock.close(linger=-1)
    ctx.term()


def over_socket(kind: str, G: int, L: int, n: int, warmup: int, tmp: Path) -> float:
    """Seconds to receive + decode n groups sent by another process (after ``warmup`` groups)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 1000)
    if kind == "ipc":
        router.bind(f"ipc://{tmp}/bench-{os.getpid()}")
    else:
        router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    proc = subprocess.Popen([sys.executable, __file__, "--sender", endpoint, str(G), str(L), str(n + warmup)])
    t0 = 0.0
    for i in range(n + warmup + 1):
        frames = router.recv_multipart(copy=False)
        if len(frames) == 2:
            break
        decode_from_generator(frames[1:], LIMITS, vocab_size=VOCAB, max_version=0)
        if i == warmup - 1:
            t0 = time.perf_counter()
    elapsed = time.perf_counter() - t0
    assert proc.wait(60) == 0
    router.close(0)
    ctx.term()
    return elapsed


def in_process(G: int, L: int, n: int) -> float:
    g = make_group(G, L)
    t0 = time.perf_counter()
    for _ in range(n):
        decode_from_generator([bytes(f) if i == 0 else f for i, f in enumerate(encode_group(g))], LIMITS,
                              vocab_size=VOCAB, max_version=0)
    return time.perf_counter() - t0


def memcpy_gbps(nbytes: int, seconds: float = 0.3) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        np.copyto(dst, src)
        reps += 1
    return reps * nbytes / (time.perf_counter() - t0) / 1e9


def run(quick: bool) -> dict:
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    sizes = [(8, 100), (16, 2000)] if quick else [(8, 100), (8, 500), (8, 2000), (16, 100), (16, 500), (16, 2000)]
    target_bytes = (20 if quick else 60) * 2**20
    repeats = 1 if quick else 3
    rows = []
    for G, L in sizes:
        nbytes = make_group(G, L).nbytes()
        n = int(min(20_000, max(200, target_bytes // nbytes)))
        row = {"G": G, "L": L, "payload_bytes": nbytes, "groups": n, "repeats": repeats}
        n_dec = max(50, n // 4)
        for kind in ("tcp", "ipc", "decode"):
            # best of `repeats` (the machine is shared; the best run is the least disturbed one)
            if kind == "decode":
                secs = [in_process(G, L, n_dec) for _ in range(repeats)]
                count = n_dec
            else:
                secs = [over_socket(kind, G, L, n, warmup=max(20, n // 20), tmp=tmp) for _ in range(repeats)]
                count = n
            row[f"{kind}_groups_s"] = count / min(secs)
            row[f"{kind}_MBps"] = count * nbytes / min(secs) / 1e6
            row[f"{kind}_MBps_all"] = [count * nbytes / t / 1e6 for t in secs]
        row["memcpy_MBps"] = max(memcpy_gbps(nbytes) for _ in range(repeats)) * 1e3
        row["memcpy_groups_s"] = row["memcpy_MBps"] * 1e6 / nbytes
        row["tcp_vs_memcpy"] = row["tcp_MBps"] / row["memcpy_MBps"]
        rows.append(row)
        print(f"G={G:2d} L={L:4d} {nbytes / 1e3:7.1f} KB  tcp {row['tcp_groups_s']:8.0f} g/s {row['tcp_MBps']:7.0f} MB/s"
              f"  ipc {row['ipc_MBps']:7.0f} MB/s  decode {row['decode_MBps']:7.0f} MB/s"
              f"  memcpy {row['memcpy_MBps']:7.0f} MB/s", flush=True)
    big = memcpy_gbps(256 * 2**20, 1.0) * 1e3
    return {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                        "zmq": zmq.zmq_version(), "pyzmq": zmq.__version__,
                        "loadavg_1min_at_end": os.getloadavg()[0]},
            "memcpy_256MiB_MBps": big, "quick": quick, "rows": rows}


def write(result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_transport.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# bench_transport: rollout groups over loopback vs in-process copy",
        "",
        f"Machine: {result['machine']['platform']}, {result['machine']['cpus']} CPUs, libzmq "
        f"{result['machine']['zmq']}; 1-min load average at the end {result['machine']['loadavg_1min_at_end']:.1f} "
        "(the machine is shared: figures are lower bounds). Sender is a separate process; receiver decodes and fully validates "
        "every group; each figure is the best of the repeats (all repeats are in the JSON). P = 256 prompt tokens; every response has L tokens; payload = int32 ids, float32 "
        "log-probs, int32 versions per token + per-response rewards/flags. memcpy = `np.copyto` of the same "
        f"bytes in this process (256 MiB copy: {result['memcpy_256MiB_MBps']:.0f} MB/s).",
        "",
        "| G | L | payload KB | tcp groups/s | tcp MB/s | ipc groups/s | ipc MB/s | decode-only MB/s | memcpy MB/s | tcp as % of memcpy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['G']} | {r['L']} | {r['payload_bytes'] / 1e3:.1f} | {r['tcp_groups_s']:.0f} | "
                     f"{r['tcp_MBps']:.0f} | {r['ipc_groups_s']:.0f} | {r['ipc_MBps']:.0f} | {r['decode_MBps']:.0f} | "
                     f"{r['memcpy_MBps']:.0f} | {100 * r['tcp_vs_memcpy']:.2f}% |")
    lines += [
        "",
        "Reading: the loopback transport is far below memcpy and close to the decode-only column, so the",
        "cost is the receiver's per-group Python work (msgpack header, strict field checks, vectorised",
        "range/finiteness/version checks over every token), not the sockets or copies; for small groups",
        "the fixed per-message cost dominates. Even the worst row is hundreds of groups/s, while one",
        "vLLM generator produces a few groups/s (G x L tokens each), so the wire is not the bottleneck.",
    ]
    (RESULTS / "bench_transport.md").write_text("\n".join(lines) + "\n")
    plot(result)


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"G={r['G']}\nL={r['L']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, (key, name) in enumerate([("tcp_MBps", "tcp 127.0.0.1"), ("ipc_MBps", "ipc"),
                                     ("decode_MBps", "encode+decode, no socket"), ("memcpy_MBps", "memcpy")]):
        ax.bar(x + (i - 1.5) * 0.2, [r[key] for r in rows], 0.2, label=name)
    ax.set_yscale("log")
    ax.set_xticks(x, labels)
    ax.set_ylabel("MB/s (log)")
    ax.set_title("Rollout-group transport: loopback vs in-process copy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_transport.png", dpi=120)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--sender":
        sender(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        sys.exit(0)
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--report-only", action="store_true", help="rebuild md/png from the JSON")
    args = ap.parse_args()
    write(json.loads((RESULTS / "bench_transport.json").read_text()) if args.report_only else run(args.quick))
