"""AReaL's staleness ablation, small: eta in {0, 1, 2, 4, 8}, with and without the behaviour weight.

    python benchmarks/staleness.py --budget quick          # <= 60 min on 2 CPU cores
    python benchmarks/staleness.py --budget seeds --resume   # eta 0, 2, 4, 8 x 3 seeds: staleness_seeds.*
    python benchmarks/staleness.py --budget switches --resume   # one switch each at eta 8: staleness_switches.*
    python benchmarks/staleness.py --budget lag      # eta 8 trained 48 steps: staleness_lag.*
    python benchmarks/staleness.py --budget full
    python benchmarks/staleness.py --report-only           # rebuild md/png from staleness_runs.json
    python benchmarks/staleness.py --budget seeds --report-only   # ... from staleness_seeds_runs.json

Each row is ``python -m vapo_async.learner algo=vapo algo.eta=ETA`` with one local generator, from
the same tiny base with the same sample budget; "decoupled" keeps the preset's capped behaviour
weight pi_prox / pi_behav (AReaL's decoupled objective), "no weight" sets ``algo.behav_cap=null``
(the clip stays centred on the recomputed pi_prox, but stale samples get no importance
correction). Reported: final held-out accuracy, trained tokens (prompt + response) per wall second
of the policy steps, and the staleness actually observed. Writes ``staleness.md`` (beside AReaL's
Table 2 numbers, with the notes of ``staleness.notes.md``), ``staleness.png`` and
``staleness_runs.json`` (``staleness_seeds.*`` for the seeds budget; every difference labelled
resolved or within seed noise); raw runs in ``benchmarks/results/tmp/NAME/`` (git-ignored).

AReaL's "naive PPO" (clip centred on pi_behav, ratio pi_theta / pi_behav) is the "naive" row,
``algo.proximal=behaviour``; "no weight" keeps the clip on pi_prox without the behaviour weight.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _curves as C  # noqa: E402
import _runs as R  # noqa: E402
from _posthoc import PosthocEval  # noqa: E402
from _records import RunRecord, run_meta  # noqa: E402

ETAS = (0, 1, 2, 4, 8)
MODES: dict[str, tuple[tuple[str, ...], str]] = {
    "decoupled": ((), "decoupled"),
    "noweight": (("algo.behav_cap=null",), "no weight"),
    "naive": (("algo.proximal=behaviour",), "naive PPO (clip on pi_behav)"),
    "cap2": (("algo.behav_cap=2.0",), "behaviour cap 2"),
    "critic1": (("algo.critic_max_staleness=1",), "critic on staleness <= 1"),
}
"""Row kinds: name -> (its algo overrides on top of the preset, its label). "decoupled" is AReaL's
decoupled objective as the preset has it (cap 5, masked); the others change one thing each."""
AREAL = {0: (42.0, 42.0), 1: (41.8, 42.1), 2: (40.0, 41.8), 4: (23.3, 42.2), 8: (35.7, 41.0)}
"""AReaL Table 2 (1.5B, AIME24): eta -> (naive PPO, decoupled objective) (PAPER.md)."""


@dataclass(frozen=True)
class Budget:
    """Rows, seeds and the per-run sample budget."""

    name: str
    etas: tuple[int, ...]
    seeds: tuple[int, ...]
    steps: int
    prompts: int
    samples: int
    value_warmup_steps: int
    eval_prompts: int
    eval_samples: int
    timeout_s: float
    results: str = "staleness"
    """Name of the results: ``RESULTS/NAME.md``, ``NAME.png``, ``NAME_runs.json``, ``NAME.notes.md``."""
    modes: tuple[str, ...] = ("decoupled", "noweight")
    """Row kinds (``MODES``), each at every eta in ``etas``..."""
    eta0_modes: tuple[str, ...] | None = None
    """... except at eta 0, where only these run when set (a switch about stale samples changes
    nothing there)."""
    posthoc_every: int | None = None
    """None: the learner evaluates at step 0 and the last step. Else the harness scores the run's kept
    versions after it (``PosthocEval``) at step 0, every this many steps and the last."""

    def eval_steps(self) -> list[int]:
        """The steps whose held-out accuracy is reported."""
        every = self.posthoc_every or self.steps
        return sorted({0, self.steps, *range(0, self.steps + 1, every)})

    def evaluator(self) -> PosthocEval | None:
        """The after-the-run evaluation, when this budget asks for one."""
        if self.posthoc_every is None:
            return None
        return PosthocEval(self.posthoc_every, self.eval_prompts, self.eval_samples)

    def pairs(self) -> list[tuple[int, str]]:
        """(eta, mode) of every row, eta-major."""
        return [(e, m) for e in self.etas for m in self.modes
                if e > 0 or self.eta0_modes is None or m in self.eta0_modes]

    def overrides(self, eta: int, mode: str) -> list[str]:
        """The row's learner overrides (held-out evaluation at step 0 and at the last step only, so
        evaluation pauses do not feed the pipeline mid-run)."""
        out = ["algo=vapo", f"algo.eta={eta}", f"algo.group_size={self.samples}",
               f"algo.batch_groups={self.prompts}", f"algo.value_warmup_steps={self.value_warmup_steps}"]
        out += MODES[mode][0]
        ev = self.evaluator()
        evaluation = ev.learner_overrides() if ev else [
            f"eval.every_n_steps={self.steps}", f"eval.n_prompts={self.eval_prompts}",
            f"eval.samples={self.eval_samples}"]
        return [*out, f"trainer.max_steps={self.steps}", *evaluation, f"checkpoint.every_n_steps={self.steps}", "logging.histograms_every_n_steps=0",
                "logging.text_every_n_steps=0", "trainer.enable_progress_bar=false",
                "eval.background=false"]

    def describe(self) -> str:
        kinds = ", ".join(MODES[m][1] for m in self.modes)
        only = f" (eta 0: {', '.join(self.eta0_modes)} only)" if self.eta0_modes is not None else ""
        return (f"budget `{self.name}`: eta {list(self.etas)} x {{{kinds}}}{only} x seeds "
                f"{list(self.seeds)}; VAPO, {self.steps} steps of {self.prompts} prompts x {self.samples} "
                f"samples ({self.value_warmup_steps} of them value pretraining), one local generator; "
                f"held-out avg@{self.eval_samples} on {self.eval_prompts} prompts at steps {self.eval_steps()}"
                f"{' (scored after the run)' if self.posthoc_every else ''}; timeout {self.timeout_s / 60:.0f} min/run")


BUDGETS = {
    "quick": Budget("quick", ETAS, (0,), steps=40, prompts=8, samples=8, value_warmup_steps=3,
                    eval_prompts=32, eval_samples=16, timeout_s=600),
    # seeds: eta 0, 2, 4, 8 x 3 seeds at the quick budget's scale (24 runs, ~1.8 h on 2 cores), all at
    # one code basis, in their own files (staleness_seeds.*) beside the one-seed quick table.
    "seeds": Budget("seeds", (0, 2, 4, 8), (0, 1, 2), steps=40, prompts=8, samples=8, value_warmup_steps=3,
                    eval_prompts=32, eval_samples=16, timeout_s=600, results="staleness_seeds"),
    # switches: why decoupled accuracy falls with eta, one switch each at eta 8 (AReaL's naive PPO,
    # a tighter behaviour cap, a critic trained on recent tokens only) beside the decoupled rows at
    # eta 0 and 8 of the same code (15 runs, ~70 min on 2 cores).
    "switches": Budget("switches", (0, 8), (0, 1, 2), steps=40, prompts=8, samples=8, value_warmup_steps=3,
                       eval_prompts=32, eval_samples=16, timeout_s=600, results="staleness_switches",
                       modes=("decoupled", "naive", "cap2", "critic1"), eta0_modes=("decoupled",)),
    # lag: decoupled at eta 8 trained 48 steps instead of 40 (3 seeds, ~15 min): does eta 8 reach
    # eta 0's step-40 accuracy once it has had the ~6 steps its samples lag behind?
    # Scored after each run at steps 0, 40 and 48 (the same run seen at both lengths).
    "lag": Budget("lag", (8,), (0, 1, 2), steps=48, prompts=8, samples=8, value_warmup_steps=3,
                  eval_prompts=32, eval_samples=16, timeout_s=720, results="staleness_lag",
                  modes=("decoupled",), posthoc_every=40),
    "full": Budget("full", ETAS, (0, 1, 2), steps=200, prompts=16, samples=8, value_warmup_steps=8,
                   eval_prompts=64, eval_samples=16, timeout_s=4 * 3600),
}


def row(eta: int, mode: str) -> str:
    return f"eta{eta}_{mode}"


def check_rows(budget: Budget) -> None:
    """Compose every row's config; raise if eta or a mode's algo fields did not land as intended."""
    from omegaconf import OmegaConf

    from vapo_async.learner.__main__ import compose_config

    for eta, mode in budget.pairs():
        algo = compose_config(budget.overrides(eta, mode)).algo
        want = OmegaConf.to_container(OmegaConf.from_dotlist([f"eta={eta}", *(o.removeprefix("algo.") for o in MODES[mode][0])]))
        got = {k: getattr(algo, k) for k in want}
        if got != want or (mode != "noweight" and algo.behav_cap is None):
            raise RuntimeError(f"row {row(eta, mode)}: composed {got}, behav_cap={algo.behav_cap}; wanted {want}")


def mean_of(record: RunRecord, tag: str) -> float | None:
    """Mean of a run's scalar over the steps it was logged (None when absent)."""
    pts = record.curve(tag)
    return sum(v for _, v in pts) / len(pts) if pts else None


