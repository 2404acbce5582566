"""VAPO's Table 1, small: VAPO, VAPO without each technique, vanilla PPO, GRPO, DAPO on the task.

    python benchmarks/ablation.py --budget quick          # <= 60 min on 2 CPU cores (documented subset)
    python benchmarks/ablation.py --budget standard --resume   # every row x 3 seeds at quick's scale (~2.2 h)
    python benchmarks/ablation.py --budget full           # every variant, 3 seeds, 200 steps
    python benchmarks/ablation.py --budget long --resume  # the rows about long responses, data=synthetic_long
    python benchmarks/ablation.py --budget long_base3000 --report-only  # the 2026-12-07 long table (first base)
    python benchmarks/ablation.py --budget quick --dry-run   # print the commands, run nothing
    python benchmarks/ablation.py --report-only           # rebuild md/png from ablation_runs.json

Every run is ``python -m vapo_async.learner`` from the same tiny base with the same sample budget
(prompts x samples per step, steps, evaluation); only the algorithm overrides differ. They are
derived from ``vapo_async.algo.presets`` (``vapo_without(x)`` / ``PRESETS[name]`` diffed against
the preset the row starts from), and the composed learner config of every row is checked against
the intended ``AlgoConfig`` before anything runs, so the harness follows the presets as they change.

Writes ``benchmarks/results/ablation.md`` (``ablation_long_tail2.*`` for the long budget, ``ablation_long.*`` for long_base3000) (table beside the paper's Table 1, generated reading,
the notes in ``ablation.notes.md``), ``ablation.png`` (held-out accuracy, mean and +-1 std band per
row) and ``ablation_runs.json`` (every run: overrides, status, curves). Raw run directories go to
``benchmarks/results/tmp/ablation/`` (git-ignored). Runs are sequential, seed-major (every row
gets seed s before any row gets seed s+1), each with a timeout; a crash is recorded, not fatal.
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

from vapo_async.algo.presets import PRESETS, TECHNIQUES, AlgoConfig, preset, vapo_without  # noqa: E402
from vapo_async.common.overrides import hydra_value  # noqa: E402

VARIANTS = ("vapo", *(f"vapo_without_{t}" for t in TECHNIQUES), "ppo", "grpo", "dapo")
"""Every row of the full ablation."""

PAPER_AIME24 = {  # PAPER.md, VAPO Table 1 (AIME24 avg@32, Qwen2.5-32B); GRPO from DAPO's ablation
    "vapo": "60", "vapo_without_value_pretraining": "11", "vapo_without_decoupled_gae": "33",
    "vapo_without_length_adaptive_gae": "45", "vapo_without_clip_higher": "46",
    "vapo_without_token_level_loss": "53", "vapo_without_positive_nll": "54",
    "vapo_without_group_sampling": "55", "ppo": "5", "dapo": "50", "grpo": "30*",
}
BUDGET_FIELDS = ("group_size", "batch_groups", "value_warmup_steps")
"""AlgoConfig fields the budget sets for every row (same sample budget across rows)."""
MODEL_FIELDS = ("actor_lr", "critic_lr", "alpha")
"""AlgoConfig fields conf/model/tiny.yaml sets for every row alike (checked equal across rows)."""


@dataclass(frozen=True)
class Budget:
    """How much to run: rows, seeds, steps and the per-step sample budget."""

    name: str
    variants: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int
    prompts: int
    """Prompts per step for grouped rows (one-sample rows get prompts * samples prompts)."""
    samples: int
    """Samples per prompt (G) for grouped rows."""
    value_warmup_steps: int
    """Critic-only steps of rows with value pretraining (counted in ``steps``)."""
    eval_every: int
    eval_prompts: int
    eval_samples: int
    timeout_s: float
    """Per-run wall-clock limit."""
    task: tuple[str, ...] = ()
    """Learner overrides choosing the task, the same for every row (e.g. ``data=synthetic_long``)."""
    results: str = "ablation"
    """Name of the results: ``RESULTS/NAME.md``, ``NAME.png``, ``NAME_runs.json``, ``NAME.notes.md``."""

    def evaluator(self) -> PosthocEval:
        return PosthocEval(self.eval_every, self.eval_prompts, self.eval_samples)

    def common_overrides(self, eval_mode: str) -> list[str]:
        """Overrides every row shares (steps, evaluation, quiet logging). ``eval_mode``: "posthoc"
        (the harness scores the published versions) or "learner" (in-training ``eval/accuracy``,
        not in the background so that every evaluation happens at its step)."""
        if eval_mode == "posthoc":
            evaluation = self.evaluator().learner_overrides()
        else:
            evaluation = [f"eval.every_n_steps={self.eval_every}", f"eval.n_prompts={self.eval_prompts}",
                          f"eval.samples={self.eval_samples}", "eval.background=false"]
        return [*self.task, f"trainer.max_steps={self.steps}", *evaluation, f"checkpoint.every_n_steps={self.steps}",
                "logging.histograms_every_n_steps=0", "logging.text_every_n_steps=0",
                "trainer.enable_progress_bar=false"]

    def describe(self) -> str:
        task = f"task `{' '.join(self.task)}`, " if self.task else ""
        return (f"budget `{self.name}`: {task}{len(self.variants)} rows x seeds {list(self.seeds)}; "
                f"{self.steps} steps of {self.prompts * self.samples} responses "
                f"({self.prompts} prompts x {self.samples} samples; one-sample rows: "
                f"{self.prompts * self.samples} prompts x 1), value pretraining {self.value_warmup_steps} "
                f"of those steps where used; held-out avg@{self.eval_samples} on {self.eval_prompts} "
                f"prompts every {self.eval_every} steps (and at step 0); timeout {self.timeout_s / 60:.0f} min/run")


LONG_ROWS = ("vapo", "ppo", "vapo_without_decoupled_gae", "vapo_without_length_adaptive_gae",
             "vapo_without_value_pretraining", "grpo")
"""Item 2 of issue 21: the rows the paper's argument about long responses is about."""
LONG_BASE3000 = ("model.tiny.event_tail=1.0", "model.tiny.train_steps=3000", "model.tiny.batch_size=16")
"""The long task's first base (key 6f74901b60d5de56), on which ``ablation_long`` ran."""

