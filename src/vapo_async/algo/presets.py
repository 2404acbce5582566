"""Algorithm knobs (``AlgoConfig``) and the presets vapo / ppo / grpo / dapo.

Plain data for Hydra's ConfigStore (mutable so overrides apply; ``validate()`` runs on
construction and should be called again after mutating a field). Every VAPO technique is one
field, so "VAPO without X" is a single override (``vapo_without``).

Scaling from the paper (Qwen2.5-32B, 512 prompts x 16 samples, lr 1e-6) to the defaults (the
embedded ~1M-parameter Qwen2-shaped model on 2 CPU cores):
- Learning rates: under width (muP-style) scaling Adam's lr grows ~ 1 / width; hidden 5120 -> 128
  is 40x, so 1e-6 -> 4e-5, rounded to actor_lr = 5e-5. The paper's critic moves 2x faster
  (2e-6) but starts from a trained reward model; ours starts from the base with a fresh value
  head, so critic_lr = 2e-4 (4x the actor). The tiny model preset (conf/model/tiny.yaml) raises
  actor_lr to 1.5e-4, measured: at 5e-5 the policy barely moved on the embedded task.
- Batch: 16 prompts x G = 8 = 128 responses per step, in 4 mini-batches of 32 (the paper uses
  8192 responses in 16 mini-batches of 512; 2 CPU cores do not fit more per step).
- Value pretraining: the paper's 50 steps (1% of a 5000-step run) -> 10 steps.
- The scale (responses per step, G, value-pretraining length) is three fields a model preset sets
  (``responses_per_step``, ``samples_per_prompt``, ``value_pretraining_steps``); each algorithm's
  conf/algo/NAME.yaml turns them into its own shape (PPO: responses_per_step prompts x 1 sample,
  no value pretraining), so conf/model/qwen2.5-7b.yaml gives VAPO 512 x 16 and PPO 8192 x 1.
- LR warm-up: DAPO's 20 steps -> 5. eta = 4 (AReaL's default for code tasks).
- Unchanged: gamma 1, lambda_critic 1, lambda_policy 0.95 (non-adaptive), alpha 0.05, clips
  0.2 / 0.28, mu = 0.1. Departure in the tiny model preset: alpha 0.5, because eq. 5 at 0.05 gives
  the embedded task's 20-200-token responses lambda_policy 0-0.9 (advantages mostly a young
  critic's TD errors), where the paper's long responses see 0.98-0.999; 0.5 restores 0.9-0.99.

Choices where the papers are silent: behaviour weight capped at 5.0 in "mask" mode (AReaL's
example) for every preset, since it belongs to the asynchronous system rather than to one
algorithm; GAE presets whiten advantages over the batch's valid tokens (verl, which VC-PPO and
VAPO build on, does); no value clipping; no KL term (DAPO drops it, and our GRPO baseline keeps
no reference model: set kl_coef = 0.04 for DeepSeekMath's GRPO if the learner provides one);
grad-norm clip 1.0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vapo_async.algo.advantages import GaeLambdas

TECHNIQUES = (
    "value_pretraining",
    "decoupled_gae",
    "length_adaptive_gae",
    "token_level_loss",
    "clip_higher",
    "positive_nll",
    "group_sampling",
)
"""The seven VAPO techniques (PAPER.md), names accepted by ``vapo_without``."""


@dataclass
class AlgoConfig:
    """Every algorithm knob the learner and the controller need (defaults: VAPO, tiny CPU model)."""

    name: str = "vapo"
    """Preset name, for logs and run directories."""
    use_critic: bool = True
    """Train a value model (VAPO, PPO); False for GRPO/DAPO."""
    advantage_estimator: str = "gae"
    """"gae" (needs the critic) or "group" (GRPO/DAPO group-normalised outcome advantage)."""
    gamma: float = 1.0
    """Discount; 1.0 throughout the papers."""
    lambda_critic: float = 1.0
    """GAE lambda for the critic's targets when decoupled_gae (1.0: Monte-Carlo returns)."""
    lambda_policy: float = 0.95
    """GAE lambda for the policy's advantages when length_adaptive is off."""
    decoupled_gae: bool = True
    """Critic uses lambda_critic; False: the critic uses the policy's lambda (coupled GAE)."""
    length_adaptive: bool = True
    """Policy lambda per response: 1 - 1/(alpha * L_i), clamped at 0 (VAPO eq. 5)."""
    alpha: float = 0.05
    """Length-adaptive GAE constant (VAPO eq. 5)."""
    whiten_advantages: bool = True
    """Whiten policy advantages over the global batch's valid tokens (mean 0, variance 1)."""
    clip_low: float = 0.2
    """eps_low: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """eps_high: the ratio is clipped above at 1 + clip_high (clip-higher; 0.2 = symmetric)."""
    behav_cap: float | None = 5.0
    """Cap on the behaviour weight pi_prox / pi_behav; None disables the weight."""
    behav_mode: str = "mask"
    """"mask": zero tokens above the cap (AReaL); "truncate": cap the weight (TIS)."""
    proximal: str = "recompute"
    """The policy the clip is centred on. "recompute": pi_prox, the learner's weights at the start of
    the step, with the behaviour weight pi_prox / pi_behav (AReaL's decoupled objective);
    "behaviour": pi_behav, the sampler's log-probs (AReaL's naive PPO; the weight is then 1)."""
    aggregation: str = "token"
    """"token": eq. 7 token-level mean; "sequence": per-response mean, then mean."""
    value_clip: float | None = None
    """PPO value clipping range around the old values; None disables."""
    nll_coef: float = 0.1
    """mu: weight of the positive-example NLL loss (eq. 10); 0 disables."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (subtracted from the policy loss); 0 disables."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to a frozen reference policy; 0 disables (no reference kept)."""
    value_warmup_steps: int = 10
    """Value-pretraining steps: critic-only updates on the initial policy's samples."""
    value_warmup_ev_threshold: float | None = None
    """Stop value pretraining early once explained variance reaches this; None: run all steps."""
    group_size: int = 8
    """G: samples per prompt."""
    batch_groups: int = 16
    """Prompts (groups) per optimizer step; responses per step = batch_groups * group_size."""
    mini_batches: int = 4
    """Mini-batches (optimizer steps) per global batch and PPO epoch."""
    responses_per_step: int = 128
    """The run's scale, set by conf/model/ (paper: 8192): conf/algo/NAME.yaml derives
    batch_groups = responses_per_step / group_size from it, so one-sample PPO and G-sample VAPO
    train on as many responses per step. Setting batch_groups directly leaves it aside."""
    samples_per_prompt: int = 8
    """The scale's G (paper: 16): group_size of the presets that sample groups (vapo, grpo, dapo);
    ppo samples one response per prompt whatever this says."""
    value_pretraining_steps: int = 10
    """The scale's value-pretraining length (paper: 50): value_warmup_steps of vapo; the presets
    without value pretraining (ppo, grpo, dapo) keep 0."""
    ppo_epochs: int = 1
    """Passes over each global batch."""
    eta: int = 4
    """Staleness bound: a batch may hold samples from up to eta policy versions back; 0 = synchronous."""
    critic_max_staleness: int | None = None
    """The critic trains only on tokens sampled at most this many versions back (their returns are
    those of a policy close to today's); older tokens still get advantages and train the actor, and
    stay in the loss's denominator. None: every token (the papers)."""
    actor_lr: float = 5e-5
    """AdamW learning rate of the policy."""
    critic_lr: float = 2e-4
    """AdamW learning rate of the value model."""
    warmup_steps: int = 5
    """Linear LR warm-up steps, then constant."""
    grad_clip: float | None = 1.0
    """Gradient-norm clip for actor and critic; None disables."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (accuracy 0 or 1) and sample more."""
    overlong_shaping: bool = False
    """DAPO eq. 13: add the soft overlong penalty to the reward (L_max = sampling.max_tokens,
    L_cache = reward.overlong_cache_tokens, by default 20% of L_max)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name, value in self._checks():
            if not value:
                raise ValueError(f"AlgoConfig.{name} = {getattr(self, name)!r} is invalid ({_RULES[name]})")
        if self.advantage_estimator == "gae" and not self.use_critic:
            raise ValueError("AlgoConfig.advantage_estimator = 'gae' needs use_critic = True")
        if self.advantage_estimator == "group" and self.use_critic:
            raise ValueError("AlgoConfig.use_critic = True but advantage_estimator = 'group' never uses the critic")
        if self.advantage_estimator == "group" and self.group_size < 2:
            raise ValueError("AlgoConfig.group_size must be >= 2 with advantage_estimator = 'group'")
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError("AlgoConfig.dynamic_sampling needs group_size >= 2 (a group of one is always all-equal)")
        if self.value_warmup_steps > 0 and not self.use_critic:
            raise ValueError("AlgoConfig.value_warmup_steps > 0 needs use_critic = True")
        if self.mini_batches > self.batch_groups * self.group_size:
            raise ValueError(
                f"AlgoConfig.mini_batches = {self.mini_batches} exceeds the {self.batch_groups * self.group_size} responses per step"
            )

    def _checks(self) -> list[tuple[str, bool]]:
        return [
            ("name", bool(self.name)),
            ("advantage_estimator", self.advantage_estimator in ("gae", "group")),
            ("gamma", 0.0 <= self.gamma <= 1.0),
            ("lambda_critic", 0.0 <= self.lambda_critic <= 1.0),
            ("lambda_policy", 0.0 <= self.lambda_policy <= 1.0),
            ("alpha", self.alpha > 0.0),
            ("clip_low", 0.0 <= self.clip_low < 1.0),
            ("clip_high", self.clip_high >= 0.0),
            ("behav_cap", self.behav_cap is None or self.behav_cap >= 1.0),
            ("behav_mode", self.behav_mode in ("truncate", "mask")),
            ("proximal", self.proximal in ("recompute", "behaviour")),
            ("aggregation", self.aggregation in ("token", "sequence")),
            ("value_clip", self.value_clip is None or self.value_clip > 0.0),
            ("nll_coef", self.nll_coef >= 0.0),
            ("entropy_coef", self.entropy_coef >= 0.0),
            ("kl_coef", self.kl_coef >= 0.0),
            ("value_warmup_steps", self.value_warmup_steps >= 0),
            ("value_warmup_ev_threshold", self.value_warmup_ev_threshold is None or self.value_warmup_ev_threshold <= 1.0),
            ("group_size", self.group_size >= 1),
            ("batch_groups", self.batch_groups >= 1),
            ("mini_batches", self.mini_batches >= 1),
            ("responses_per_step", self.responses_per_step >= 1),
            ("samples_per_prompt", self.samples_per_prompt >= 1),
            ("value_pretraining_steps", self.value_pretraining_steps >= 0),
            ("ppo_epochs", self.ppo_epochs >= 1),
            ("eta", self.eta >= 0),
            ("critic_max_staleness", self.critic_max_staleness is None or self.critic_max_staleness >= 0),
            ("actor_lr", self.actor_lr > 0.0),
            ("critic_lr", self.critic_lr > 0.0),
            ("warmup_steps", self.warmup_steps >= 0),
            ("grad_clip", self.grad_clip is None or self.grad_clip > 0.0),
        ]

    def gae_lambdas(self) -> GaeLambdas:
        """The lambdas of the two GAE passes (decoupled / length-adaptive as configured)."""
        return GaeLambdas(policy=self.lambda_policy, critic=self.lambda_critic if self.decoupled_gae else None,
                          alpha=self.alpha if self.length_adaptive else None)

    def policy_lambda(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) float32 policy GAE lambdas for responses of the given (B,) integer lengths."""
        return self.gae_lambdas().policy_lambdas(lengths)

    def critic_lambda(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) float32 critic GAE lambdas: lambda_critic if decoupled, else the policy's."""
        return self.gae_lambdas().critic_lambdas(lengths)


