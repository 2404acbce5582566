"""Resume by re-running the same command: the run directory and the decision to continue.

- ``name=NAME`` makes the run directory ``runs/NAME`` (the ``vapo.run_dir`` resolver of
  conf/learner.yaml; ``hydra.run.dir=DIR`` still wins). Without a name it is timestamped, so each
  command starts a new run.
- ``resume`` null (the default) continues from ``RUN_DIR/checkpoints/last.ckpt`` when it exists
  and starts fresh when it does not (Lightning's ``ckpt_path="last"`` habit); ``true`` requires
  the checkpoint; ``false`` starts fresh and is refused where a checkpoint exists (it would be
  overwritten).
- A continued run must agree with the checkpoint on what makes resuming meaningful: the fields
  of ``RESUME_KEYS``, written beside each checkpoint (``checkpoints/run.json``) and compared at
  start; a difference is refused naming the field. Other settings (learning rates, max_steps,
  eta, logging) may change between the runs.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vapo_async.learner.errors import ConfigError

if TYPE_CHECKING:  # config.py registers this module's resolver: no import at run time
    from vapo_async.learner.config import LearnerConfig

log = logging.getLogger("vapo_async.learner")

LAST = "last.ckpt"
SIDECAR = "run.json"
"""Beside ``last.ckpt``: the ``RESUME_KEYS`` values the checkpoint was made with."""
RESUME_KEYS = ("model.name", "model.path", "model.critic_path", "algo.name", "algo.group_size", "data.name")
"""Settings a resumed run must share with its checkpoint: the weights and optimiser states belong
to one model and algorithm; the controller's state to one dataset and group size."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def run_dir_for(name: str | None, stamp: str) -> str:
    """``hydra.run.dir`` of a run: ``runs/NAME``, or ``runs/STAMP`` without a name (resolver
    ``vapo.run_dir``)."""
    if name is None or name == "":
        return f"runs/{stamp}"
    if not _NAME.fullmatch(str(name)):
        raise ValueError(f"name={name!r}: letters, digits, '.', '_' and '-' only (it names the directory runs/NAME)")
    return f"runs/{name}"


def resume_keys(cfg: LearnerConfig) -> dict[str, Any]:
    """The ``RESUME_KEYS`` values of ``cfg``."""
    out = {}
    for key in RESUME_KEYS:
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part)
        out[key] = node
    return out


def write_resume_keys(ckpt_dir: Path, cfg: LearnerConfig) -> None:
    """Write ``ckpt_dir/run.json`` (rank 0, before each checkpoint is renamed into place)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / (SIDECAR + ".tmp")
    tmp.write_text(json.dumps(resume_keys(cfg), indent=1, sort_keys=True))
    tmp.replace(ckpt_dir / SIDECAR)


def should_resume(cfg: LearnerConfig, run_dir: Path) -> bool:
    """True: continue from ``run_dir/checkpoints/last.ckpt``; False: start fresh. Raises
    ConfigError when ``resume`` cannot be honoured or the checkpoint's settings differ."""
    ckpt_dir = run_dir / "checkpoints"
    exists = (ckpt_dir / LAST).exists()
    if cfg.resume is True and not exists:
        raise ConfigError(f"resume=true: no checkpoint at {ckpt_dir / LAST} (name=NAME or hydra.run.dir must be "
                          "the earlier run's)")
    if cfg.resume is False and exists:
        raise ConfigError(f"resume=false: {run_dir} holds a checkpoint that a fresh run would overwrite; choose "
                          "another name= (or hydra.run.dir=), or resume it (resume=null or true)")
    if not exists:
        return False
    check_resume_keys(cfg, ckpt_dir)
    return True


def check_resume_keys(cfg: LearnerConfig, ckpt_dir: Path) -> None:
    """Refuse a resume whose ``RESUME_KEYS`` differ from the checkpoint's (one line, the first
    differing field named)."""
    sidecar = ckpt_dir / SIDECAR
    if not sidecar.is_file():
        log.warning("%s is missing (a checkpoint of an older version): the settings are not compared", sidecar)
        return
    saved = json.loads(sidecar.read_text())
    for key, now in resume_keys(cfg).items():
        if key in saved and saved[key] != now:
            raise ConfigError(f"resume: {key}={now!r} but the checkpoint in {ckpt_dir} was made with "
                              f"{key}={saved[key]!r}; set it back, or start a new run (another name= or "
                              "hydra.run.dir=)")
