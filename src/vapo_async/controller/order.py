"""Prompt order: a cursor over the dataset with a seeded shuffle per epoch.

Epoch e visits ``permutation(seed, e)`` of range(N) (or range(N) unshuffled); the permutation is a
pure function of (seed, e), so the state is just (epoch, cursor).
"""

from __future__ import annotations

import numpy as np


class PromptOrder:
    """Yields dataset indices epoch after epoch."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if n < 1:
            raise ValueError("the prompt dataset is empty")
        self.n = n
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def peek(self) -> int:
        """The next index without consuming it."""
        return int(self._perm[self.cursor])

    def next(self) -> int:
        """The next index (advances to the next epoch at the end of this one)."""
        index = int(self._perm[self.cursor])
        self.cursor += 1
        if self.cursor == self.n:
            self.epoch += 1
            self.cursor = 0
            self._perm = self._permutation(self.epoch)
        return index

    def state_dict(self) -> dict[str, int | bool]:
        """(epoch, cursor) plus n/seed/shuffle for a consistency check."""
        return {"epoch": self.epoch, "cursor": self.cursor, "n": self.n, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, d: dict[str, int | bool]) -> None:
        """Restore; refuses a state made for another dataset size, seed or shuffle setting."""
        if (d["n"], d["seed"], d["shuffle"]) != (self.n, self.seed, self.shuffle):
            raise ValueError(
                f"prompt-order state is for n={d['n']}, seed={d['seed']}, shuffle={d['shuffle']}; "
                f"this run has n={self.n}, seed={self.seed}, shuffle={self.shuffle}"
            )
        self.epoch = int(d["epoch"])
        self.cursor = int(d["cursor"])
        if not 0 <= self.cursor < self.n:
            raise ValueError(f"prompt-order cursor {self.cursor} outside [0, {self.n})")
        self._perm = self._permutation(self.epoch)