_RULES = {
    "name": "must be non-empty",
    "advantage_estimator": "one of 'gae', 'group'",
    "gamma": "in [0, 1]",
    "lambda_critic": "in [0, 1]",
    "lambda_policy": "in [0, 1]",
    "alpha": "> 0",
    "clip_low": "in [0, 1)",
    "clip_high": ">= 0",
    "behav_cap": "None or >= 1 (on-policy tokens have weight 1)",
    "behav_mode": "one of 'truncate', 'mask'",
    "proximal": "one of 'recompute', 'behaviour'",
    "aggregation": "one of 'token', 'sequence'",
    "value_clip": "None or > 0",
    "nll_coef": ">= 0",
    "entropy_coef": ">= 0",
    "kl_coef": ">= 0",
    "value_warmup_steps": ">= 0",
    "value_warmup_ev_threshold": "None or <= 1",
    "group_size": ">= 1",
    "batch_groups": ">= 1",
    "mini_batches": ">= 1",
    "responses_per_step": ">= 1",
    "samples_per_prompt": ">= 1",
    "value_pretraining_steps": ">= 0",
    "ppo_epochs": ">= 1",
    "eta": ">= 0",
    "critic_max_staleness": "None or >= 0",
    "actor_lr": "> 0",
    "critic_lr": "> 0",
    "warmup_steps": ">= 0",
    "grad_clip": "None or > 0",
}

