"""Transport counters of the controller and rate-limited logging of rejected messages."""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("vapo_async.controller")


class TransportStats:
    """Counts rejected messages per reason and logs each reason at most once per interval, with
    the sender and the number suppressed since the last line (a flood never floods the log)."""

    def __init__(self, log_interval_s: float) -> None:
        self.log_interval_s = log_interval_s
        self.rejected: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self._last_log: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def reject(self, reason: str, sender: str, detail: str, now: float) -> None:
        """Count one rejected message and maybe log it (``now``: the caller's monotonic clock)."""
        self.rejected[reason] += 1
        if now - self._last_log.get(reason, -1e18) < self.log_interval_s:
            self._suppressed[reason] += 1
            return
        extra = f" (+{self._suppressed.pop(reason)} more since last report)" if self._suppressed[reason] else ""
        self._last_log[reason] = now
        log.warning("rejected message from %s: %s: %s%s", sender, reason, detail[:300], extra)

    def metrics(self) -> dict[str, float]:
        """``transport/rejected``, ``transport/rejected/<reason>`` and ``transport/<count>``."""
        out = {"transport/rejected": float(sum(self.rejected.values()))}
        out.update({f"transport/rejected/{r}": float(n) for r, n in self.rejected.items()})
        out.update({f"transport/{k}": float(v) for k, v in self.counts.items()})
        return out
