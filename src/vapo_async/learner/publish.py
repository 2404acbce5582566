"""Publishing the actor after every training step that changed it.

Every rank takes part in gathering the full state dict (a collective under FSDP2:
``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` materialises the full tensors on
rank 0's CPU one parameter at a time and returns an empty dict elsewhere, so rank 0 holds exactly
one full copy); rank 0 then writes it with ``transport.weights.WeightPublisher`` as
``RUN_DIR/weights/v{version:08d}`` (atomic rename, sha256 manifest, last K kept) and returns the
announcement, which the module hands to the controller together with ``step_done``.

Not a Lightning Callback on purpose: the announcement must reach the controller before the step is
reported done (so new leases require the new version), and that ordering is clearest inline.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from torch import nn

from vapo_async.learner.models import export_state_dict
from vapo_async.transport.messages import WeightAnnouncement
from vapo_async.transport.weights import (
    MANIFEST,
    WeightPublisher,
    announcement_for,
    published_versions,
    version_dir_name,
)

log = logging.getLogger(__name__)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on CPU (rank 0 under FSDP2; an independent copy on one device)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class WeightPublishing:
    """Gather (all ranks) and publish (rank 0) actor versions under ``root``."""

    def __init__(self, root: Path, base_dir: str, keep: int, rank: int) -> None:
        self.root = Path(root)
        self.rank = rank
        self.publisher = WeightPublisher(root, base_dir, keep) if rank == 0 else None
        self.last: WeightAnnouncement | None = None
        self.publish_s = 0.0

    def publish(self, actor: nn.Module, version: int) -> WeightAnnouncement | None:
        """Collective: every rank calls it; rank 0 returns the announcement, others None."""
        state = full_state_dict(actor)
        if self.publisher is None:
            return None
        ann = self.publisher.publish(version, export_state_dict(actor, state))
        self.last = ann
        return ann

    def versions(self) -> list[int]:
        """Rank 0: the complete versions under ``root`` (oldest first)."""
        return list(published_versions(self.root))

    def existing(self, version: int) -> WeightAnnouncement | None:
        """Rank 0: the announcement of an already published ``version`` (None if it is gone)."""
        path = self.root / version_dir_name(version)
        return announcement_for(path) if (path / MANIFEST).is_file() else None

    def remove_newer(self, version: int) -> list[Path]:
        """Rank 0, on resume: delete versions newer than ``version`` (published after the
        checkpoint, by the run that crashed); the resumed run publishes them again."""
        if self.publisher is None:
            return []
        gone = [p for v, p in published_versions(self.root, complete=False).items() if v > version]
        for p in gone:
            shutil.rmtree(p)
        if gone:
            log.warning("resume at version %d: removed newer weight versions %s", version, [p.name for p in gone])
        return gone

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