_VAPO = AlgoConfig()
_GROUP_BASELINE = dict(
    use_critic=False, advantage_estimator="group", decoupled_gae=False, length_adaptive=False,
    whiten_advantages=False, nll_coef=0.0, value_warmup_steps=0,
)

PRESETS: dict[str, AlgoConfig] = {
    "vapo": _VAPO,
    # Vanilla PPO (VAPO section 5.1): lambda 0.95 for both, per-sample loss, symmetric clip 0.2,
    # no value pretraining, no NLL, one sample per prompt (same responses per step as vapo).
    "ppo": dataclasses.replace(
        _VAPO, name="ppo", lambda_critic=0.95, lambda_policy=0.95, decoupled_gae=False, length_adaptive=False,
        aggregation="sequence", clip_high=0.2, value_warmup_steps=0, nll_coef=0.0,
        group_size=1, batch_groups=_VAPO.batch_groups * _VAPO.group_size,
    ),
    # GRPO: group-normalised outcome advantage, no critic, per-sample loss, symmetric clip.
    "grpo": dataclasses.replace(_VAPO, name="grpo", aggregation="sequence", clip_high=0.2, **_GROUP_BASELINE),
    # DAPO: GRPO + clip-higher, token-level loss, dynamic sampling, overlong shaping, no KL.
    "dapo": dataclasses.replace(
        _VAPO, name="dapo", aggregation="token", clip_high=0.28, dynamic_sampling=True, overlong_shaping=True,
        **_GROUP_BASELINE,
    ),
}
"""Preset configs. Treat them as read-only: take ``preset(name)`` (a copy) to modify one."""


