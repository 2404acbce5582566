"""The experiment harness's pure parts (benchmarks/_curves.py, _records.py, _runs.py, ablation.py, staleness.py): curve
statistics with hand-derived values, tables, TensorBoard read-back of a real event file, and the
derivation of every ablation row's overrides from algo/presets.py (composed with the real conf/)."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _curves as C  # noqa: E402
import _records as D  # noqa: E402
import _runs as R  # noqa: E402
import ablation  # noqa: E402
import staleness  # noqa: E402

from vapo_async.algo.presets import PRESETS, TECHNIQUES, vapo_without  # noqa: E402


def test_normalised_auc_hand_values() -> None:
    # points (0, 0.2), (10, 0.4), (20, 0.4): trapezoids 10 * 0.3 + 10 * 0.4 = 7, span 20 -> 0.35
    assert C.normalised_auc([(0, 0.2), (10, 0.4), (20, 0.4)]) == pytest.approx(0.35)
    # uneven spacing: (0, 0), (2, 1), (10, 1): 2 * 0.5 + 8 * 1 = 9, span 10 -> 0.9
    assert C.normalised_auc([(0, 0.0), (2, 1.0), (10, 1.0)]) == pytest.approx(0.9)
    assert C.normalised_auc([(5, 0.7)]) == 0.7
    assert C.normalised_auc([]) is None


def test_normalised_auc_matches_numpy_trapezoid_on_random_curves() -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(20):
        steps = np.sort(rng.choice(200, size=int(rng.integers(2, 12)), replace=False)).astype(float)
        vals = rng.random(len(steps))
        ref = np.trapezoid(vals, steps) / (steps[-1] - steps[0])
        assert C.normalised_auc(list(zip(steps.tolist(), vals.tolist(), strict=True))) == pytest.approx(ref)


def test_steps_to_threshold_and_final() -> None:
    curve = [(0, 0.3), (10, 0.59), (20, 0.6), (30, 0.5), (40, 0.8)]
    assert C.steps_to_threshold(curve, 0.6) == 20  # first step at or above, even if it drops later
    assert C.steps_to_threshold(curve, 0.9) is None
    assert C.steps_to_threshold(curve, 0.0) == 0
    assert C.final_value(curve) == 0.8
    assert C.final_value([]) is None


def test_mean_std_sample_std() -> None:
    # 0.5, 0.6, 0.7: mean 0.6, squared deviations 0.01 + 0 + 0.01 = 0.02, / (3 - 1) -> std 0.1
    m, s = C.mean_std([0.5, 0.6, 0.7])
    assert m == pytest.approx(0.6) and s == pytest.approx(0.1)
    assert C.mean_std([0.4]) == (0.4, 0.0)
    assert C.mean_std([]) == (None, None)


def test_mean_band_uses_common_steps_only() -> None:
    a = [(0, 0.2), (10, 0.4), (20, 0.6)]
    b = [(0, 0.4), (10, 0.8)]  # crashed before step 20: step 20 is not averaged over one curve
    steps, mean, std = C.mean_band([a, b])
    assert steps == [0, 10]
    assert mean == pytest.approx([0.3, 0.6])
    # two values x, y: sample std = |x - y| / sqrt(2)
    assert std == pytest.approx([0.2 / math.sqrt(2), 0.4 / math.sqrt(2)])


def _record(variant: str, seed: int, status: str, acc: list[tuple[float, float]], wall: float = 60.0) -> D.RunRecord:
    return D.RunRecord(variant, seed, [], status=status, wall_s=wall,
                       curves={"eval/accuracy": [[s, v] for s, v in acc]})


def test_summarise_excludes_crashes_from_statistics() -> None:
    runs = [
        _record("vapo", 0, "ok", [(0, 0.2), (10, 0.6), (20, 0.8)], wall=100),   # AUC (4 + 7) / 20 = 0.55
        _record("vapo", 1, "ok", [(0, 0.2), (10, 0.4), (20, 0.6)], wall=200),   # AUC (3 + 5) / 20 = 0.40
        _record("vapo", 2, "crash", [(0, 0.2)]),
        _record("vapo", 3, "timeout", [(0, 0.2), (10, 0.9)]),
    ]
    s = C.summarise("vapo", runs, threshold=0.6)
    assert (s.runs, s.crashes) == (4, 2)
    assert s.final_mean == pytest.approx(0.7) and s.final_std == pytest.approx(0.2 / math.sqrt(2))
    assert s.auc_mean == pytest.approx(0.475)
    assert s.reached == 2 and s.steps_to_threshold_mean == pytest.approx(15.0)  # steps 10 and 20
    assert s.wall_s_mean == pytest.approx(150.0)
    none = C.summarise("ppo", [_record("ppo", 0, "crash", [])], threshold=0.6)
    assert none.final_mean is None and none.crashes == 1 and C.fmt_mean_std(none.final_mean, None) == "–"


def test_throughput_skips_value_warmup_steps() -> None:
    rec = D.RunRecord("eta0", 0, [], status="ok", curves={
        "train/value_warmup": [[1, 1.0], [2, 0.0], [3, 0.0]],
        "perf/step_s": [[1, 100.0], [2, 2.0], [3, 3.0]],
        "batch/tokens": [[1, 9999.0], [2, 1000.0], [3, 1500.0]],
    })
    assert C.throughput(rec) == pytest.approx(2500.0 / 5.0)  # steps 2-3: 2500 tokens in 5 s
    assert C.throughput(D.RunRecord("x", 0, [])) is None


def test_markdown_table_and_format() -> None:
    text = C.markdown_table(["a", "b"], [[1, "x|y"], ["–", 2.5]])
    assert text.splitlines() == ["| a | b |", "| --- | --- |", "| 1 | x\\|y |", "| – | 2.5 |"]
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        C.markdown_table(["a", "b"], [[1]])
    assert C.fmt_mean_std(0.6123, 0.0345, scale=100) == "61.2 ± 3.5"


def test_spearman_hand_values() -> None:
    assert ablation.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert ablation.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # x ranks 0,1,2; y = [1, 3, 2] ranks 0,2,1: d = 0,1,1, rho = 1 - 6*2 / (3 * 8) = 0.5
    assert ablation.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert ablation.spearman([1, 2], [1, 2]) is None


def test_read_scalars_round_trip(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path / "tb"))
    for step, v in [(0, 0.25), (5, 0.5), (10, 0.75)]:
        w.add_scalar("eval/accuracy", v, step)
    w.add_scalar("rollout/accuracy", 0.125, 1)
    w.add_scalar("rollout/accuracy", 0.375, 1)  # the same step twice: the last value wins
    w.add_scalar("other/tag", 1.0, 1)
    w.close()
    got = D.read_scalars(tmp_path / "tb", ["eval/accuracy", "rollout/accuracy", "missing/tag"])
    assert got == {"eval/accuracy": [[0.0, 0.25], [5.0, 0.5], [10.0, 0.75]], "rollout/accuracy": [[1.0, 0.375]]}


def test_records_json_round_trip(tmp_path: Path) -> None:
    recs = [_record("vapo", 0, "ok", [(0, 0.2), (6, 0.5)]), _record("ppo", 1, "crash", [])]
    D.save_records(tmp_path / "runs.json", recs, {"budget": "quick"})
    meta, back = D.load_records(tmp_path / "runs.json")
    assert meta == {"budget": "quick"} and back == recs


def test_algo_overrides_follow_the_presets() -> None:
    b = ablation.BUDGETS["full"]
    # every technique row differs from vapo exactly in vapo_without's fields (plus name and budget)
    for t in TECHNIQUES:
        want = vapo_without(t)
        changed = {f.name for f in dataclasses.fields(want)
                   if getattr(want, f.name) != getattr(PRESETS["vapo"], f.name)} - set(ablation.BUDGET_FIELDS)
        keys = {o.split("=")[0].removeprefix("algo.") for o in ablation.algo_overrides(f"vapo_without_{t}", b)[1:]}
        assert keys == changed | set(ablation.BUDGET_FIELDS), t
    # same responses per step in every row: 16 prompts x 8, or 128 prompts x 1
    for v in ablation.VARIANTS:
        a = ablation.expected_algo(v, b)
        assert a.group_size * a.batch_groups == 128, v
    assert ablation.algo_overrides("ppo", b) == ["algo=ppo", "algo.value_warmup_steps=0", "algo.group_size=1",
                                                 "algo.batch_groups=128"]


def test_rows_compose_to_the_intended_configs() -> None:
    """Every full-budget ablation row, every long-task row and staleness row composes (real conf/)
    to its AlgoConfig; the long budget's rows all run the long task and write their own results."""
    ablation.check_rows(ablation.BUDGETS["full"])
    long = ablation.BUDGETS["long"]
    ablation.check_rows(long)
    assert long.common_overrides("posthoc")[0] == "data=synthetic_long" and long.results == "ablation_long_tail2"
    # the committed long table's budget pins the base it ran on (its key is in the table's logs)
    first = ablation.BUDGETS["long_base3000"]
    ablation.check_rows(first)
    assert first.results == "ablation_long" and first.variants == long.variants
    from vapo_async.data.tiny_base import config_key
    from vapo_async.learner.__main__ import compose_config
    key = config_key(compose_config(list(first.common_overrides("posthoc"))).model.tiny_base_config())
    assert key == "6f74901b60d5de56"
    staleness.check_rows(dataclasses.replace(staleness.BUDGETS["quick"], etas=(0, 4)))


