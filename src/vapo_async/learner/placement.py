"""GPU placement of one node's engines: which devices each local generator uses, and what memory share.

On the learner's node three kinds of process may hold CUDA memory: the learner ranks (PyTorch,
``trainer.devices``), the local generators (a vLLM engine each over ``tensor_parallel_size``
devices, ``generators.local``) and the held-out evaluation engine (vLLM inside learner rank 0,
``eval.engine=vllm``). vLLM sizes an engine by a share of each of its devices
(``gpu_memory_utilization``: weights, activations and KV cache of that engine) and PyTorch does not
cap the learner at all, so nothing else stops two engines from each asking for 85% of one device.
``plan_placement`` gives every local generator explicit devices (its ``CUDA_VISIBLE_DEVICES``)
and a share such that the shares on every device sum to at most ``MEMORY_BOUND``, or refuses with
one line naming the settings to change. It is arithmetic only: the caller passes the devices
(``cuda_devices()`` reads them from torch.cuda; tests declare them).

Rules (device indices are CUDA indices as the learner process sees them):
- The learner counts ``generators.learner_memory_share`` on each of its devices (``trainer.devices``).
- The evaluation engine counts ``eval.gpu_memory_utilization`` on device 0: vLLM, built inside the
  learner's rank-0 process, takes the first device that process sees.
- Local generator i takes ``tensor_parallel_size`` devices: entries ``[i*tp, (i+1)*tp)`` of
  ``generators.devices``, or, when that is null, the devices the learner does not use, in order,
  then (when there are too few) the learner's own, wrapping around.
- Its share is ``generators.gpu_memory_utilization``, or, when that is null, an equal part of what
  the learner and the evaluation engine leave on the tightest of its devices (rounded down to
  0.01): ``MEMORY_BOUND`` on a device of its own.
- Without CUDA devices nothing is planned: on CPU the engines size their KV cache in bytes
  (``engine.kv_cache_bytes``) and no share applies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vapo_async.learner.errors import ConfigError

if TYPE_CHECKING:
    from vapo_async.learner.config import LearnerConfig

MEMORY_BOUND = 0.9
"""Most the shares on one device may sum to: vLLM's own default share for an engine alone on a
device. The rest is for what no share counts: each process's CUDA context (hundreds of MiB), NCCL buffers
and allocator fragmentation."""

LEARNER_KEY = "generators.learner_memory_share"
EVAL_KEY = "eval.gpu_memory_utilization"
GENERATOR_KEY = "generators.gpu_memory_utilization"
"""The settings each kind of share comes from (named in refusals)."""

_EPS = 1e-9  # shares are decimals: compare and round them with float error allowed for


class PlacementError(ValueError):
    """The engines cannot be placed; the message (one line) names the settings to change."""


@dataclass(frozen=True)
class Device:
    """One CUDA device of the node."""

    index: int
    """CUDA index as the learner process sees it (within its ``CUDA_VISIBLE_DEVICES``)."""
    memory_bytes: int
    """Total device memory (``torch.cuda.get_device_properties(i).total_memory``)."""


@dataclass(frozen=True)
class EnginePlacement:
    """Where one local generator's engine runs."""

    devices: tuple[int, ...]
    """CUDA indices (as the learner sees them), one per tensor-parallel rank."""
    gpu_memory_utilization: float
    """Share of each of those devices its vLLM engine may take."""

    def cuda_visible_devices(self, parent: str | None) -> str:
        """``CUDA_VISIBLE_DEVICES`` for the generator process. ``parent`` is the learner's own
        value (None: unset), whose entries (indices or UUIDs) index i refers to."""
        if parent is None:
            return ",".join(str(d) for d in self.devices)
        visible = [v.strip() for v in parent.split(",") if v.strip()]
        missing = [d for d in self.devices if d >= len(visible)]
        if missing:
            raise PlacementError(f"generator devices {list(self.devices)}: CUDA_VISIBLE_DEVICES={parent} "
                                 f"makes only {len(visible)} devices visible to the learner")
        return ",".join(visible[d] for d in self.devices)

    def overrides(self) -> list[str]:
        """Hydra overrides of the generator's ``conf/generator.yaml`` for this placement (its tensor
        parallelism, ``len(devices)``, is ``generators.tensor_parallel_size``, passed on CPU too)."""
        return [f"engine.gpu_memory_utilization={self.gpu_memory_utilization}"]