BUDGETS = {
    # quick: sized to <= 60 min on 2 CPU cores (~4 min per run: engine start, 36 steps of 64
    # responses, post-hoc evaluation at 4 versions): the four algorithms x 3 seeds. 36 x 64 responses
    # are what the default run (16 x 8 per step) has seen by its step 18, where it has learnt. The
    # seven single-technique ablations need the `full` budget (or --variants).
    "quick": Budget("quick", ("vapo", "ppo", "grpo", "dapo"), (0, 1, 2), steps=36, prompts=8, samples=8,
                    value_warmup_steps=3, eval_every=12, eval_prompts=32, eval_samples=16, timeout_s=600),
    # standard: every row of Table 1 x 3 seeds at the quick budget's scale (33 runs of ~4 min:
    # ~2.2 h on 2 CPU cores); resumable (--resume keeps finished runs), so it may span sessions.
    "standard": Budget("standard", VARIANTS, (0, 1, 2), steps=36, prompts=8, samples=8, value_warmup_steps=3,
                       eval_every=12, eval_prompts=32, eval_samples=16, timeout_s=600),
    # long: the rows the paper's argument about long responses is about, on data=synthetic_long
    # (solutions of ~25-650 tokens) and its current base, at the quick budget's sample budget;
    # 6-24 min of learner time per run (PPO's responses double, to ~340 tokens: seed 1 took 1418 s
    # of a 1500-s limit, so the limit is 40 min); 212 min of learner time for all 18 (2026-12-07)
    # plus ~2 min of evaluation per run.
    "long": Budget("long", LONG_ROWS, (0, 1, 2), steps=36, prompts=8, samples=8,
                   value_warmup_steps=3, eval_every=12, eval_prompts=32, eval_samples=16, timeout_s=2400,
                   task=("data=synthetic_long",), results="ablation_long_tail2"),
    # long_base3000: the same on the long task's first base (event_tail 1, 3000 steps of 16, a 27-min
    # build), the base of the committed ablation_long table (2026-12-07); kept to regenerate it
    # (--report-only) and to rerun it as it ran.
    "long_base3000": Budget("long_base3000", LONG_ROWS, (0, 1, 2), steps=36, prompts=8, samples=8,
                            value_warmup_steps=3, eval_every=12, eval_prompts=32, eval_samples=16,
                            timeout_s=1500, task=("data=synthetic_long", *LONG_BASE3000),
                            results="ablation_long"),
    "full": Budget("full", VARIANTS, (0, 1, 2), steps=200, prompts=16, samples=8, value_warmup_steps=8,
                   eval_every=10, eval_prompts=64, eval_samples=16, timeout_s=4 * 3600),
}


