#!/usr/bin/env bash
# Device check for a machine with one NVIDIA GPU (finishes in under 8 minutes):
# bf16 FSDP2 learner steps (the real LearnerModule under Lightning's ModelParallelStrategy, FSDP2
# mixed precision: bf16 compute, fp32 master weights and gradient reduction) on a random Qwen2 with
# the Qwen2.5-0.5B shape (~0.5B parameters, actor and critic), a fixed batch of 16 groups x G = 8
# (prompts 128 tokens, responses 256-768 tokens). Prints tokens/s and MFU against the bf16 matmul
# rate measured in the same script (8192^3 torch.mm), and writes benchmarks/results/device_check.json.
#
#   tools/device_check.sh                 # on the GPU machine (after tools/setup_env.sh)
#   tools/device_check.sh --cpu-smoke     # the same code path on CPU with a tiny model (seconds)
#   tools/device_check.sh --profile       # also: per-phase times of every step and a torch.profiler
#                                         # table of one steady step (top kernels and CPU ops)
#   DC_MB_TOKENS=N DC_STEPS=N             # override micro-batch tokens / number of steps
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
nvidia-smi -L 2>/dev/null || true
exec timeout 470 "$PY" - "$@" <<'PYEOF'
import dataclasses, json, os, sys, tempfile, time
from pathlib import Path

import numpy as np
import torch

smoke = "--cpu-smoke" in sys.argv
profile = "--profile" in sys.argv
cuda = torch.cuda.is_available() and not smoke
if not cuda and not smoke:
    sys.exit("device_check: no CUDA device visible (use --cpu-smoke to test the code path on CPU)")

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from transformers import Qwen2Config, Qwen2ForCausalLM

from bench_learner import make_batch, model_flops
from vapo_async.algo.presets import preset
from vapo_async.data.hf_dir import train_tokenizer
from vapo_async.learner.config import LearnerConfig
from vapo_async.learner.module import LearnerModule
from vapo_async.learner.stream import ListSource
from vapo_async.transport.batch import RolloutBatch

t_start = time.time()
dev = torch.device("cuda" if cuda else "cpu")


def matmul_rate(dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(10):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            torch.mm(a, b)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / 5)
    return 2 * n**3 / best


peak = matmul_rate(torch.bfloat16 if cuda else torch.float32, 8192 if cuda else 512)
print(f"matmul rate ({'bf16' if cuda else 'fp32'}): {peak / 1e12:.1f} TFLOP/s", flush=True)

# Qwen2.5-0.5B shape (smoke: a tiny one); random weights, a small tokenizer (ids are random anyway)
shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True) if not smoke else \
    dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)