@dataclass(frozen=True)
class DeviceUse:
    """Who takes which share of one device."""

    device: Device
    shares: tuple[tuple[str, float], ...]
    """(holder, share): "learner", "eval", "local-i"."""

    @property
    def total(self) -> float:
        return sum(s for _, s in self.shares)

    def describe(self) -> str:
        """``cuda:0 (80.0 GiB): learner 0.50 + eval 0.10 + local-0 0.30 = 0.90``."""
        parts = " + ".join(f"{who} {share:.2f}" for who, share in self.shares)
        gib = self.device.memory_bytes / 2**30
        return f"cuda:{self.device.index} ({gib:.1f} GiB): {parts} = {self.total:.2f}"


@dataclass(frozen=True)
class Placement:
    """The plan of one node."""

    generators: tuple[EnginePlacement, ...]
    """One per local generator (empty without CUDA devices)."""
    uses: tuple[DeviceUse, ...]
    """Every device something is placed on, in index order."""

    def describe(self) -> str:
        """One line for the log (empty when nothing is placed)."""
        return "; ".join(u.describe() for u in self.uses)


def _assign(n_devices: int, learner: Sequence[int], generators: int, tp: int,
            explicit: Sequence[int] | None) -> list[tuple[int, ...]]:
    """Devices of each local generator (see the module docstring)."""
    if explicit is not None:
        if len(explicit) != generators * tp:
            raise PlacementError(f"generators.devices has {len(explicit)} entries; generators.local={generators} x "
                                 f"generators.tensor_parallel_size={tp} needs {generators * tp}")
        bad = sorted({d for d in explicit if not 0 <= d < n_devices})
        if bad:
            raise PlacementError(f"generators.devices names device(s) {bad}; this node has {n_devices} "
                                 f"CUDA device(s) (0-{n_devices - 1})")
        groups = [tuple(explicit[i * tp:(i + 1) * tp]) for i in range(generators)]
        for g in groups:
            if len(set(g)) < len(g):
                raise PlacementError(f"generators.devices: generator devices {list(g)} repeat a device "
                                     "(each tensor-parallel rank needs its own)")
        return groups
    if tp > n_devices:
        raise PlacementError(f"generators.tensor_parallel_size={tp} needs {tp} devices per generator; this node "
                             f"has {n_devices}")
    free = [d for d in range(n_devices) if d not in set(learner)]
    pool = free if len(free) >= generators * tp else free + sorted(set(learner))
    # consecutive positions modulo len(pool): the tp devices of one generator are distinct (tp <= len(pool))
    return [tuple(pool[(i * tp + j) % len(pool)] for j in range(tp)) for i in range(generators)]


def _fixed_shares(n_devices: int, learner: Sequence[int], learner_share: float,
                  eval_share: float | None, eval_device: int) -> list[list[tuple[str, float]]]:
    """Per device: the learner's and the evaluation engine's shares."""
    fixed: list[list[tuple[str, float]]] = [[] for _ in range(n_devices)]
    for d in sorted(set(learner)):
        fixed[d].append(("learner", learner_share))
    if eval_share is not None:
        fixed[eval_device].append(("eval", eval_share))
    return fixed


def _share_left(fixed: list[tuple[str, float]], crowd: int, bound: float) -> float:
    """An equal part of what ``fixed`` leaves of ``bound``, for ``crowd`` engines, down to 0.01."""
    return math.floor((bound - sum(s for _, s in fixed)) / crowd * 100 + _EPS) / 100


def _fixes(holders: Sequence[str], generators: bool) -> str:
    """What to change on a device whose shares ``holders`` hold ("learner", "eval", "local-i"),
    with local generators placed there (``generators``)."""
    keys = {"learner": LEARNER_KEY, "eval": EVAL_KEY}
    fixes = ["lower " + ", ".join(sorted({keys.get(who, GENERATOR_KEY) for who in holders}))]
    if generators:
        fixes.append("move generators with generators.devices or fewer trainer.devices")
    if "eval" in holders:
        fixes.append("or set eval.engine=hf")
    return "; ".join(fixes)


def _no_room(device: Device, fixed: list[tuple[str, float]], crowd: int, bound: float) -> PlacementError:
    use = DeviceUse(device, tuple(fixed))
    return PlacementError(f"no GPU memory left for {crowd} local generator(s) on {use.describe()} of {bound:.2f}: "
                          + _fixes([who for who, _ in fixed], generators=True))