def batch_groups_for(responses_per_step: int, group_size: int) -> int:
    """Prompts per step that give ``responses_per_step`` responses of ``group_size`` samples each
    (conf/algo/NAME.yaml: ``batch_groups: ${vapo.batch_groups:...}``); not a multiple: ValueError."""
    if group_size < 1 or responses_per_step < 1 or responses_per_step % group_size:
        raise ValueError(f"algo.responses_per_step={responses_per_step} must be a positive multiple of "
                         f"algo.group_size={group_size} (batch_groups = responses_per_step / group_size)")
    return responses_per_step // group_size


def preset(name: str) -> AlgoConfig:
    """A fresh copy of ``PRESETS[name]``."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name])


def vapo_without(technique: str) -> AlgoConfig:
    """VAPO with one of its seven techniques switched off (the Table 1 ablation rows).

    - value_pretraining: no critic-only warm-up steps.
    - decoupled_gae: the critic's targets use the policy's lambda (per response when adaptive).
    - length_adaptive_gae: the policy uses the fixed lambda_policy = 0.95.
    - token_level_loss: per-response ("sequence") aggregation.
    - clip_higher: symmetric clip, clip_high = clip_low = 0.2.
    - positive_nll: mu = 0.
    - group_sampling: one sample per prompt with G times more prompts per step, so the number of
      responses per step (and of mini-batches) is unchanged, as in the paper's baseline.
    """
    base = preset("vapo")
    changes: dict[str, dict[str, object]] = {
        "value_pretraining": {"value_warmup_steps": 0, "value_warmup_ev_threshold": None},
        "decoupled_gae": {"decoupled_gae": False},
        "length_adaptive_gae": {"length_adaptive": False},
        "token_level_loss": {"aggregation": "sequence"},
        "clip_higher": {"clip_high": base.clip_low},
        "positive_nll": {"nll_coef": 0.0},
        "group_sampling": {"group_size": 1, "batch_groups": base.batch_groups * base.group_size},
    }
    if technique not in changes:
        raise ValueError(f"unknown VAPO technique {technique!r}; choose one of {list(TECHNIQUES)}")
    return dataclasses.replace(base, name=f"vapo_without_{technique}", **changes[technique])  # type: ignore[arg-type]
