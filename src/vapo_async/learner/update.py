"""One training step's maths on one data-parallel rank: recompute, advantages, PPO updates.

Notation (``vapo_async.algo``): b sequences of a micro-batch, Tr padded response length, V
vocabulary, R data-parallel ranks, M mini-batches.

1. ``recompute``: with the current weights and no gradient, pi_prox log-probs (logits divided by
   the sampling temperature) and critic values V_t for every micro-batch (AReaL's decoupled
   objective: pi_prox is the trust-region centre, PAPER.md "Off-policy tolerance").
2. ``compute_advantages``: ``algo.advantages.token_advantages`` per micro-batch (rewards on the
   last response token, truncated responses too; VAPO/PPO: decoupled GAE, returns with
   lambda_critic and advantages with lambda_policy, length adaptive per response (VAPO eq. 4-5);
   GRPO/DAPO: the group advantage rank 0 computed, broadcast to every token). Optional whitening
   over the whole global batch (all ranks).
3. ``ppo_epochs`` passes over the M mini-batches; each mini-batch: every micro-batch's losses are
   the ``algo`` losses scaled by (its count / the mini-batch's global count) x R, so that summing
   the micro-batch gradients and FSDP2's average over ranks give exactly the gradient of the
   mini-batch loss the paper defines (token-level: VAPO eq. 7 and 10); then clip and step.

Departures (documented choices): the learning-rate warm-up counts training steps (global batches),
not mini-batch steps; a non-finite gradient norm skips that optimizer step (counted), and
non-finite recomputed log-probs/values/advantages skip the whole batch before any weight changes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from vapo_async.algo import losses as L
from vapo_async.algo.advantages import token_advantages
from vapo_async.algo.mismatch import MISMATCH_KEYS, fresh_tokens, mismatch_metrics, mismatch_sums
from vapo_async.algo.presets import AlgoConfig
from vapo_async.algo.stats import masked_mean
from vapo_async.learner.batching import MicroBatch, MinibatchNorms
from vapo_async.learner.models import actor_logprobs, critic_values

Backward = Callable[[torch.Tensor], None]


@dataclass
class Prepared:
    """A micro-batch on the device with everything fixed for this step (no gradient)."""

    mb: MicroBatch
    """The data (``resp_mask`` all 0 for a padding micro-batch)."""
    logp_prox: torch.Tensor
    """(b, Tr) log pi_prox of the response tokens."""
    values: torch.Tensor | None
    """(b, Tr) V_t before the update (None without a critic)."""
    advantages: torch.Tensor | None = None
    """(b, Tr) A_t."""
    returns: torch.Tensor | None = None
    """(b, Tr) critic targets (None without a critic)."""
    ref_logp: torch.Tensor | None = None
    """(b, Tr) log-probs of the frozen reference policy (only with a KL term)."""
    value_mask: torch.Tensor | None = None
    """(b, Tr) float 1 on the tokens the critic trains on (None: every response token;
    ``limit_critic_staleness``)."""

    @property
    def mask(self) -> torch.Tensor:
        """(b, Tr) float 1 on response tokens."""
        return self.mb.resp_mask


def all_reduce_(t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce over the default group (identity on one process); returns the result on ``t``'s
    device (moved through the GPU and back when the backend is nccl)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl" and t.device.type != "cuda":
            dev = t.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(dev, op=op)
            t.copy_(dev.cpu())
        else:
            dist.all_reduce(t, op=op)
    return t


def world_size() -> int:
    """R (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def recompute(actor: nn.Module, critic: nn.Module | None, mbs: list[MicroBatch], temperature: float,
              ref: nn.Module | None = None) -> list[Prepared]:
    """pi_prox log-probs (and the reference policy's, with a KL term) and values of every
    micro-batch with the current weights."""
    out = []
    for mb in mbs:
        logp = actor_logprobs(actor, mb, temperature)[0]  # (b, Tr)
        values = critic_values(critic, mb) if critic is not None else None
        ref_logp = actor_logprobs(ref, mb, temperature)[0] if ref is not None else None
        out.append(Prepared(mb, logp * mb.resp_mask, None if values is None else values * mb.resp_mask,
                            ref_logp=ref_logp))
    return out


def compute_advantages(prep: list[Prepared], algo: AlgoConfig) -> dict[str, float]:
    """Fill ``advantages``/``returns`` of every micro-batch (collective: every rank must call it;
    whitening and the explained variance use all ranks' tokens). Returns statistics."""
    for p in prep:  # the token-level half of algo's advantages_and_returns (the rest ran on rank 0)
        p.advantages, p.returns = token_advantages(
            p.mb.rewards, p.mb.seq_adv, p.mb.response_lens, p.mask, p.values,
            estimator=_estimator(algo), gamma=algo.gamma, lambdas=algo.gae_lambdas())
    stats = _moments(prep)
    if algo.whiten_advantages and stats["n"] > 0:
        # masked_whiten over the global batch: population variance over all ranks' tokens
        mean = stats["adv_sum"] / stats["n"]
        var = max(stats["adv_sq"] / stats["n"] - mean * mean, 0.0)
        for p in prep:
            assert p.advantages is not None
            p.advantages = (p.advantages - mean) / math.sqrt(var + 1e-8) * p.mask
    return _advantage_stats(stats)


def _estimator(algo: AlgoConfig) -> Literal["gae", "group"]:
    """``algo.advantage_estimator`` narrowed to its two values (AlgoConfig.validate checks it)."""
    if algo.advantage_estimator not in ("gae", "group"):
        raise ValueError(f"AlgoConfig.advantage_estimator must be 'gae' or 'group', got {algo.advantage_estimator!r}")
    return "gae" if algo.advantage_estimator == "gae" else "group"


def _moments(prep: list[Prepared]) -> dict[str, float]:
    """Global sums over all ranks' response tokens (one all-reduce)."""
    acc = torch.zeros(8, dtype=torch.float64, device=prep[0].mask.device if prep else "cpu")
    for p in prep:
        m = p.mask.double()
        assert p.advantages is not None, "compute_advantages fills the advantages before _moments"
        a = p.advantages.double() * m
        acc[0] += m.sum()
        acc[1] += a.sum()
        acc[2] += (a * a).sum()
        if p.values is not None and p.returns is not None:
            r = p.returns.double() * m
            v = p.values.double() * m
            acc[3] += r.sum()
            acc[4] += (r * r).sum()
            acc[5] += (r - v).sum()
            acc[6] += ((r - v) ** 2).sum()
            acc[7] += v.sum()
    acc = all_reduce_(acc).cpu()
    keys = ("n", "adv_sum", "adv_sq", "ret_sum", "ret_sq", "err_sum", "err_sq", "val_sum")
    return dict(zip(keys, acc.tolist(), strict=True))


def _advantage_stats(s: dict[str, float]) -> dict[str, float]:
    """Advantage moments and, with a critic, the explained variance of the values recomputed at
    the start of the step: 1 - Var(returns - values) / Var(returns) over all valid tokens."""
    n = s["n"]
    if n <= 0:
        return {}
    out = {"actor/advantage_mean": s["adv_sum"] / n,
           "actor/advantage_std": math.sqrt(max(s["adv_sq"] / n - (s["adv_sum"] / n) ** 2, 0.0))}
    if s["ret_sq"] > 0 or s["ret_sum"] != 0:
        var_r = s["ret_sq"] / n - (s["ret_sum"] / n) ** 2
        var_e = s["err_sq"] / n - (s["err_sum"] / n) ** 2
        out["critic/explained_variance"] = 1.0 - var_e / var_r if var_r > 1e-12 else 0.0
        out["critic/value_mean"] = s["val_sum"] / n
        out["critic/return_mean"] = s["ret_sum"] / n
    return out


def mismatch(prep: list[Prepared], version: int, behav_cap: float | None) -> dict[str, float]:
    """``mismatch/*`` over every rank's tokens sampled with ``version`` (the weights pi_prox was just
    recomputed with; collective: one all-reduce of the sums, one of the maximum)."""
    acc = torch.zeros(len(MISMATCH_KEYS), dtype=torch.float64)
    for p in prep:
        sums = mismatch_sums(p.logp_prox, p.mb.logp_behav, fresh_tokens(p.mb.versions, p.mask, version), behav_cap)
        for i, k in enumerate(MISMATCH_KEYS):
            acc[i] = torch.maximum(acc[i], sums[k].cpu()) if k == "abs_max" else acc[i] + sums[k].cpu()
    i_max = MISMATCH_KEYS.index("abs_max")
    peak = all_reduce_(acc[i_max:i_max + 1].clone(), dist.ReduceOp.MAX)
    acc = all_reduce_(acc)
    acc[i_max] = peak[0]
    return mismatch_metrics(dict(zip(MISMATCH_KEYS, acc.tolist(), strict=True)))


def batch_is_finite(prep: list[Prepared]) -> bool:
    """True when every rank's recomputed log-probs, values and advantages are finite (collective)."""
    bad = torch.zeros(1, dtype=torch.float64)
    for p in prep:
        for t in (p.logp_prox, p.values, p.advantages, p.returns, p.ref_logp):
            if t is not None and not bool(torch.isfinite(t).all()):
                bad[0] = 1.0
                break
    return all_reduce_(bad, dist.ReduceOp.MAX).item() == 0.0


@dataclass
class StepCounters:
    """Metrics of one step: token-weighted means and maxima, reduced over all ranks at the end."""

    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    weights: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    maxima: dict[str, float] = field(default_factory=dict)
    actor_steps: int = 0
    critic_steps: int = 0
    skipped_nonfinite_grad: int = 0
    grad_norms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, name: str, value: float | torch.Tensor, weight: float) -> None:
        """A micro-batch mean ``value`` over ``weight`` tokens."""
        self.sums[name] += float(value) * weight
        self.weights[name] += weight

    def add_metrics(self, prefix: str, metrics: dict[str, torch.Tensor], weight: float, skip: tuple[str, ...] = ()) -> None:
        """``algo`` metric dicts: ``*_max`` entries are maxima, ``tokens`` is dropped, the rest
        are token means."""
        for k, v in metrics.items():
            if k == "tokens" or k in skip:
                continue
            if k.endswith("_max"):
                self.maxima[f"{prefix}/{k}"] = max(self.maxima.get(f"{prefix}/{k}", -math.inf), float(v))
            else:
                self.add(f"{prefix}/{k}", v, weight)

    def reduce(self) -> dict[str, float]:
        """Global values (two all-reduces; every rank must call it with the same names)."""
        names = sorted(self.sums)
        t = torch.tensor([[self.sums[n], self.weights[n]] for n in names] or [[0.0, 0.0]], dtype=torch.float64)
        all_reduce_(t)
        # a metric no token contributed to this step (e.g. the NLL without correct answers) is 0
        out = {n: t[i, 0].item() / t[i, 1].item() if t[i, 1].item() > 0 else 0.0 for i, n in enumerate(names)}
        max_names = sorted(self.maxima)
        m = torch.tensor([self.maxima[n] for n in max_names] or [0.0], dtype=torch.float64)
        all_reduce_(m, dist.ReduceOp.MAX)
        out.update({n: m[i].item() for i, n in enumerate(max_names)})
        for k, v in self.grad_norms.items():
            out[f"{k}/grad_norm"] = sum(v) / len(v)
        out["train/actor_optimizer_steps"] = float(self.actor_steps)
        out["train/critic_optimizer_steps"] = float(self.critic_steps)
        out["train/skipped_nonfinite_grad"] = float(self.skipped_nonfinite_grad)
        return out