def variant_config(variant: str) -> AlgoConfig:
    """The row's algorithm as the presets define it (before the budget's scale fields)."""
    if variant in PRESETS:
        return preset(variant)
    if variant.startswith("vapo_without_"):
        return vapo_without(variant.removeprefix("vapo_without_"))
    raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


def family(variant: str) -> str:
    """The ``algo=`` preset a row starts from."""
    return variant if variant in PRESETS else "vapo"


def expected_algo(variant: str, budget: Budget) -> AlgoConfig:
    """The row's algorithm with the budget's per-step sample budget and value-pretraining length."""
    cfg = variant_config(variant)
    group = budget.samples if cfg.group_size > 1 else 1
    return dataclasses.replace(cfg, group_size=group, batch_groups=budget.prompts * budget.samples // group,
                               value_warmup_steps=budget.value_warmup_steps if cfg.value_warmup_steps > 0 else 0)


def algo_overrides(variant: str, budget: Budget) -> list[str]:
    """``algo=FAMILY`` plus ``algo.FIELD=VALUE`` for every field where the row differs from its
    family preset, plus the budget fields (always explicit: conf/model/ sets them too)."""
    want, base = expected_algo(variant, budget), PRESETS[family(variant)]
    out = [f"algo={family(variant)}"]
    for f in dataclasses.fields(AlgoConfig):
        value = getattr(want, f.name)
        if f.name in BUDGET_FIELDS or value != getattr(base, f.name):
            out.append(f"algo.{f.name}={hydra_value(value)}")
    return out


def check_rows(budget: Budget) -> None:
    """Compose every row's learner config and compare its ``algo`` with ``expected_algo``; raise
    naming the first mismatch (e.g. a conf/ preset that no longer matches algo/presets.py)."""
    from vapo_async.learner.__main__ import compose_config

    lrs = set()
    for variant in budget.variants:
        cfg = compose_config([*algo_overrides(variant, budget), *budget.common_overrides("posthoc")])
        want = expected_algo(variant, budget)
        for f in dataclasses.fields(AlgoConfig):
            got = getattr(cfg.algo, f.name)
            if f.name not in MODEL_FIELDS and got != getattr(want, f.name):
                raise RuntimeError(f"row {variant}: composed algo.{f.name} = {got!r}, intended "
                                   f"{getattr(want, f.name)!r}")
        lrs.add(tuple(getattr(cfg.algo, f) for f in MODEL_FIELDS))
    if len(lrs) > 1:
        raise RuntimeError(f"rows got different {MODEL_FIELDS} {sorted(lrs)}; the comparison needs one")


# ---- report -------------------------------------------------------------------------------------

