"""Benchmark: vectorised GAE (per-row lambda) vs a plain-Python loop and vs the memory bound.

    python benchmarks/bench_gae.py            # ~3-5 min on 2 CPU cores
    python benchmarks/bench_gae.py --quick    # small sizes only, for a smoke run

For each B x T (up to 8192 x 4096) with right-padded responses of random length 1..T, a bool mask
and length-adaptive lambdas (alpha = 0.05, so rows have lambda 0 or 0.05..1), it measures:
- ``vec``: ``vapo_async.algo.advantages.gae`` returning fresh outputs (the plain call), and
  ``vec_out``: the same writing into preallocated, already-touched outputs (``out=``), which
  removes the first-touch page faults of 2 x B x T x 4 bytes of new memory;
  each with torch's default thread count and with 1 thread; best of ``--repeats``.
- ``loop``: the reference loop in pure Python on float64 lists, written from the recurrence, best
  of 2. Above ``--loop-elems`` elements it runs on the first rows only and is extrapolated per
  element (the output says which); its inputs are converted to lists before the clock starts.
- ``bound``: one pass over memory, (bytes read + bytes written) / copy bandwidth, where the
  bandwidth is measured in the same run, right before each size, with ``dst.copy_(src)`` on
  128 MiB float32 tensors (DRAM, not cache; read + write counted) with the same thread count.
Other processes may share the cores: the load average is recorded, every figure is the best of
several repeats, and for one thread the process CPU time is reported beside the wall clock (it
leaves out the time other processes held the core; with two threads it would add both threads). Results: benchmarks/results/bench_gae.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from vapo_async.algo.advantages import gae, length_adaptive_lambda

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [(256, 512), (1024, 1024), (4096, 2048), (8192, 4096)]


def make_inputs(b: int, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded batch: rewards (terminal score), values, bool mask, length-adaptive lambdas."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = torch.randint(0, 2, (b,), generator=gen).float() * 2 - 1
    values = torch.randn(b, t, generator=gen) * 0.5
    return rewards, values, mask, length_adaptive_lambda(lengths, 0.05)


def gae_loop(rewards: list, values: list, mask: list, gamma: float, lams: list) -> tuple[list, list]:
    """The reference: the GAE recurrence over valid tokens, latest first, in float64."""
    adv, ret = [], []
    for r, v, m, lam in zip(rewards, values, mask, lams, strict=True):
        t = len(r)
        a_row, r_row = [0.0] * t, [0.0] * t
        a_next, v_next = 0.0, 0.0
        for j in range(t - 1, -1, -1):
            if m[j]:
                a_next = r[j] + gamma * v_next - v[j] + gamma * lam * a_next
                a_row[j] = a_next
                r_row[j] = a_next + v[j]
                v_next = v[j]
        adv.append(a_row)
        ret.append(r_row)
    return adv, ret


def best_of(fn, repeats: int) -> tuple[float, float]:
    """(best wall-clock seconds, best CPU seconds of this process) over the repeats."""
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def copy_bandwidth(repeats: int, elems: int = 1 << 25) -> tuple[float, float]:
    """Bytes per (wall, CPU) second of dst.copy_(src) on 128 MiB float32 tensors (read + write)."""
    src = torch.randn(elems)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first
    wall, cpu = best_of(lambda: dst.copy_(src), repeats)
    nbytes = 2 * src.numel() * src.element_size()
    return nbytes / wall, nbytes / cpu


def time_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, lam: torch.Tensor, max_elems: int) -> dict:
    b, t = rewards.shape
    rows = max(1, min(b, max_elems // t))
    r, v, m, lams = (rewards[:rows].double().tolist(), values[:rows].double().tolist(), mask[:rows].tolist(), lam[:rows].double().tolist())
    wall, cpu = best_of(lambda: gae_loop(r, v, m, 1.0, lams), 2)
    adv, _ = gae_loop(r, v, m, 1.0, lams)
    vec_adv, _ = gae(rewards[:rows], values[:rows], mask[:rows], 1.0, lam[:rows])
    max_err = (vec_adv.double() - torch.tensor(adv, dtype=torch.float64)).abs().max().item()
    return {
        "rows_timed": rows,
        "extrapolated": rows < b,
        "wall_s": wall * b / rows,
        "cpu_s": cpu * b / rows,
        "wall_ns_per_elem": wall / (rows * t) * 1e9,
        "cpu_ns_per_elem": cpu / (rows * t) * 1e9,
        "max_abs_err_float32_vs_loop": max_err,
    }


def bench_size(b: int, t: int, args: argparse.Namespace) -> dict:
    rewards, values, mask, lam = make_inputs(b, t)
    n = b * t
    bytes_moved = 4 * n + 4 * n + n + 4 * b + 4 * n + 4 * n  # r, V, mask, lambda in; adv, ret out
    row: dict = {"B": b, "T": t, "elements": n, "bytes_one_pass": bytes_moved, "threads": {}}
    row["loop"] = time_loop(rewards, values, mask, lam, args.loop_elems)
    default_threads = torch.get_num_threads()
    out = (torch.zeros_like(rewards), torch.zeros_like(rewards))
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        bw_wall, bw_cpu = copy_bandwidth(args.repeats)
        gae(rewards, values, mask, 1.0, lam, out=out)  # warm-up (and touches the out buffers)
        fresh = best_of(lambda: gae(rewards, values, mask, 1.0, lam), args.repeats)
        reused = best_of(lambda: gae(rewards, values, mask, 1.0, lam, out=out), args.repeats)
        stats = {"copy_GBps": bw_wall / 1e9, "bound_s": bytes_moved / bw_wall, "vec_s": fresh[0], "vec_out_s": reused[0]}
        if threads == 1:  # CPU time is comparable to wall time only for one thread
            stats |= {"copy_GBps_cpu": bw_cpu / 1e9, "bound_cpu_s": bytes_moved / bw_cpu, "vec_cpu_s": fresh[1], "vec_out_cpu_s": reused[1]}
        row["threads"][str(threads)] = stats
    torch.set_num_threads(default_threads)
    for stats in row["threads"].values():
        for kind in ("vec", "vec_out"):
            stats[f"{kind}_over_bound"] = stats[f"{kind}_s"] / stats["bound_s"]
            stats[f"{kind}_speedup"] = row["loop"]["wall_s"] / stats[f"{kind}_s"]
            if "bound_cpu_s" in stats:
                stats[f"{kind}_cpu_over_bound"] = stats[f"{kind}_cpu_s"] / stats["bound_cpu_s"]
                stats[f"{kind}_cpu_speedup"] = row["loop"]["cpu_s"] / stats[f"{kind}_cpu_s"]
    return row


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# GAE benchmark (per-row lambda, right padding, bool mask, float32)",
        "",
        f"Machine: {result['machine']}; torch {result['torch']}; load average {result['loadavg_start']} -> "
        f"{result['loadavg_end']} (other processes shared the cores).",
        "Targets: >= 50x faster than the Python loop; within 4x of the one-pass memory bound.",
        "`vec`: plain call (fresh outputs); `vec_out`: preallocated outputs (`out=`). Best of "
        f"{result['repeats']} repeats. Loop times marked * are extrapolated per element from the first rows.",
        "",
        "## Wall clock",
        "",
        "| B x T | threads | copy GB/s | bound ms | vec ms | vec_out ms | vec / bound | vec_out / bound | loop s | loop / vec | loop / vec_out |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        loop = row["loop"]
        star = "*" if loop["extrapolated"] else ""
        for threads, s in row["threads"].items():
            lines.append(
                f"| {row['B']} x {row['T']} | {threads} | {s['copy_GBps']:.1f} | {s['bound_s'] * 1e3:.1f} | {s['vec_s'] * 1e3:.1f} | "
                f"{s['vec_out_s'] * 1e3:.1f} | {s['vec_over_bound']:.1f}x | {s['vec_out_over_bound']:.1f}x | {loop['wall_s']:.2f}{star} | "
                f"{s['vec_speedup']:.0f}x | {s['vec_out_speedup']:.0f}x |"
            )
    lines += [
        "",
        "## CPU time of this process, 1 thread (discounts the time other processes held the core)",
        "",
        "| B x T | copy GB/s | bound ms | vec ms | vec_out ms | vec / bound | vec_out / bound | loop s | loop / vec | loop / vec_out |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        loop, s = row["loop"], row["threads"]["1"]
        star = "*" if loop["extrapolated"] else ""
        lines.append(
            f"| {row['B']} x {row['T']} | {s['copy_GBps_cpu']:.1f} | {s['bound_cpu_s'] * 1e3:.1f} | {s['vec_cpu_s'] * 1e3:.1f} | "
            f"{s['vec_out_cpu_s'] * 1e3:.1f} | {s['vec_cpu_over_bound']:.1f}x | {s['vec_out_cpu_over_bound']:.1f}x | "
            f"{loop['cpu_s']:.2f}{star} | {s['vec_cpu_speedup']:.0f}x | {s['vec_out_cpu_speedup']:.0f}x |"
        )
    lines += [
        "",
        "Loop reference (CPU ns per element; max |gae float32 - loop float64| on the timed rows): "
        + ", ".join(
            f"{r['B']}x{r['T']}: {r['loop']['cpu_ns_per_elem']:.0f} ns, {r['loop']['max_abs_err_float32_vs_loop']:.1e}" for r in result["rows"]
        ),
    ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    elems = [r["elements"] for r in rows]
    fig, (wall_ax, cpu_ax) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    wall_ax.plot(elems, [r["loop"]["wall_s"] for r in rows], "o-", label="Python loop (float64)")
    for threads in rows[0]["threads"]:
        wall_ax.plot(elems, [r["threads"][threads]["vec_s"] for r in rows], "s-", label=f"gae, {threads} thread(s)")
        wall_ax.plot(elems, [r["threads"][threads]["vec_out_s"] for r in rows], "^--", label=f"gae out=, {threads} thread(s)")
        wall_ax.plot(elems, [r["threads"][threads]["bound_s"] for r in rows], ":", label=f"memory bound, {threads} thread(s)")
    cpu_ax.plot(elems, [r["loop"]["cpu_s"] for r in rows], "o-", label="Python loop (float64)")
    cpu_ax.plot(elems, [r["threads"]["1"]["vec_cpu_s"] for r in rows], "s-", label="gae")
    cpu_ax.plot(elems, [r["threads"]["1"]["vec_out_cpu_s"] for r in rows], "^--", label="gae out=")
    cpu_ax.plot(elems, [r["threads"]["1"]["bound_cpu_s"] for r in rows], "k:", label="memory bound")
    for ax, title in ((wall_ax, "wall clock (best of repeats)"), (cpu_ax, "CPU time of the process, 1 thread")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("B x T elements")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    wall_ax.set_ylabel("seconds")
    fig.suptitle(f"GAE with per-row lambda on CPU (load average {result['loadavg_start'][0]}-{result['loadavg_end'][0]})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the two smallest sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-elems", type=int, default=2_000_000, help="time the loop on at most this many elements")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replot", type=Path, help="only rewrite the .md and .png from this bench_gae.json")
    args = parser.parse_args()
    if args.replot:
        result = json.loads(args.replot.read_text())
        write_markdown(result, args.out / "bench_gae.md")
        write_plot(result, args.out / "bench_gae.png")
        return
    sizes = SIZES[:2] if args.quick else SIZES
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "default_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "rows": [],
    }
    for b, t in sizes:
        row = bench_size(b, t, args)
        result["rows"].append(row)
        print(json.dumps({k: row[k] for k in ("B", "T", "threads", "loop")}), flush=True)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gae.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, args.out / "bench_gae.md")
    write_plot(result, args.out / "bench_gae.png")
    print((args.out / "bench_gae.md").read_text())


if __name__ == "__main__":
    main()