def _normalizer(aggregation: str, norms: MinibatchNorms) -> float:
    """Global denominator of the mini-batch divided by R: FSDP2 averages gradients over the R
    ranks, so each rank's sum / (N / R) averages to sum_all / N (VAPO eq. 7 over the mini-batch)."""
    count = norms.tokens if aggregation == "token" else norms.seqs
    return max(count, 1.0) / world_size()


def actor_micro_loss(actor: nn.Module, p: Prepared, norms: MinibatchNorms, algo: AlgoConfig,
                     temperature: float, counters: StepCounters) -> torch.Tensor:
    """This micro-batch's part of L_PPO + mu * L_NLL (VAPO eq. 7, 10) [- entropy bonus]
    [+ KL to the reference], normalised by the mini-batch's global counts (see ``_normalizer``)."""
    mb, mask = p.mb, p.mask
    logp, entropy_tok = actor_logprobs(actor, mb, temperature)  # (b, Tr) each, no (b, Tr, V) logits
    n_tok = float(mask.sum())
    if n_tok == 0:  # padding micro-batch: keep the collectives, contribute nothing
        return logp.sum() * 0.0
    norm = _normalizer(algo.aggregation, norms)
    # algo.proximal = "behaviour": AReaL's naive PPO, the clip centred on the sampler's policy
    prox = mb.logp_behav if algo.proximal == "behaviour" else p.logp_prox
    loss, metrics = L.policy_loss(logp, prox, mb.logp_behav, p.advantages, mask,
                                  clip_low=algo.clip_low, clip_high=algo.clip_high, behav_cap=algo.behav_cap,
                                  behav_mode=algo.behav_mode, aggregation=algo.aggregation, normalizer=norm)
    counters.add_metrics("actor", metrics, n_tok)
    counters.add("actor/clip_fraction", metrics["clip_frac"], n_tok)  # the tag name
    counters.add("actor/pg_loss", loss.detach() * norm / _local_count(algo.aggregation, mask), n_tok)
    counters.add("actor/entropy", masked_mean(entropy_tok, mask).detach(), n_tok)
    if algo.entropy_coef > 0:  # token-level, over the mini-batch's tokens (see _normalizer)
        loss = loss - algo.entropy_coef * L.entropy_bonus(entropy_tok, mask, max(norms.tokens, 1.0) / world_size())
    if p.ref_logp is not None:
        kl = L.kl_penalty(logp, p.ref_logp, mask, algo.aggregation, norm)  # k3 estimate of KL(pi_theta || pi_ref)
        counters.add("actor/kl_ref", kl.detach() * norm / _local_count(algo.aggregation, mask), n_tok)
        loss = loss + algo.kl_coef * kl
    n_pos = float((mb.correct.to(mask.dtype)[:, None] * mask).sum())
    counters.add("actor/nll_loss", 0.0, 0.0)  # present (as 0) even when no answer in the step is correct
    if n_pos > 0:
        nll = L.positive_nll_loss(logp, mask, mb.correct, normalizer=norms.pos_tokens / world_size())
        counters.add("actor/nll_loss", nll.detach() * norms.pos_tokens / world_size() / n_pos, n_pos)
        if algo.nll_coef > 0:
            loss = loss + algo.nll_coef * nll
    return loss


