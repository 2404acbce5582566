"""The actor's weights copied from the device into reused host buffers laid out as the files of a version.

This is the only part of publishing that runs on the training thread (``learner/publish.py`` writes
the buffers in the background). ``snapshot_plan`` lays the version out once (``plan_files``: the
tensors cut into one run per rank, each run into files of at most ``shard_bytes``); a
``HostSnapshot`` holds one flat byte buffer per file this rank writes (pinned when the actor is on a
GPU, so the copies are DMA), and ``capture`` fills it: every rank walks the state dict in the same
order, materialises each tensor (``DTensor.full_tensor()``, a collective, under FSDP2), and the
rank that owns it casts it to the published dtype on the device and copies its bytes to their
place in the file. Host memory per rank: its share of the model, once per buffer set (two at most:
the one being written and the newest pending one), plus nothing of the other ranks' shares; device
memory: the largest tensor, transiently.

Departure from the issue's wording: a tensor is all-gathered to every rank and dropped by the
ranks that do not own it (``full_tensor``), not gathered to its owner only; the bytes moved over the
interconnect are R times the owner's, simpler, and the step's time is dominated by the copy to host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from vapo_async.learner.models import export_state_dict
from vapo_async.transport.safetensors_io import FileLayout, plan_files


@dataclass(frozen=True)
class SnapshotPlan:
    """Which tensors a version holds, in which files, written by which rank."""

    names: tuple[str, ...]
    """State-dict keys exported, in the order every rank walks them."""
    files: tuple[FileLayout, ...]
    """All files of a version (every rank knows the whole plan; rank 0 writes the index from it)."""
    dtype: torch.dtype | None
    """Dtype of floating tensors in the files (None: as trained)."""

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file name (the shard index)."""
        return {e.name: f.name for f in self.files for e in f.entries}

    def owned(self, rank: int) -> list[FileLayout]:
        return [f for f in self.files if f.rank == rank]


def snapshot_plan(model: nn.Module, ranks: int, dtype: torch.dtype | None, shard_bytes: int) -> SnapshotPlan:
    """The plan for ``model``'s exported state dict (``export_state_dict``: tied output embeddings
    left out), floating tensors cast to ``dtype``; shapes are the global (unsharded) ones."""
    state = export_state_dict(model, dict(model.state_dict()))
    specs = [(k, dtype if dtype is not None and v.is_floating_point() else v.dtype, tuple(v.shape))
             for k, v in state.items()]
    return SnapshotPlan(tuple(state), tuple(plan_files(specs, ranks, shard_bytes)), dtype)


class HostSnapshot:
    """One reusable set of host buffers: the bytes of this rank's files of one version."""

    def __init__(self, plan: SnapshotPlan, rank: int, pin: bool) -> None:
        self.files = plan.owned(rank)
        self.buffers = {f.name: torch.empty(f.data_bytes, dtype=torch.uint8, pin_memory=pin) for f in self.files}
        self._slots = {e.name: (self.buffers[f.name], e) for f in self.files for e in f.entries}

    def body(self, name: str) -> memoryview:
        """The bytes of file ``name`` after its header."""
        return memoryview(self.buffers[name].numpy()).cast("B")

    def capture(self, model: nn.Module, plan: SnapshotPlan) -> float:
        """Collective under FSDP2 (every rank calls it at the same point): copy ``model``'s
        weights into this rank's buffers; returns the seconds it took (the training thread's stall)."""
        from torch.distributed.tensor import DTensor

        t0 = time.perf_counter()
        state = model.state_dict()
        cuda = False
        for name in plan.names:
            t = state[name].detach()
            if isinstance(t, DTensor):
                t = t.full_tensor()  # a collective: every rank, same order
            slot = self._slots.get(name)
            if slot is None:
                continue
            buf, entry = slot
            if t.dtype != entry.dtype:
                t = t.to(entry.dtype)  # cast on the device: fewer bytes cross to the host
            src = t.contiguous().reshape(-1).view(torch.uint8)
            buf[entry.begin:entry.end].copy_(src, non_blocking=t.is_cuda)
            cuda = cuda or t.is_cuda
        if cuda:
            torch.cuda.current_stream().synchronize()  # the writer reads the buffers next
        return time.perf_counter() - t0