def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None for fewer than 3 pairs or no spread."""
    if len(xs) != len(ys) or len(xs) < 3:
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def table(summaries: list[C.VariantSummary], threshold: float) -> str:
    rows = []
    for s in summaries:
        steps = "–" if s.steps_to_threshold_mean is None else f"{s.steps_to_threshold_mean:.0f}"
        rows.append([s.variant, PAPER_AIME24.get(s.variant, "–"), C.fmt_mean_std(s.final_mean, s.final_std, 100, n=s.runs - s.crashes),
                     C.fmt_mean_std(s.auc_mean, s.auc_std, 100, n=s.runs - s.crashes), f"{steps} ({s.reached}/{s.runs - s.crashes})",
                     f"{s.crashes}/{s.runs}", "–" if s.wall_s_mean is None else f"{s.wall_s_mean / 60:.1f}"])
    header = ["row", "paper AIME24 avg@32", "final held-out avg@16 (%)", "AUC (%)",
              f"steps to >= {threshold:g} (reached/ok)", "crashed/runs", "min/run"]
    return C.markdown_table(header, rows)


def difference(row: C.VariantSummary, ref: C.VariantSummary, stat: str) -> str:
    """``row - ref`` of ``stat`` (``final`` or ``auc``): ``_curves.difference`` over the ok runs."""
    m1, s1, m0, s0 = (getattr(x, f"{stat}_{k}") for x in (row, ref) for k in ("mean", "std"))
    return C.difference(m1, s1, row.runs - row.crashes, m0, s0, ref.runs - ref.crashes)


def reading(summaries: list[C.VariantSummary], records: list[RunRecord]) -> list[str]:
    """Sentences computed from the data: base accuracy, ranking, each row vs VAPO, paper agreement."""
    out = []
    base = [r.curve("eval/accuracy")[0][1] for r in records if r.curve("eval/accuracy") and r.curve("eval/accuracy")[0][0] == 0]
    if base:
        m, s = C.mean_std(base)
        out.append(f"- Base model (step 0, every run): held-out avg@16 = {100 * m:.1f} ± {100 * s:.1f} %.")
    ranked = sorted((s for s in summaries if s.final_mean is not None), key=lambda s: -s.final_mean)  # type: ignore[operator]
    out.append("- Ranking by final accuracy: " + " > ".join(f"{s.variant} ({100 * s.final_mean:.1f})" for s in ranked) + ".")  # type: ignore[operator]
    by = {s.variant: s for s in summaries}
    ref = by.get("vapo")
    if ref is not None and ref.final_mean is not None:
        for s in summaries:
            if s.variant == "vapo" or s.final_mean is None:
                continue
            paper = PAPER_AIME24.get(s.variant, "").rstrip("*")
            pdiff = f"; paper: {float(paper) - 60:+.0f} points" if paper else ""
            out.append(f"- {s.variant} - vapo: final {difference(s, ref, 'final')}, "
                       f"AUC {difference(s, ref, 'auc')}{pdiff}.")
    pairs = [(s.final_mean, float(PAPER_AIME24[s.variant].rstrip("*"))) for s in summaries
             if s.final_mean is not None and s.variant in PAPER_AIME24]
    rho = spearman([a for a, _ in pairs], [b for _, b in pairs])
    if rho is not None:
        out.append(f"- Spearman rank correlation with the paper's scores over these {len(pairs)} rows: {rho:+.2f}.")
    crashed = sum(s.crashes for s in summaries)
    out.append(f"- Crashed or timed-out runs: {crashed} of {sum(s.runs for s in summaries)}.")
    return out


def report(meta: dict, records: list[RunRecord], threshold: float, out_dir: Path, name: str = "ablation") -> None:
    """Write NAME.md and the plots from the records."""
    variants = [v for v in meta["variants"] if any(r.variant == v for r in records)]
    summaries = [C.summarise(v, [r for r in records if r.variant == v], threshold) for v in variants]
    C.plot_curves({v: [r.curve("eval/accuracy") for r in records if r.variant == v and r.status == "ok"] for v in variants},
                  out_dir / f"{name}.png", f"Held-out accuracy (avg@16), {meta['budget']} budget, mean ± std over seeds",
                  "eval/accuracy", hline=threshold)
    C.plot_curves({v: [r.curve("rollout/accuracy") for r in records if r.variant == v and r.status == "ok"] for v in variants},
                  out_dir / f"{name}_rollout.png", "Training-batch accuracy (rollout/accuracy)", "rollout/accuracy")
    notes = out_dir / f"{name}.notes.md"
    task = " ".join(meta.get("task", [])) or "data=synthetic"
    lengths = {v: C.mean_std([sum(y for _, y in c) / len(c) for r in records if r.variant == v and r.status == "ok"
                              if (c := r.curve("rollout/response_length_mean"))]) for v in variants}
    lines = [
        f"# Ablation: VAPO's Table 1 on the embedded task (`{task}`)", "",
        f"Produced by `python benchmarks/ablation.py --budget {meta['budget']}` on {meta['machine']}, "
        f"{meta['date']}, commit {meta['commit']}; learner wall time of all runs "
        f"{sum(r.wall_s for r in records) / 60:.0f} min.", "",
        f"What ran: {meta['description']}.",
        *([f"Skipped for time: {', '.join(meta['skipped'])}."] if meta.get("skipped") else []),
        "Every row starts from the same tiny base with the same responses per step; the overrides of "
        f"each row are listed in `{name}_runs.json`.", "",
        table(summaries, threshold), "",
        "Final = held-out avg@16 at the last step (mean ± sample std over seeds, crashed runs excluded); "
        "AUC = time-average of the held-out accuracy curve over the run (trapezoid / span); steps to "
        "threshold = first evaluation at or above it, mean over the runs that reached it. "
        "Paper column: VAPO Table 1 (Qwen2.5-32B, AIME24 avg@32, 5,000+ steps); "
        "*GRPO is not in Table 1: 30 is the GRPO baseline of DAPO's ablation (PAPER.md).", "",
        f"![held-out accuracy]({name}.png)", "",
        f"![training accuracy]({name}_rollout.png)", "",
        "## Reading the results", "", "Computed from the data:", "", *reading(summaries, records),
        "- Mean response length over each run (rollout/response_length_mean, mean ± std over seeds): "
        + "; ".join(f"{v} {m:.0f} ± {sd:.0f}" for v, (m, sd) in lengths.items() if m is not None) + " tokens.", "",
    ]
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    (out_dir / f"{name}.md").write_text("\n".join(lines))


# ---- main ---------------------------------------------------------------------------------------

def main() -> None:
    ap = R.harness_parser(__doc__.split("\n\n")[0], "ablation", BUDGETS)
    ap.add_argument("--variants", nargs="+", help="override the budget's rows")
    ap.add_argument("--threshold", type=float, default=0.6, help="held-out accuracy for 'steps to threshold'")
    ap.add_argument("--eval", choices=("posthoc", "learner"), default="posthoc",
                    help="held-out accuracy scored by the harness after each run (default) or by the learner")
    args = ap.parse_args()
    name = BUDGETS[args.budget].results

    def plan() -> R.Plan:
        budget = BUDGETS[args.budget]
        budget = dataclasses.replace(budget, variants=tuple(args.variants or budget.variants),
                                     seeds=tuple(args.seeds or budget.seeds), steps=args.steps or budget.steps)
        check_rows(budget)
        todo = [RunRecord(v, s, [*algo_overrides(v, budget), *budget.common_overrides(args.eval)])
                for s in budget.seeds for v in budget.variants]
        meta = {**run_meta(budget.name, budget.describe(), list(budget.variants)), "eval": args.eval,
                "task": list(budget.task)}
        return R.Plan(todo, meta, budget.timeout_s, budget.evaluator() if args.eval == "posthoc" else None)

    R.run_harness(args, name, plan, lambda meta, records, out: report(meta, records, args.threshold, out, name))


if __name__ == "__main__":
    main()