def _local_count(aggregation: str, mask: torch.Tensor) -> float:
    """This micro-batch's own denominator (to log its mean loss)."""
    if aggregation == "token":
        return max(float(mask.sum()), 1.0)
    return max(float((mask.sum(dim=1) > 0).sum()), 1.0)


def limit_critic_staleness(prep: list[Prepared], version: int, max_staleness: int | None) -> None:
    """Set each micro-batch's ``value_mask`` to its response tokens sampled at most
    ``max_staleness`` versions before ``version`` (``algo.critic_max_staleness``; None: leave all)."""
    if max_staleness is None:
        return
    for p in prep:
        recent = (version - p.mb.versions) <= max_staleness  # (b, Tr)
        p.value_mask = p.mask * recent.to(p.mask.dtype)


def critic_micro_loss(critic: nn.Module, p: Prepared, norms: MinibatchNorms, algo: AlgoConfig,
                      counters: StepCounters) -> torch.Tensor:
    """This micro-batch's part of the value loss, normalised like ``actor_micro_loss`` (tokens
    left out by ``value_mask`` add nothing but stay in the denominator, like masked behaviour weights;
    with none kept the loss is 0 and the metric names are still registered, for ``reduce``)."""
    values = critic_values(critic, p.mb)  # (b, Tr)
    n_tok = float(p.mask.sum())
    if n_tok == 0:
        return values.sum() * 0.0
    assert p.values is not None and p.returns is not None
    mask = p.mask if p.value_mask is None else p.value_mask
    n_kept = float(mask.sum())
    counters.add("critic/trained_fraction", n_kept / n_tok, n_tok)
    norm = _normalizer(algo.aggregation, norms)
    loss, metrics = L.value_loss(values, p.values, p.returns, mask, clip=algo.value_clip,
                                 aggregation=algo.aggregation, normalizer=norm)
    counters.add_metrics("critic", metrics, n_kept,
                         skip=("explained_variance", "value_mean", "return_mean"))  # pre-update, global: see compute_advantages
    counters.add("critic/value_loss", loss.detach() * norm / _local_count(algo.aggregation, mask), n_kept)
    return loss