def split_row(variant: str) -> tuple[int, str]:
    """``"eta8_naive"`` -> ``(8, "naive")``."""
    eta, mode = variant.split("_", 1)
    return int(eta.removeprefix("eta")), mode


Stats = dict[tuple[int, str], tuple[float | None, float | None, int]]
"""(eta, mode) -> (mean, std, n) of final held-out accuracy."""


def report(meta: dict, records: list[RunRecord], out_dir: Path, name: str = "staleness") -> None:
    """Write NAME.md and NAME.png from the records (the notes of NAME.notes.md appended)."""
    present = {split_row(r.variant) for r in records}
    etas = sorted({e for e, _ in present})
    modes = [m for m in MODES if any(pm == m for _, pm in present)]
    rows = []
    acc: dict[str, list[float | None]] = {m: [] for m in modes}
    tps: dict[str, list[float | None]] = {m: [] for m in modes}
    stats: Stats = {}
    for eta in etas:
        cells: list[object] = [eta]
        for mode in modes:
            runs = [r for r in records if r.variant == row(eta, mode)]
            ok = [r for r in runs if r.status == "ok"]
            finals = [v for v in (C.final_value(r.curve("eval/accuracy")) for r in ok) if v is not None]
            f = C.mean_std(finals)
            stats[eta, mode] = (*f, len(finals))
            t = C.mean_std([v for v in (C.throughput(r) for r in ok) if v is not None])
            st = C.mean_std([v for v in (mean_of(r, "async/staleness_mean") for r in ok) if v is not None])
            acc[mode].append(f[0])
            tps[mode].append(t[0])
            cells += ["–" if not runs else C.fmt_mean_std(*f, scale=100, n=len(finals)),
                      "–" if t[0] is None else f"{t[0]:.0f}", "–" if st[0] is None else f"{st[0]:.2f}",
                      "–" if not runs else f"{len(runs) - len(ok)}/{len(runs)}"]
        cells += [f"{AREAL[eta][1]:.1f} / {AREAL[eta][0]:.1f}" if eta in AREAL else "–"]
        rows.append(cells)
    header = ["eta"]
    for mode in modes:
        label = MODES[mode][1]
        header += [f"{label}: final acc (%)", f"{label}: tokens/s", f"{label}: staleness", f"{label}: crashed"]
    header.append("AReaL AIME24: decoupled / naive")
    plot(etas, acc, tps, out_dir / f"{name}.png")
    notes = out_dir / f"{name}.notes.md"
    lines = [
        "# Staleness: AReaL's Table 2 on the embedded task", "",
        f"Produced by `python benchmarks/staleness.py --budget {meta['budget']}` on {meta['machine']}, "
        f"{meta['date']}, commit {meta['commit']}; total wall time {meta.get('total_wall_s', 0) / 60:.0f} min.", "",
        f"What ran: {meta['description']}.",
        *([f"Skipped for time: {', '.join(meta['skipped'])}."] if meta.get("skipped") else []), "",
        C.markdown_table(header, rows), "",
        "final acc = held-out avg@16 at the last step (mean ± std over seeds); tokens/s = trained tokens "
        "(prompt + response) / wall seconds of the policy steps (waiting for rollouts + update + publish; "
        "value-pretraining steps excluded); staleness = mean over steps of `async/staleness_mean` (policy "
        "versions between a token's sampler and the step that trains it). Rows: "
        + "; ".join(f"{MODES[m][1]} = `{' '.join(MODES[m][0]) or 'algo=vapo'}`" for m in modes)
        + ". \"no weight\" keeps the clip centred on the recomputed pi_prox without the pi_prox / pi_behav "
        "correction; \"naive PPO\" centres the clip on pi_behav, as AReaL's naive PPO does.", "",
        f"![staleness]({name}.png)", "",
        "## Reading the results", "", "Computed from the data:", "", *reading(records, etas, modes, acc, tps, stats), "",
    ]
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    (out_dir / f"{name}.md").write_text("\n".join(lines))