def plan_placement(devices: Sequence[Device], learner_devices: Sequence[int], learner_share: float,
                   generators: int, tensor_parallel_size: int = 1, generator_devices: Sequence[int] | None = None,
                   generator_share: float | None = None, eval_share: float | None = None, eval_device: int = 0,
                   bound: float = MEMORY_BOUND) -> Placement:
    """Devices and memory shares of ``generators`` local engines beside the learner (on
    ``learner_devices``) and an evaluation engine (``eval_share`` None: none). Raises
    ``PlacementError`` naming the settings when a share would be <= 0 or a device's shares sum past
    ``bound``. ``devices`` empty (no CUDA): an empty plan, unless devices were asked for."""
    if not devices:
        if generator_devices:
            raise PlacementError(f"generators.devices={list(generator_devices)} but this node has no CUDA device")
        return Placement((), ())
    n = len(devices)
    outside = sorted({d for d in learner_devices if not 0 <= d < n})
    if outside:
        raise PlacementError(f"trainer.devices asks for device(s) {outside}; this node has {n} CUDA device(s)")
    groups = _assign(n, learner_devices, generators, tensor_parallel_size, generator_devices)
    fixed = _fixed_shares(n, learner_devices, learner_share, eval_share, eval_device)
    crowd = [sum(d in g for g in groups) for d in range(n)]
    shares = []
    for g in groups:
        if generator_share is not None:
            shares.append(generator_share)
            continue
        left = {d: _share_left(fixed[d], crowd[d], bound) for d in g}
        tightest = min(g, key=left.__getitem__)  # one share for all tp devices: the smallest part
        if left[tightest] <= 0:
            raise _no_room(devices[tightest], fixed[tightest], crowd[tightest], bound)
        shares.append(left[tightest])
    uses = []
    for d in range(n):
        held = fixed[d] + [(f"local-{i}", shares[i]) for i, g in enumerate(groups) if d in g]
        if all(who == "learner" for who, _ in held):  # the learner alone (or nothing): no share applies
            continue
        use = DeviceUse(devices[d], tuple(held))
        if use.total > bound + _EPS:
            raise PlacementError(f"GPU memory over-committed on {use.describe()} > {bound:.2f}: "
                                 + _fixes([who for who, _ in held], crowd[d] > 0))
        uses.append(use)
    return Placement(tuple(EnginePlacement(g, s) for g, s in zip(groups, shares, strict=True)), tuple(uses))


def learner_device_indices(accelerator: str, devices: Any, n_devices: int) -> list[int]:
    """CUDA indices the learner ranks of this node use, as Lightning reads ``trainer.devices``:
    an int k = the first k (-1 = all), "auto" or "-1" = all, "1,3" or a list = those. A learner
    on the CPU (``trainer.accelerator=cpu``, or no CUDA device) uses none."""
    if n_devices == 0 or accelerator not in ("auto", "gpu", "cuda"):
        return []
    if isinstance(devices, (list, tuple)):
        return [int(d) for d in devices]
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1"):
            return list(range(n_devices))
        if "," in text:
            return [int(x) for x in text.split(",") if x.strip()]
        devices = int(text)
    return list(range(n_devices)) if devices == -1 else list(range(int(devices)))


def plan_for_learner(cfg: LearnerConfig, devices: Sequence[Device]) -> Placement:
    """``plan_placement`` for the node of learner rank 0 under ``cfg`` (a refusal is the learner's
    ``ConfigError``)."""
    gen = cfg.generators
    evaluating = cfg.eval.engine == "vllm" and cfg.eval.every_n_steps > 0
    try:
        return plan_placement(
            devices, learner_device_indices(str(cfg.trainer.accelerator), cfg.trainer.devices, len(devices)),
            gen.learner_memory_share, gen.local, gen.tensor_parallel_size, gen.devices, gen.gpu_memory_utilization,
            cfg.eval.gpu_memory_utilization if evaluating else None)
    except PlacementError as e:  # the learner's CLI prints a ConfigError as one line, exit code 2
        raise ConfigError(str(e)) from None


def cuda_devices() -> list[Device]:
    """The CUDA devices this process sees (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [Device(i, int(torch.cuda.get_device_properties(i).total_memory)) for i in range(torch.cuda.device_count())]


def generator_env(placement: EnginePlacement, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment entries a generator process needs for ``placement``."""
    return {"CUDA_VISIBLE_DEVICES": placement.cuda_visible_devices(environ.get("CUDA_VISIBLE_DEVICES"))}
