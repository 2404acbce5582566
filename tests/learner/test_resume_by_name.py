"""Resume by re-running (learner/resume.py): ``name=NAME`` is ``runs/NAME``; ``resume`` null continues
where a checkpoint exists; a checkpoint made with another model, algorithm, group size or dataset
is refused naming the field; nothing is overwritten by ``resume=false``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from vapo_async.learner.__main__ import CONF_DIR
from vapo_async.learner.config import ConfigError, LearnerConfig
from vapo_async.learner.resume import (
    SIDECAR,
    resume_keys,
    run_dir_for,
    should_resume,
    write_resume_keys,
)

SRC = Path(__file__).resolve().parents[2] / "src"


def _compose(overrides: list[str]) -> LearnerConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose(config_name="learner", overrides=overrides))


def _run_dir_with_checkpoint(tmp_path: Path, cfg: LearnerConfig) -> Path:
    run_dir = tmp_path / "runs" / "x"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"not read here")
    write_resume_keys(run_dir / "checkpoints", cfg)
    return run_dir


def test_name_is_the_run_directory_and_the_resolved_hydra_config_says_so():
    assert run_dir_for("exp-1.a", "2026-12-06_01-00-00") == "runs/exp-1.a"
    assert run_dir_for(None, "2026-12-06_01-00-00") == "runs/2026-12-06_01-00-00"
    for bad in ("a/b", "../x", "", " x"):
        if bad:
            with pytest.raises(ValueError, match="letters, digits"):
                run_dir_for(bad, "s")
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-m", "vapo_async.learner", "name=exp1", "--cfg", "all", "--resolve"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "    dir: runs/exp1\n" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "vapo_async.learner", "name=a/b"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "name='a/b'" in bad.stderr and "Traceback" not in bad.stderr


def test_resume_null_continues_where_a_checkpoint_exists_and_starts_fresh_where_not(tmp_path):
    cfg = _compose(["name=x"])
    assert cfg.resume is None
    assert should_resume(cfg, tmp_path / "runs" / "new") is False  # nothing there: fresh
    run_dir = _run_dir_with_checkpoint(tmp_path, cfg)
    assert should_resume(cfg, run_dir) is True
    # settings that may change between the runs
    assert should_resume(_compose(["name=x", "trainer.max_steps=999", "algo.eta=3", "algo.actor_lr=1e-5"]), run_dir)
    assert json.loads((run_dir / "checkpoints" / SIDECAR).read_text()) == resume_keys(cfg)


def test_resume_true_needs_a_checkpoint_and_false_never_overwrites_one(tmp_path):
    with pytest.raises(ConfigError, match=r"resume=true: no checkpoint at .*last\.ckpt"):
        should_resume(_compose(["resume=true"]), tmp_path / "empty")
    assert should_resume(_compose(["resume=false"]), tmp_path / "empty") is False
    run_dir = _run_dir_with_checkpoint(tmp_path, _compose([]))
    with pytest.raises(ConfigError, match="resume=false: .* holds a checkpoint"):
        should_resume(_compose(["resume=false"]), run_dir)
    assert (run_dir / "checkpoints" / "last.ckpt").read_bytes() == b"not read here"


@pytest.mark.parametrize(("override", "field"), [
    ("algo=dapo", "algo.name"), ("algo.group_size=4", "algo.group_size"), ("data=gsm8k", "data.name"),
    ("model.critic_path=/some/rm", "model.critic_path"),
])
def test_a_checkpoint_of_another_model_algorithm_or_dataset_is_refused_naming_the_field(tmp_path, override, field):
    run_dir = _run_dir_with_checkpoint(tmp_path, _compose([]))
    with pytest.raises(ConfigError, match=rf"resume: {field}=.* but the checkpoint in .* was made with {field}="):
        should_resume(_compose([override]), run_dir)


def test_a_checkpoint_without_its_settings_file_still_resumes(tmp_path, caplog):
    run_dir = _run_dir_with_checkpoint(tmp_path, _compose([]))
    (run_dir / "checkpoints" / SIDECAR).unlink()
    assert should_resume(_compose(["algo=dapo"]), run_dir) is True
    assert "settings are not compared" in caplog.text
