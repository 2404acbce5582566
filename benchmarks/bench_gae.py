"""Benchmark: GAE (per-row lambda) on CPU, both implementations vs a plain-Python loop and vs the
memory bound of one pass.

    python benchmarks/bench_gae.py            # ~3-5 min on 2 busy CPU cores
    python benchmarks/bench_gae.py --quick    # small sizes only, for a smoke run

For each B x T (up to 8192 x 4096) with right-padded responses of random length 1..T, a bool mask
and length-adaptive lambdas (alpha = 0.05, so rows have lambda 0 or 0.05..1), float32, it measures:
- both paths of ``vapo_async.algo.advantages.gae``: ``compiled`` (the numba one-pass loop of
  ``vapo_async.algo.fast.numba_gae``, the CPU default) and ``torch`` (the blocked matmul scan, the GPU /
  no-numba path); each ``fresh`` (the plain call, new outputs) and ``out`` (preallocated,
  already-touched outputs via ``out=``, which removes the first-touch page faults of
  2 x B x T x 4 bytes of new memory); with torch's default thread count and with 1 thread;
  best of ``--repeats`` (more tries at small sizes, where they are cheap).
- ``loop``: the reference loop in pure Python on float64 lists, written from the recurrence, best
  of 2. Above ``--loop-elems`` elements it runs on the first rows only and is extrapolated per
  element (the output says which); its inputs are converted to lists before the clock starts.
- ``bound``: one pass over memory, (bytes read + bytes written) / copy bandwidth, where the
  bandwidth is measured in the same run, right before each size, with ``dst.copy_(src)`` on
  128 MiB float32 tensors (read + write counted) with the same thread count. Caveat: this host
  reports a 480 MiB shared L3, so the copy and the mid sizes may partly run from cache.
- ``thp``: the compiled plain call at the largest size once more, in a subprocess with torch's
  ``THP_MEM_ALLOC_ENABLE=1`` (huge pages: far fewer first-touch page faults on the new outputs).
- ``compile``: first-call cost of the compiled path in fresh subprocesses with an empty and then
  a filled numba cache directory (``NUMBA_CACHE_DIR``): numba import, compile or cache load.
Other processes may share the cores: the load average is recorded, every figure is the best of
several repeats, and for one thread the process CPU time is reported beside the wall clock (it
leaves out the time other processes held the core; with two threads it would add both threads).
Results: benchmarks/results/bench_gae.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vapo_async.algo.advantages import gae, length_adaptive_lambda
from vapo_async.algo.fast import numba_gae as gae_cpu

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [(256, 512), (1024, 1024), (4096, 2048), (8192, 4096)]
PATHS = ("compiled", "torch")

COMPILE_PROBE = """
import json, sys, time
import torch
from vapo_async.algo.advantages import gae
numba_by_import = "numba" in sys.modules
t0 = time.perf_counter()
import numba
t1 = time.perf_counter()
r = torch.randn(4, 8)
m = torch.ones(4, 8, dtype=torch.bool)
t2 = time.perf_counter()
gae(r, r, m, 1.0, 0.9, backend="compiled")
t3 = time.perf_counter()
gae(r.double(), r.double(), m, 1.0, 0.9, backend="compiled")
t4 = time.perf_counter()
print(json.dumps({"import_numba_s": t1 - t0, "first_call_float32_s": t3 - t2, "first_call_float64_s": t4 - t3,
                  "numba_imported_by_vapo_async_algo": numba_by_import}))
"""


THP_PROBE = """
import json, sys, torch
sys.path.insert(0, {bench_dir!r})
from bench_gae import best_of, make_inputs
from vapo_async.algo.advantages import gae
torch.set_num_threads(1)
r, v, m, lam = make_inputs({b}, {t})
gae(r, v, m, 1.0, lam)
wall, cpu = best_of(lambda: gae(r, v, m, 1.0, lam), {repeats})
print(json.dumps({{"fresh_s": wall, "fresh_cpu_s": cpu}}))
"""


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


def best_of(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
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


def compile_times() -> dict:
    """First-call costs of the compiled path in fresh processes: empty cache, then filled cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        runs = []
        for _ in range(2):
            done = subprocess.run([sys.executable, "-c", COMPILE_PROBE], env=env, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"cold_cache": runs[0], "warm_cache": runs[1]}


