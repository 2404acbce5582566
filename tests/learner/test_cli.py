"""Hydra's command-line flags on ``python -m vapo_async.learner``: ``--cfg``/``-c`` (with
``--package``, ``--resolve``) print the composed config and exit 0, ``--info`` exits 0, ``-m``
sweeps are expanded the way Hydra's basic sweeper expands them and every job is checked before the
first starts; one-line errors (exit code 2) stay. The sweep that really runs two jobs is in
test_console.py (it shares that run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra._internal.utils import get_args_parser

from vapo_async.learner.__main__ import _composer, _sweep_jobs, check_command_line
from vapo_async.learner.config import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "vapo_async.learner", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=180)


def test_cfg_job_prints_the_composed_config_with_the_overrides(tmp_path):
    # the flag's value ("job") used to be read as an override: "Error parsing override 'job'"
    proc = _cli("algo=dapo", "algo.eta=3", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["algo"]["name"] == "dapo" and cfg["algo"]["eta"] == 3
    assert "hydra" not in cfg  # job: the task's config only
    assert not (tmp_path / "runs").exists() and not (tmp_path / "multirun").exists()  # printing runs nothing


def test_short_cfg_flag_with_package_and_resolve(tmp_path):
    proc = _cli("-c", "job", "-p", "algo", "--resolve", "algo=dapo", "algo.eta=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("# @package algo")
    algo = yaml.safe_load(proc.stdout)  # only the algo node
    assert algo["name"] == "dapo" and algo["eta"] == 3 and "trainer" not in algo


def test_cfg_hydra_shows_that_the_learner_routes_its_own_logging(tmp_path):
    proc = _cli("--cfg", "hydra", "--resolve", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hydra = yaml.safe_load(proc.stdout)["hydra"]
    assert hydra["job_logging"]["root"] is None  # hydra/job_logging=none: console.py sets it up
    assert hydra["run"]["dir"].startswith("runs/20")  # no name: a timestamped run directory


@pytest.mark.parametrize("info", [[], ["defaults"]])
def test_info_exits_0(tmp_path, info):
    proc = _cli("--info", *info, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "model/tiny" in proc.stdout  # the defaults list is part of every --info form used here


@pytest.mark.parametrize("args", [["-m", "trainer.max_steps=1,2", "algo.etaa=1"], ["algo.etaa=1", "--cfg", "job"]])
def test_typo_is_still_one_line_and_exit_2(tmp_path, args):
    proc = _cli(*args, cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vapo_async.learner: error:") and "algo.etaa" in lines[0], lines
    assert not (tmp_path / "multirun").exists()  # no job started


def _jobs(argv: list[str]) -> list[list[str]]:
    args = get_args_parser().parse_args(argv)
    with _composer(args) as hydra:
        return _sweep_jobs(hydra, "learner", args.overrides)


def test_sweep_syntax_expands_as_hydras_basic_sweeper_does():
    # the cartesian product, the later key varying fastest; range(1,3) = 1, 2; a key given once
    # is in every job
    assert _jobs(["-m", "trainer.max_steps=range(1,3)", "algo=grpo,dapo", "algo.eta=2"]) == [
        ["trainer.max_steps=1", "algo=grpo", "algo.eta=2"], ["trainer.max_steps=1", "algo=dapo", "algo.eta=2"],
        ["trainer.max_steps=2", "algo=grpo", "algo.eta=2"], ["trainer.max_steps=2", "algo=dapo", "algo.eta=2"],
    ]
    # glob() over the algo group: conf/algo/{dapo,grpo,ppo,vapo}.yaml plus the structured presets
    # the config store registers as <name>_preset, sorted; excluding those and ppo leaves three
    algos = "algo=glob(*,exclude=[*_preset,ppo])"
    assert _jobs(["-m", algos]) == [["algo=dapo"], ["algo=grpo"], ["algo=vapo"]]
    check_command_line(["-m", "trainer.max_steps=range(1,3)", algos])  # all 6 jobs are valid


def test_each_sweep_job_is_checked_before_any_starts():
    with pytest.raises(ConfigError, match=r"^sweep job #1 \(trainer.max_steps=abc\): .*trainer.max_steps"):
        check_command_line(["-m", "trainer.max_steps=1,abc"])
    # validation (not only composition) runs per job: config.validate wants max_steps >= 1
    with pytest.raises(ConfigError, match=r"^sweep job #1 \(trainer.max_steps=0\): trainer.max_steps=0: must be >= 1"):
        check_command_line(["-m", "trainer.max_steps=1,0"])
    # a job needing a process per device cannot run inside this one
    with pytest.raises(ConfigError, match=r"^sweep job #0 .*trainer.devices=2"):
        check_command_line(["-m", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=1,2"])


def test_sweep_syntax_without_multirun_is_one_line():
    with pytest.raises(ConfigError, match="Ambiguous value for argument 'trainer.max_steps=1,2'"):
        check_command_line(["trainer.max_steps=1,2"])
