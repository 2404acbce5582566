"""Which model preset a command line means: ``model.path=DIR`` without ``model=`` is ``model=hf``.

The default preset (conf/model/tiny.yaml) scales every knob for the embedded ~1M-parameter base
(actor lr 1.5e-4, alpha 0.5, 256-token responses, evaluation every 10 steps). A Hugging Face model
named by ``model.path=DIR`` must not inherit them silently, so:

    python -m vapo_async.learner model.path=/models/qwen2.5-1.5b
        = python -m vapo_async.learner model=hf model.path=/models/qwen2.5-1.5b   (one line says so)
    python -m vapo_async.learner model=tiny model.path=DIR      -> refused, naming the presets

``implied_overrides`` rewrites the command line before Hydra reads it (``__main__.main``);
``check_model_preset`` is part of ``config.validate``, so the refusal holds however the config was
composed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vapo_async.learner.errors import ConfigError

log = logging.getLogger("vapo_async.learner")
MODEL_CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"
IMPLIED = "hf"
"""The preset ``model.path=DIR`` alone means (conf/model/hf.yaml)."""


def model_presets() -> list[str]:
    """Names of the model presets (conf/model/NAME.yaml), sorted."""
    return sorted(p.stem for p in MODEL_CONF_DIR.glob("*.yaml"))


def _key(arg: str) -> str | None:
    """The key a command-line override sets (``++model.path=x`` -> ``model.path``, ``~model`` ->
    ``model``); None for a flag (``--cfg``) or a flag's value (``job``)."""
    if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
        return None
    return arg.split("=", 1)[0].lstrip("+~")


def implied_overrides(args: list[str]) -> list[str]:
    """``args`` (the command line after the program name, Hydra flags included) with ``model=hf``
    inserted before the first ``model.path=DIR`` when no override picks a model preset; logs one
    line when it does. ``model.path=null`` picks nothing (the tiny base)."""
    keys = [_key(a) for a in args]
    if "model" in keys:
        return list(args)
    at = next((i for i, (key, arg) in enumerate(zip(keys, args, strict=True))
               if key == "model.path" and arg.split("=", 1)[1] not in ("null", "")), None)
    if at is None:
        return list(args)
    log.warning("model.path without model=: using model=%s (a Hugging Face model of unknown scale with the "
                "papers' settings, conf/model/%s.yaml); presets: %s", IMPLIED, IMPLIED, ", ".join(model_presets()))
    return [*args[:at], f"model={IMPLIED}", *args[at:]]


def check_model_preset(name: str, path: str | None) -> None:
    """ConfigError (one line) for the tiny preset given a model directory (its knobs are scaled for
    the embedded base it builds itself, not for the model at ``path``) and for ``model=hf`` without
    one."""
    if name == IMPLIED and path is None:
        raise ConfigError(f"model={IMPLIED} needs model.path=DIR (a Hugging Face model directory or hub id)")
    if name == "tiny" and path is not None:
        others = [p for p in model_presets() if p != "tiny"]
        raise ConfigError(f"model=tiny with model.path={path}: the tiny preset's knobs fit only the tiny base it "
                          f"builds; drop model=tiny (model.path alone means model={IMPLIED}) or pick a preset: "
                          f"{', '.join(others)}")