tmp = Path(tempfile.mkdtemp(prefix="device_check-"))
tok = train_tokenizer([f"{a} + {b} = {a + b}" for a in range(50) for b in range(50)], vocab_size=300)
cfg_hf = Qwen2Config(**shape, max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
base = Qwen2ForCausalLM(cfg_hf)
n_params = sum(p.numel() for p in base.parameters())
base.save_pretrained(tmp / "model", safe_serialization=True)
tok.save_pretrained(tmp / "model")
del base
print(f"model: {n_params / 1e6:.0f} M parameters per network (actor and critic), written in "
      f"{time.time() - t_start:.0f} s", flush=True)

n_groups, g = 16, 8
rng = np.random.default_rng(0)
groups = make_batch(n_groups, g, shape["vocab_size"], seed=0)
if not smoke:  # longer prompts and responses than the tiny bench: 128 + 256..768 tokens
    for grp in groups:
        grp.prompt_ids = rng.integers(3, shape["vocab_size"], 128).astype(np.int32)
        lens = rng.integers(256, 769, size=g)
        grp.response_ids = [rng.integers(3, shape["vocab_size"], int(n)).astype(np.int32) for n in lens]
        grp.logprobs = [rng.uniform(-2.0, -0.01, int(n)).astype(np.float32) for n in lens]
        grp.versions = [np.zeros(int(n), np.int32) for n in lens]
seqs = RolloutBatch.concat(groups)

cfg = LearnerConfig()
cfg.algo = dataclasses.replace(preset("vapo"), value_warmup_steps=0, batch_groups=n_groups, group_size=g,
                               mini_batches=4, warmup_steps=0, actor_lr=1e-6, critic_lr=2e-6)
cfg.trainer.strategy = "fsdp"
cfg.trainer.precision = "bf16-mixed" if cuda else "32-true"
cfg.batching.micro_batch_tokens = int(os.environ.get("DC_MB_TOKENS", 16384 if cuda else 2048))
steps = int(os.environ.get("DC_STEPS", 6 if cuda else 2))
phases: dict[str, list[float]] = {}
if profile:  # time the three phases of a step (synchronised), wrapping the module's references
    import vapo_async.learner.module as lm

    def timed(name, fn):
        def run(*a, **k):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            if cuda:
                torch.cuda.synchronize()
            phases.setdefault(name, []).append(time.perf_counter() - t)
            return out
        return run

    for name in ("recompute", "compute_advantages", "ppo_updates"):
        setattr(lm, name, timed(name, getattr(lm, name)))
module = LearnerModule(cfg, str(tmp / "model"), tmp / "run", source=ListSource(groups))
trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="32-true",
                    strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
                    max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
step_s, update_s, publish_s, write_s = [], [], [], []


class Timer(L.Callback):
    prof = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if profile and module.state.step == min(2, steps - 1):  # steps done = this step's index
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.prof is not None:
            if cuda:
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            ka = self.prof.key_averages()
            if cuda:
                print(ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60), flush=True)
                busy = sum(e.self_device_time_total for e in ka) / 1e6
                print(f"profiled step: CUDA kernels busy {busy:.2f} s in total", flush=True)
            print(ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60), flush=True)
            self.prof = None
        m = module.state.last.metrics
        step_s.append(m["perf/step_s"])
        update_s.append(m["perf/update_s"])
        publish_s.append(m["perf/publish_s"])  # the training thread's stall: the copy to host
        write_s.append(m["weights/write_s"])  # the background writer's time for the previous version
        print(f"step {module.state.last.step}: {m['perf/step_s']:.2f} s (update {m['perf/update_s']:.2f} s, "
              f"publish {m['perf/publish_s']:.2f} s), padding {m.get('perf/padding_fraction', 0):.1%}"
              + "".join(f", {k} {v[-1]:.2f} s" for k, v in phases.items() if v), flush=True)


trainer.callbacks.append(Timer())
trainer.fit(module)
module.publishing.close()
steady = update_s[1:] or update_s  # the first step compiles/warms up kernels
t_upd = float(np.median(steady))
tokens = float(seqs.seq_lens.sum())
flops = model_flops(seqs, shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"],
                    shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"], 1)
res = {
    "device": torch.cuda.get_device_name(0) if cuda else "cpu (smoke)", "params_m": n_params / 1e6,
    "tokens_per_step": tokens, "update_s_median": t_upd, "step_s": step_s, "tokens_per_s": tokens / t_upd,
    "model_flops_per_step": flops, "achieved_tflops": flops / t_upd / 1e12, "matmul_tflops": peak / 1e12,
    "mfu": flops / t_upd / peak, "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    "wall_s": time.time() - t_start, "micro_batch_tokens": cfg.batching.micro_batch_tokens,
    "publish_stall_s": publish_s, "publish_write_s": write_s,
    "publish_stall_fraction_median": float(np.median([p / s for p, s in zip(publish_s[1:] or publish_s,
                                                                             step_s[1:] or step_s, strict=True)])),
}
print(json.dumps(res, indent=1))
print(f"RESULT tokens/s {res['tokens_per_s']:.0f}  achieved {res['achieved_tflops']:.1f} TFLOP/s  "
      f"MFU {100 * res['mfu']:.1f}% of the measured matmul rate  publish stall "
      f"{100 * res['publish_stall_fraction_median']:.1f}% of a step  ({res['wall_s']:.0f} s)")
if not smoke and not profile:
    out = Path("benchmarks/results/device_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
PYEOF