def test_reap_reports_only_processes_that_outlive_the_settle_time() -> None:
    import signal
    import subprocess
    import threading

    import psutil

    def block_sigterm() -> None:  # a mask is inherited across exec: SIGTERM will not stop it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    quick = subprocess.Popen(["sleep", "0.5"])  # finishing its own shutdown: not a leftover
    stuck = subprocess.Popen(["sleep", "60"])  # a process the learner left running
    deaf = subprocess.Popen(["sleep", "61"], preexec_fn=block_sigterm)  # needs SIGKILL
    known = {p.pid: psutil.Process(p.pid) for p in (quick, stuck, deaf)}
    reaper = threading.Thread(target=quick.wait)  # reap it as its real parent would
    reaper.start()
    left = R._reap(known, settle_s=2.0, grace_s=3.0)
    reaper.join()
    assert sorted(left) == [f"sleep {stuck.pid} (sleep 60)", f"sleep {deaf.pid} (sleep 61)"], left
    assert not known[stuck.pid].is_running() and not known[deaf.pid].is_running()  # stopped, reaped


def test_run_harness_report_only_dry_run_and_resume(tmp_path, capsys, monkeypatch) -> None:
    """The main loop ablation.py and staleness.py share: --dry-run prints the commands, --resume
    runs only what the JSON does not hold as ok, --report-only reads the JSON back."""
    ran: list[str] = []

    def fake_run(rec: D.RunRecord, run_dir: Path, timeout_s: float, require_eval: bool = True) -> D.RunRecord:
        ran.append(f"{rec.variant}_s{rec.seed}")
        rec.status, rec.wall_s = "ok", 1.0
        return rec

    monkeypatch.setattr(R, "run_learner", fake_run)
    reports: list[tuple[dict, list[str], Path]] = []

    def report(meta: dict, records: list[D.RunRecord], out: Path) -> None:
        reports.append((meta, [f"{r.variant}_s{r.seed}" for r in records], out))

    def plan() -> R.Plan:
        todo = [D.RunRecord(v, 0, [f"algo={v}"]) for v in ("vapo", "ppo")]
        return R.Plan(todo, {"budget": "quick"}, timeout_s=60.0)

    def main(*argv: str) -> None:
        args = R.harness_parser("demo", "demo", ["quick"]).parse_args(["--out", str(tmp_path), *argv])
        R.run_harness(args, "demo", plan, report)

    main("--dry-run")
    assert capsys.readouterr().out.splitlines() == [
        f"python -m vapo_async.learner algo={v} seed=0 hydra.run.dir=DIR" for v in ("vapo", "ppo")]
    assert not ran and not reports
    D.save_records(tmp_path / "demo_runs.json", [D.RunRecord("vapo", 0, ["algo=vapo"], status="ok")], {})
    main("--resume")
    assert ran == ["ppo_s0"]  # vapo seed 0 is already ok in the JSON
    meta, names, out = reports[-1]
    assert names == ["vapo_s0", "ppo_s0"] and out == tmp_path and meta["skipped"] == [] and "total_wall_s" in meta
    main("--report-only")
    assert ran == ["ppo_s0"] and reports[-1][1] == ["vapo_s0", "ppo_s0"]


