"""Where a policy's wrong answers on the synthetic task come from: line-by-line error classes.

    python benchmarks/base_errors.py                          # the default tiny base
    python benchmarks/base_errors.py --model DIR [--model DIR2 ...] [--label NAME ...]

Samples k responses per held-out problem (vLLM, temperature 1.0, top_p 1.0, the RL sampling
setting) and parses every solution line ``(i) <verb> <sign><k>: <before> <op> <k> = <after>``
against the problem's own events. Per line: was the event's verb copied from the question, was its
operand copied, is the sign (the one after the verb) right for the true verb and for the verb the
model wrote, separately for plain and exchange events, is the arithmetic of the line right, does
the line start from the previous line's result. Per response:
does it write one line per event, and is the answer right. This is the measurement behind the
README's statement of why reinforcement learning moves the default run so little: a decision RL can
sharpen must be one the model already gets right sometimes and that decides the reward on its own.

Results: benchmarks/results/base_errors.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vapo_async.common.engine import EngineConfig  # noqa: E402
from vapo_async.data import DataConfig, load_prompts, synthetic  # noqa: E402
from vapo_async.data import tiny_base as tb  # noqa: E402
from vapo_async.eval import ProblemResult, build_llm, evaluate, shutdown_llm  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
LINE = re.compile(r"^\((?P<i>\d+)\) (?P<verb>[a-z]+) (?P<s>[+-])(?P<k>\d+): "
                  r"(?P<a>-?\d+) (?P<op>[+-]) (?P<b>\d+) = (?P<c>-?\d+)$")
LINE_KEYS = ("verb_copied", "operand_copied", "sign_right_for_true_verb", "sign_right_for_written_verb",
             "arithmetic_right", "chained")
"""Per-line rates, each over all parsed lines of events that exist in the problem."""
KIND_KEYS = {"sign_right_plain": "plain_lines", "sign_right_exchange": "exchange_lines"}
"""Sign right for the question's verb, over the lines of plain / exchange events only."""


def classify(text: str, problem: synthetic.SyntheticProblem) -> tuple[dict[str, int], dict[str, bool]]:
    """(line counts by class, response flags) of one response to ``problem``."""
    counts = dict.fromkeys(("lines", *LINE_KEYS, *KIND_KEYS, *KIND_KEYS.values()), 0)
    value = problem.start
    n_lines = 0
    for raw in text.strip().split("\n"):
        m = LINE.match(raw.strip())
        if not m:
            continue
        n_lines += 1
        i = int(m["i"]) - 1
        if not 0 <= i < len(problem.steps):
            continue
        step = problem.steps[i]
        sign = 1 if m["s"] == "+" else -1
        op = 1 if m["op"] == "+" else -1
        a, b, c = int(m["a"]), int(m["b"]), int(m["c"])
        written = synthetic.VERBS.get(m["verb"])
        counts["lines"] += 1
        counts["verb_copied"] += m["verb"] == step.verb
        counts["operand_copied"] += int(m["k"]) == step.k
        counts["sign_right_for_true_verb"] += sign == step.sign
        counts["sign_right_for_written_verb"] += written is not None and sign == written[0]
        counts["arithmetic_right"] += c == a + op * b
        kind = "exchange" if step.is_exchange else "plain"
        counts[f"{kind}_lines"] += 1
        counts[f"sign_right_{kind}"] += sign == step.sign
        counts["chained"] += a == value
        value = c
    flags = {"one_line_per_event": n_lines == len(problem.steps)}
    return counts, flags


def analyse(results: list[ProblemResult], problems: list[synthetic.SyntheticProblem]) -> dict[str, float]:
    """Rates over every response of ``results``."""
    total = dict.fromkeys(("lines", *LINE_KEYS, *KIND_KEYS, *KIND_KEYS.values()), 0)
    responses = one_line = correct = 0
    for r in results:
        problem = problems[int(r.record.uid.rsplit(":", 1)[1])]
        for text, score in zip(r.texts, r.scores, strict=True):
            counts, flags = classify(text, problem)
            for key, v in counts.items():
                total[key] += v
            responses += 1
            one_line += flags["one_line_per_event"]
            correct += bool(score.correct)
    lines = max(total["lines"], 1)
    return {"responses": responses, "lines": total["lines"], "accuracy": correct / max(responses, 1),
            "one_line_per_event": one_line / max(responses, 1),
            **{key: total[key] / lines for key in LINE_KEYS},
            **{key: total[key] / max(total[of], 1) for key, of in KIND_KEYS.items()}}