def reading(records: list[RunRecord], etas: list[int], modes: list[str], acc: dict[str, list[float | None]],
            tps: dict[str, list[float | None]], stats: Stats) -> list[str]:
    """Sentences computed from the data: base accuracy, each mode over eta, the differences."""
    out = []
    start = C.mean_std([r.curve("eval/accuracy")[0][1] for r in records if r.curve("eval/accuracy")])
    if start[0] is not None:
        out.append(f"- Base model (step 0): held-out avg@16 = {C.fmt_mean_std(*start, scale=100)} %.")
    base = tps["decoupled"][0] if "decoupled" in tps and tps["decoupled"] else None
    for mode in modes:
        pairs = [(e, a, t) for e, a, t in zip(etas, acc[mode], tps[mode], strict=True) if a is not None]
        if pairs:
            out.append(f"- {MODES[mode][1]}: final accuracy " + ", ".join(f"eta {e}: {100 * a:.1f}" for e, a, _ in pairs)
                       + f"; throughput vs decoupled eta {etas[0]}: "
                       + ", ".join(f"{t / base:.2f}x" if t and base else "–" for _, _, t in pairs) + ".")
    out += differences(etas, modes, stats)
    out.append("- AReaL (1.5B): throughput 396.8k tok/s unbounded vs 128.7k at eta 0 (3.08x); "
               "accuracy held to eta 8 with the decoupled objective, naive PPO fell to 23.3 at eta 4.")
    return out