def test_resume_keeps_only_runs_the_plan_asks_for_unchanged(capsys) -> None:
    """--resume keeps an ok run with the plan's overrides, reruns one whose overrides changed (another
    budget), reruns crashes, and keeps ok runs of rows the plan does not name (nothing is dropped)."""
    saved = [D.RunRecord("vapo", 0, ["algo=vapo", "trainer.max_steps=36"], status="ok"),
             D.RunRecord("ppo", 0, ["algo=ppo", "trainer.max_steps=200"], status="ok"),
             D.RunRecord("grpo", 0, ["algo=grpo", "trainer.max_steps=36"], status="crash"),
             D.RunRecord("dapo", 0, ["algo=dapo", "trainer.max_steps=36"], status="ok")]
    todo = [D.RunRecord(v, 0, [f"algo={v}", "trainer.max_steps=36"]) for v in ("vapo", "ppo", "grpo")]
    kept, rest = R.resumable(saved, todo)
    assert [r.variant for r in kept] == ["vapo", "dapo"]
    assert [r.variant for r in rest] == ["ppo", "grpo"]
    assert "rerunning ppo seed 0: saved overrides differ" in capsys.readouterr().out


def test_difference_labels_resolved_or_within_two_standard_errors() -> None:
    def row(mean: float, std: float, runs: int) -> C.VariantSummary:
        return C.VariantSummary("x", runs, 0, mean, std, mean / 2, std / 4, 0, None, None)

    ref = row(0.5, 0.1, 3)
    # final: diff 0.10; s.e. = sqrt(0.1^2/3 + 0.1^2/3) = sqrt(0.00667) = 0.0816, 2 s.e. = 16.3 points
    assert ablation.difference(row(0.6, 0.1, 3), ref, "final") == "+10.0 points (2 s.e. 16.3: within seed noise)"
    # AUC: means 0.30 vs 0.25, stds 0.025: 2 s.e. = 2 sqrt(2 x 0.000625/3) = 0.0408 -> +5.0 resolved
    assert ablation.difference(row(0.6, 0.1, 3), ref, "auc") == "+5.0 points (2 s.e. 4.1: resolved)"
    assert ablation.difference(row(0.6, 0.0, 1), ref, "final") == "+10.0 points (one seed: noise not estimated)"