def thp_fresh(b: int, t: int, repeats: int) -> dict:
    """The compiled plain call (1 thread) in a subprocess whose torch allocates with huge pages."""
    code = THP_PROBE.format(bench_dir=str(Path(__file__).resolve().parent), b=b, t=t, repeats=repeats)
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, lam: torch.Tensor, max_elems: int) -> dict:
    b, t = rewards.shape
    rows = max(1, min(b, max_elems // t))
    r, v, m, lams = (rewards[:rows].double().tolist(), values[:rows].double().tolist(), mask[:rows].tolist(), lam[:rows].double().tolist())
    wall, cpu = best_of(lambda: gae_loop(r, v, m, 1.0, lams), 2)
    adv, _ = gae_loop(r, v, m, 1.0, lams)
    ref = torch.tensor(adv, dtype=torch.float64)
    errors = {}
    for path in PATHS:
        vec_adv, _ = gae(rewards[:rows], values[:rows], mask[:rows], 1.0, lam[:rows], backend=path)
        errors[path] = (vec_adv.double() - ref).abs().max().item()
    return {
        "rows_timed": rows,
        "extrapolated": rows < b,
        "wall_s": wall * b / rows,
        "cpu_s": cpu * b / rows,
        "wall_ns_per_elem": wall / (rows * t) * 1e9,
        "cpu_ns_per_elem": cpu / (rows * t) * 1e9,
        "max_abs_err_float32_vs_loop": errors,
    }


def time_path(path: str, inputs: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, torch.Tensor], repeats: int) -> dict:
    """Best wall/CPU seconds of one ``gae`` path, fresh outputs and ``out=`` buffers."""
    rewards, values, mask, lam = inputs
    gae(rewards, values, mask, 1.0, lam, out=out, backend=path)  # warm-up (and touches the out buffers)
    fresh = best_of(lambda: gae(rewards, values, mask, 1.0, lam, backend=path), repeats)
    reused = best_of(lambda: gae(rewards, values, mask, 1.0, lam, out=out, backend=path), repeats)
    return {"fresh_s": fresh[0], "out_s": reused[0], "fresh_cpu_s": fresh[1], "out_cpu_s": reused[1]}


def bench_size(b: int, t: int, args: argparse.Namespace) -> dict:
    inputs = make_inputs(b, t)
    n = b * t
    bytes_moved = 4 * n + 4 * n + n + 4 * b + 4 * n + 4 * n  # r, V, mask, lambda in; adv, ret out
    row: dict = {"B": b, "T": t, "elements": n, "bytes_one_pass": bytes_moved, "threads": {}}
    row["loop"] = time_loop(*inputs, args.loop_elems)
    default_threads = torch.get_num_threads()
    out = (torch.zeros(b, t), torch.zeros(b, t))
    repeats = max(args.repeats, min(30, (1 << 24) // n))  # small sizes are cheap: more tries at a quiet moment
    row["repeats"] = repeats
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        bw_wall, bw_cpu = copy_bandwidth(args.repeats)  # 128 MiB each time, whatever the size
        stats: dict = {"copy_GBps": bw_wall / 1e9, "bound_s": bytes_moved / bw_wall, "paths": {}}
        if threads == 1:  # CPU time is comparable to wall time only for one thread
            stats |= {"copy_GBps_cpu": bw_cpu / 1e9, "bound_cpu_s": bytes_moved / bw_cpu}
        for path in PATHS:
            p = time_path(path, inputs, out, repeats)
            for kind in ("fresh", "out"):
                p[f"{kind}_over_bound"] = p[f"{kind}_s"] / stats["bound_s"]
                p[f"{kind}_speedup"] = row["loop"]["wall_s"] / p[f"{kind}_s"]
                if threads == 1:
                    p[f"{kind}_cpu_over_bound"] = p[f"{kind}_cpu_s"] / stats["bound_cpu_s"]
                    p[f"{kind}_cpu_speedup"] = row["loop"]["cpu_s"] / p[f"{kind}_cpu_s"]
            stats["paths"][path] = p
        row["threads"][str(threads)] = stats
    torch.set_num_threads(default_threads)
    return row


def verdict(result: dict) -> list[str]:
    """The targets checked at the largest size, 1 thread, per path and call (CPU time decides)."""
    row = result["rows"][-1]
    s = row["threads"]["1"]
    lines = []
    for path in PATHS:
        p = s["paths"][path]
        for kind, label in (("fresh", "plain call (fresh outputs)"), ("out", "with `out=` buffers")):
            speed, over = p[f"{kind}_cpu_speedup"], p[f"{kind}_cpu_over_bound"]
            ok = "MET" if over <= 4 and speed >= 50 else "MISSED"
            lines.append(
                f"- `{path}`, {label}, {row['B']} x {row['T']}, 1 thread: CPU time {speed:.0f}x the loop (target >= 50x), "
                f"{over:.1f}x the one-pass bound (target <= 4x): **{ok}**; wall clock {p[f'{kind}_speedup']:.0f}x / "
                f"{p[f'{kind}_over_bound']:.1f}x"
            )
    thp = result.get("thp")
    if thp:
        loop_cpu, bound_cpu = row["loop"]["cpu_s"], s["bound_cpu_s"]
        lines.append(
            f"- `compiled`, plain call with torch's `THP_MEM_ALLOC_ENABLE=1` (transparent huge pages for large tensors, a "
            f"deployment setting that `gae` does not set), measured in a subprocess: {thp['fresh_cpu_s'] * 1e3:.1f} ms CPU = "
            f"{loop_cpu / thp['fresh_cpu_s']:.0f}x the loop, {thp['fresh_cpu_s'] / bound_cpu:.1f}x the bound"
        )
    return lines


def _table(result: dict, cpu: bool) -> list[str]:
    sfx = "_cpu" if cpu else ""
    head = "| B x T | path | copy GB/s | bound ms | fresh ms | out ms | fresh / bound | out / bound | loop s | loop / fresh | loop / out |"
    if not cpu:
        head = head.replace("| path |", "| threads | path |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in result["rows"]:
        loop = row["loop"]
        star = "*" if loop["extrapolated"] else ""
        for threads, s in row["threads"].items():
            if cpu and threads != "1":
                continue
            for path, p in s["paths"].items():
                lead = f"| {row['B']} x {row['T']} | " + ("" if cpu else f"{threads} | ") + f"{path} |"
                lines.append(
                    f"{lead} {s['copy_GBps' + sfx]:.1f} | {s['bound' + sfx + '_s'] * 1e3:.1f} | {p['fresh' + sfx + '_s'] * 1e3:.1f} | "
                    f"{p['out' + sfx + '_s'] * 1e3:.1f} | {p['fresh' + sfx + '_over_bound']:.1f}x | {p['out' + sfx + '_over_bound']:.1f}x | "
                    f"{loop['cpu_s' if cpu else 'wall_s']:.2f}{star} | {p['fresh' + sfx + '_speedup']:.0f}x | {p['out' + sfx + '_speedup']:.0f}x |"
                )
    return lines


def write_markdown(result: dict, path: Path) -> None:
    comp = result.get("compile")
    lines = [
        "# GAE benchmark (per-row lambda, right padding, bool mask, float32, CPU)",
        "",
        f"Machine: {result['machine']}; torch {result['torch']}; numba {result['numba']}; load average "
        f"{result['loadavg_start']} -> {result['loadavg_end']} (other engineers' jobs shared the cores, so "
        "wall-clock figures are noisy, two-thread ones most of all; the CPU-time table discounts the waiting).",
        "Targets: >= 50x faster than the Python loop; within 4x of the one-pass memory bound.",
        "Paths: `compiled` = numba one-pass loop (CPU default), `torch` = blocked matmul scan (GPU / no numba). "
        "`fresh`: plain call (new outputs, first-touch page faults included); `out`: preallocated outputs (`out=`). "
        f"Best of {result['repeats']} repeats at the largest size, up to 30 at smaller ones (the copy: "
        f"{result['repeats']}; the loop: 2). Loop times marked * are extrapolated per element from the first rows.",
        "",
        "## Verdict",
        "",
        *verdict(result),
        "",
        "## Wall clock",
        "",
        *_table(result, cpu=False),
        "",
        "## CPU time of this process, 1 thread (discounts the time other processes held the core)",
        "",
        *_table(result, cpu=True),
        "",
        "Loop reference (CPU ns per element; max |gae float32 - loop float64| on the timed rows, compiled / torch): "
        + ", ".join(
            f"{r['B']}x{r['T']}: {r['loop']['cpu_ns_per_elem']:.0f} ns, "
            f"{r['loop']['max_abs_err_float32_vs_loop']['compiled']:.1e} / {r['loop']['max_abs_err_float32_vs_loop']['torch']:.1e}"
            for r in result["rows"]
        ),
    ]
    if comp:
        cold, warm = comp["cold_cache"], comp["warm_cache"]
        lines += [
            "",
            "Compiled path, first call in a fresh process (numba import; then float32 and float64 first calls): "
            f"empty cache {cold['import_numba_s']:.2f} s + {cold['first_call_float32_s']:.2f} s + {cold['first_call_float64_s']:.2f} s "
            f"(compiling); filled cache {warm['import_numba_s']:.2f} s + {warm['first_call_float32_s']:.2f} s + "
            f"{warm['first_call_float64_s']:.2f} s (loading). `import vapo_async.algo` imports numba: "
            f"{cold.get('numba_imported_by_vapo_async_algo', 'not measured')}.",
        ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    elems = [r["elements"] for r in rows]
    fig, (wall_ax, cpu_ax) = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    wall_ax.plot(elems, [r["loop"]["wall_s"] for r in rows], "ko-", label="Python loop (float64)")
    cpu_ax.plot(elems, [r["loop"]["cpu_s"] for r in rows], "ko-", label="Python loop (float64)")
    styles = {"compiled": "s-", "torch": "^--"}
    for threads in rows[0]["threads"]:
        for p in PATHS:
            wall_ax.plot(elems, [r["threads"][threads]["paths"][p]["out_s"] for r in rows], styles[p], label=f"{p}, out=, {threads} thread(s)")
        wall_ax.plot(elems, [r["threads"][threads]["bound_s"] for r in rows], ":", label=f"memory bound, {threads} thread(s)")
    for p in PATHS:
        cpu_ax.plot(elems, [r["threads"]["1"]["paths"][p]["fresh_cpu_s"] for r in rows], styles[p], label=f"{p}, fresh")
        cpu_ax.plot(elems, [r["threads"]["1"]["paths"][p]["out_cpu_s"] for r in rows], styles[p][0] + ":", label=f"{p}, out=")
    cpu_ax.plot(elems, [r["threads"]["1"]["bound_cpu_s"] for r in rows], "k:", label="memory bound")
    for ax, title in ((wall_ax, "wall clock (best of repeats)"), (cpu_ax, "CPU time of the process, 1 thread")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("B x T elements")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    wall_ax.set_ylabel("seconds")
    fig.suptitle(f"GAE with per-row lambda on CPU (load average {result['loadavg_start'][0]}-{result['loadavg_end'][0]} on 2 cores)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the two smallest sizes")
    parser.add_argument("--repeats", type=int, default=5, help="at least this many tries per timing (more at small sizes)")
    parser.add_argument("--loop-elems", type=int, default=2_000_000, help="time the loop on at most this many elements")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replot", type=Path, help="only rewrite the .md and .png from this bench_gae.json")
    args = parser.parse_args()
    if args.replot:
        result = json.loads(args.replot.read_text())
        write_markdown(result, args.out / "bench_gae.md")
        write_plot(result, args.out / "bench_gae.png")
        return
    if not gae_cpu.numba_available():
        raise SystemExit("bench_gae: numba is not installed; the compiled path cannot be measured")
    import numba

    sizes = SIZES[:2] if args.quick else SIZES
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "numba": numba.__version__,
        "default_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "compile": compile_times(),
        "rows": [],
    }
    print(json.dumps(result["compile"]), flush=True)
    for b, t in sizes:
        row = bench_size(b, t, args)
        result["rows"].append(row)
        print(json.dumps({k: row[k] for k in ("B", "T", "threads", "loop")}), flush=True)
    result["thp"] = thp_fresh(*sizes[-1], args.repeats)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gae.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, args.out / "bench_gae.md")
    write_plot(result, args.out / "bench_gae.png")
    print((args.out / "bench_gae.md").read_text())


if __name__ == "__main__":
    main()