def measure(model: str, n: int, k: int) -> dict[str, float]:
    """Sample and analyse one model directory."""
    prompts = load_prompts(DataConfig(name="synthetic", n_eval=n, difficulty=2), "eval")
    problems = synthetic.make_problems(n, 0, 2, "eval")
    llm = build_llm(model, EngineConfig(max_model_len=1024, seed=0))
    try:
        results: list[ProblemResult] = []
        evaluate(llm, prompts, k, temperature=1.0, top_p=1.0, max_tokens=400, results_out=results)
    finally:
        shutdown_llm(llm)
    return analyse(results, problems)


def markdown(res: dict[str, object]) -> str:
    rows = res["models"]
    assert isinstance(rows, list)
    head = "| class | " + " | ".join(r["label"] for r in rows) + " |"
    lines = ["# Error classes of the synthetic task's solutions", "",
             f"Machine: {res['machine']}. Held-out difficulty 2: {res['problems']} problems x {res['k']} samples, "
             "temperature 1.0, top_p 1.0 (vLLM). Produced by `python benchmarks/base_errors.py`.", "",
             head, "|---|" + "---|" * len(rows)]
    names = [("accuracy", "answer right (per response)"), ("one_line_per_event", "one line per event (per response)"),
             ("verb_copied", "verb copied from the question (per line)"),
             ("operand_copied", "operand copied from the question (per line)"),
             ("sign_right_for_true_verb", "sign right for the question's verb (per line)"),
             ("sign_right_for_written_verb", "sign right for the verb it wrote (per line)"),
             ("sign_right_plain", "sign right, plain events (buys, loses, ...)"),
             ("sign_right_exchange", "sign right, exchange events (gives, gets, ...)"),
             ("arithmetic_right", "line's arithmetic right (per line)"),
             ("chained", "line starts from the previous result (per line)")]
    for key, name in names:
        lines.append(f"| {name} | " + " | ".join(f"{r[key]:.1%}" for r in rows) + " |")
    lines.append("| lines parsed | " + " | ".join(str(r["lines"]) for r in rows) + " |")
    lines.append("")
    return "\n".join(lines)


def plot(res: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["models"]
    assert isinstance(rows, list)
    keys = ["accuracy", *LINE_KEYS, *KIND_KEYS]
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / max(len(rows), 1)
    for j, r in enumerate(rows):
        ax.bar([i + j * width for i in range(len(keys))], [r[k] for k in keys], width, label=r["label"])
    ax.set_xticks([i + width * (len(rows) - 1) / 2 for i in range(len(keys))])
    ax.set_xticklabels([k.replace("_", "\n") for k in keys], fontsize=8)
    ax.set(ylim=(0, 1), ylabel="rate", title="Where wrong answers come from (held-out, difficulty 2)")
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, action="append", help="model directory (repeatable); default: tiny base")
    ap.add_argument("--label", action="append", help="a label per --model")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--k", type=int, default=16)
    args = ap.parse_args()
    models = args.model or [tb.ensure_tiny_base(tb.TinyBaseConfig())]
    labels = args.label or ["tiny base" if not args.model else m.name for m in models]
    if len(labels) != len(models):
        ap.error(f"{len(labels)} --label for {len(models)} --model")
    rows = [{"label": label, "model": str(m), **measure(str(m), args.problems, args.k)}
            for label, m in zip(labels, models, strict=True)]
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "problems": args.problems, "k": args.k,
           "models": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "base_errors.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "base_errors.md").write_text(markdown(res))
    plot(res, RESULTS / "base_errors.png")
    print(markdown(res))


if __name__ == "__main__":
    main()