def test_staleness_switch_rows_and_differences() -> None:
    # the switches budget: decoupled at eta 0 and 8, each switch at eta 8 only
    assert staleness.BUDGETS["switches"].pairs() == [(0, "decoupled"), (8, "decoupled"), (8, "naive"), (8, "cap2"),
                                                     (8, "critic1")]
    assert len(staleness.BUDGETS["seeds"].pairs()) == 8  # eta 0, 2, 4, 8 x {decoupled, noweight}
    stats = {(0, "decoupled"): (0.70, 0.03, 3), (8, "decoupled"): (0.56, 0.03, 3), (8, "naive"): (0.40, 0.06, 3)}
    lines = staleness.differences([0, 8], ["decoupled", "naive"], stats)
    # eta 8 decoupled - eta 0: -14.0; s.e. sqrt(0.03^2/3 * 2) = 0.0245, 2 s.e. 4.9 points -> resolved
    assert lines[0] == "- decoupled minus decoupled at eta 0: eta 8: -14.0 points (2 s.e. 4.9: resolved)."
    # naive - decoupled at eta 8: -16.0; s.e. sqrt(0.0036/3 + 0.0009/3) = 0.0387, 2 s.e. 7.7 -> resolved
    assert lines[2] == ("- naive PPO (clip on pi_behav) minus decoupled at the same eta: "
                        "eta 8: -16.0 points (2 s.e. 7.7: resolved).")


def test_bases_are_built_once_before_the_timed_runs(tmp_path: Path) -> None:
    """Two seeds of one row and a second row share one base: ensure_bases builds it once, into the
    cache the runs read, so no run spends its timeout building it."""
    from vapo_async.data import tiny_base as tb
    from vapo_async.learner.__main__ import compose_config

    small = [f"model.tiny.cache_dir={tmp_path}", "model.tiny.train_steps=2", "model.tiny.hidden_size=64",
             "model.tiny.intermediate_size=128", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
             "model.tiny.num_kv_heads=1", "model.tiny.vocab_size=320", "model.tiny.n_train_problems=200",
             "model.tiny.tokenizer_problems=100", "model.tiny.batch_size=4", "model.tiny.warmup_steps=1",
             "model.tiny.bucket_batches=2", "model.tiny.num_threads=1"]
    todo = [D.RunRecord("vapo", 0, ["algo=vapo", *small]), D.RunRecord("vapo", 1, ["algo=vapo", *small]),
            D.RunRecord("ppo", 0, ["algo=ppo", *small])]
    R.ensure_bases(r.overrides for r in todo)
    built = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert built == [tb.model_dir(compose_config(small).model.tiny_base_config())]
    assert (built[0] / "model.safetensors").exists()
