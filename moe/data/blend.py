"""Which component dataset each global sample of a blend comes from (Megatron's BlendedDataset rule).

Global sample i goes to the dataset k maximising ``weight_k * max(i, 1) - count_k(i)`` (count_k(i): samples
given to k before i; ties to the lower k), and is that dataset's ``count_k(i)``-th sample. This reproduces
Megatron-LM's order exactly: it is ``build_blending_indices`` of megatron/core/datasets/helpers.cpp (the
same double arithmetic, strict ``>`` so the first maximum wins). With two datasets every count stays within
one sample of ``weight_k * i`` after i samples; with more, a rare dataset can lag a little further (up to
about 1.4 samples in random trials), as in Megatron.

The rule is sequential, so the schedule keeps the counts at every multiple of :data:`CHECKPOINT_EVERY`
samples, extended on demand up to the largest index asked: a batch then costs at most one checkpoint stride
plus its own length of steps, and a resumed run pays once for walking up to its first sample.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CHECKPOINT_EVERY", "BlendSchedule", "blend_reference"]

# Steps from a checkpoint to any sample: 4096 steps of the Python loop is about a millisecond.
CHECKPOINT_EVERY = 4096


class BlendSchedule:
    """The blend assignment as a pure function of (weights, sample index).

    Args:
        weights: per-dataset weights, positive, summing to 1.
    """

    def __init__(self, weights: list[float]) -> None:
        self.weights = [float(w) for w in weights]
        self._checkpoints: list[list[int]] = [[0] * len(self.weights)]  # counts before sample c * CHECKPOINT_EVERY

    def _walk(self, counts: list[int], first: int, n: int, out: np.ndarray | None) -> None:
        """Advance ``counts`` (in place) over samples [first, first + n), writing dataset ids to ``out``."""
        weights, num = self.weights, len(self.weights)
        # Megatron's build_blending_indices (helpers.cpp): error_k = weight_k * max(i, 1) - count_k, first max.
        for j, i in enumerate(range(first, first + n)):
            x = float(max(i, 1))
            best, best_err = 0, weights[0] * x - counts[0]
            for k in range(1, num):
                err = weights[k] * x - counts[k]
                if err > best_err:
                    best, best_err = k, err
            counts[best] += 1
            if out is not None:
                out[j] = best

    def _counts_at_checkpoint(self, c: int) -> list[int]:
        while len(self._checkpoints) <= c:
            counts = list(self._checkpoints[-1])
            self._walk(counts, (len(self._checkpoints) - 1) * CHECKPOINT_EVERY, CHECKPOINT_EVERY, None)
            self._checkpoints.append(counts)
        return self._checkpoints[c]

    def assign(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples [first, first + n): (dataset index int64 [n], that dataset's sample index int64 [n])."""
        c = first // CHECKPOINT_EVERY
        counts = list(self._counts_at_checkpoint(c))
        start = c * CHECKPOINT_EVERY
        self._walk(counts, start, first - start, None)
        base = np.array(counts, dtype=np.int64)
        dataset = np.empty(n, dtype=np.int64)
        self._walk(counts, first, n, dataset)
        # A dataset's k-th pick in the range is its (base + k)-th sample overall.
        local = np.empty(n, dtype=np.int64)
        for k in range(len(self.weights)):
            mine = dataset == k
            local[mine] = base[k] + np.arange(int(mine.sum()), dtype=np.int64)
        return dataset, local


def blend_reference(weights: list[float], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The rule written out over all of [0, n) with numpy: the oracle for :class:`BlendSchedule` in tests.

    A line-for-line transcription of Megatron-LM's ``build_blending_indices`` (helpers.cpp), so it gives
    Megatron's order.
    """
    w = np.asarray(weights, dtype=np.float64)
    counts = np.zeros(len(w), dtype=np.int64)
    dataset, local = np.empty(n, np.int64), np.empty(n, np.int64)
    for i in range(n):
        # max(i, 1) as Megatron; argmax returns the first maximum: ties to the lower k, as its strict ">".
        k = int(np.argmax(w * max(i, 1) - counts))
        dataset[i], local[i] = k, counts[k]
        counts[k] += 1
    return dataset, local