def optimizer_step(params: list[nn.Parameter], opt: torch.optim.Optimizer, max_norm: float | None,
                   name: str, counters: StepCounters) -> bool:
    """Clip to ``max_norm`` (None: measure only) and step; a non-finite norm skips the step."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
        norm = norm.full_tensor()
    value = float(norm)
    if not math.isfinite(value):
        opt.zero_grad(set_to_none=True)
        counters.skipped_nonfinite_grad += 1
        return False
    counters.grad_norms[name].append(value)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return True


def ppo_updates(actor: nn.Module, critic: nn.Module | None, opt_actor: torch.optim.Optimizer | None,
                opt_critic: torch.optim.Optimizer | None, prep: list[Prepared], slots: list[range],
                norms: list[MinibatchNorms], algo: AlgoConfig, temperature: float, train_actor: bool,
                backward: Backward, seed: int) -> StepCounters:
    """``algo.ppo_epochs`` passes over the mini-batches (``slots[m]`` = micro-batches of m), one
    actor and one critic optimizer step per mini-batch. The mini-batch order of each epoch is
    drawn from ``seed`` (the same on every rank)."""
    counters = StepCounters()
    gen = torch.Generator().manual_seed(seed)
    actor_params = [q for q in actor.parameters() if q.requires_grad]
    critic_params = [q for q in critic.parameters() if q.requires_grad] if critic is not None else []
    for _ in range(algo.ppo_epochs):
        for m in torch.randperm(len(slots), generator=gen).tolist():  # M mini-batches
            for slot in slots[m]:
                p = prep[slot]
                if train_actor:
                    backward(actor_micro_loss(actor, p, norms[m], algo, temperature, counters))
                if critic is not None:
                    backward(critic_micro_loss(critic, p, norms[m], algo, counters))
            if train_actor:
                assert opt_actor is not None
                counters.actor_steps += optimizer_step(actor_params, opt_actor, algo.grad_clip,
                                                       "actor", counters)
            if critic is not None:
                assert opt_critic is not None
                counters.critic_steps += optimizer_step(critic_params, opt_critic, algo.grad_clip,
                                                        "critic", counters)
    return counters