def differences(etas: list[int], modes: list[str], stats: Stats) -> list[str]:
    """Sentences on final accuracy, each labelled resolved or within seed noise
    (``_curves.difference``): every row minus decoupled at eta ``etas[0]``, and every other mode
    minus decoupled at the same eta."""
    out = []
    ref = stats.get((etas[0], "decoupled"))
    for mode in modes:
        cells = [(e, stats[e, mode]) for e in etas if stats.get((e, mode), (None,))[0] is not None
                 and (e, mode) != (etas[0], "decoupled")]
        if ref is not None and ref[0] is not None and cells:
            out.append(f"- {MODES[mode][1]} minus decoupled at eta {etas[0]}: "
                       + "; ".join(f"eta {e}: {C.difference(*st, *ref)}" for e, st in cells) + ".")
    for mode in modes:
        if mode == "decoupled":
            continue
        cells = [(e, stats[e, mode], stats[e, "decoupled"]) for e in etas
                 if stats.get((e, mode), (None,))[0] is not None and stats.get((e, "decoupled"), (None,))[0] is not None]
        if cells:
            out.append(f"- {MODES[mode][1]} minus decoupled at the same eta: "
                       + "; ".join(f"eta {e}: {C.difference(*st, *d)}" for e, st, d in cells) + ".")
    return out


def plot(etas: list[int], acc: dict[str, list[float | None]], tps: dict[str, list[float | None]], path: Path) -> None:
    """Two panels over eta: final accuracy (ours and AReaL's) and trained tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    styles = ("o-", "s--", "^-.", "v:", "D-")
    for (mode, vals), style in zip(acc.items(), styles, strict=False):
        xs = [e for e, v in zip(etas, vals, strict=True) if v is not None]
        a.plot(xs, [100 * v for v in vals if v is not None], style, label=f"ours: {MODES[mode][1]}")
        xs = [e for e, v in zip(etas, tps[mode], strict=True) if v is not None]
        b.plot(xs, [v for v in tps[mode] if v is not None], style, label=f"ours: {MODES[mode][1]}")
    ar = [e for e in etas if e in AREAL]
    a.plot(ar, [AREAL[e][1] for e in ar], "o:", color="grey", label="AReaL 1.5B AIME24: decoupled")
    a.plot(ar, [AREAL[e][0] for e in ar], "s:", color="silver", label="AReaL 1.5B AIME24: naive PPO")
    a.set(xlabel="eta (staleness bound)", ylabel="final accuracy (%)", title="Accuracy vs staleness bound")
    b.set(xlabel="eta (staleness bound)", ylabel="trained tokens / s", title="Throughput (2 CPU cores)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = R.harness_parser(__doc__.split("\n\n")[0], "staleness", BUDGETS)
    ap.add_argument("--etas", type=int, nargs="+", help="override the budget's staleness bounds")
    args = ap.parse_args()

    def plan() -> R.Plan:
        budget = BUDGETS[args.budget]
        budget = dataclasses.replace(budget, etas=tuple(args.etas or budget.etas),
                                     seeds=tuple(args.seeds or budget.seeds), steps=args.steps or budget.steps)
        check_rows(budget)
        todo = [RunRecord(row(e, m), s, budget.overrides(e, m)) for s in budget.seeds for e, m in budget.pairs()]
        meta = run_meta(budget.name, budget.describe(), [row(e, m) for e, m in budget.pairs()])
        return R.Plan(todo, meta, budget.timeout_s, budget.evaluator())

    name = BUDGETS[args.budget].results
    R.run_harness(args, name, plan, lambda meta, records, out: report(meta, records, out, name))


if __name__ == "__main__":
    main()
