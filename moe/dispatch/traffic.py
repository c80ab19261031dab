"""What a dispatcher's all-to-alls send, counted when asked: ``dispatcher.traffic = Traffic()``.

Four kinds, one per all-to-all a block runs: ``dispatch`` and ``combine_backward`` (the dispatch direction:
token rows to the expert ranks, FP8 under FP8 dispatch), ``combine`` and ``dispatch_backward`` (the combine
direction: rows back, in the model dtype). Per kind: the all-to-alls started, the token rows this rank put into
them (its own share included: what the collective moves, not only what crosses links; a sync-free exchange's
padding rows included, they travel too), the bytes of those rows (FP8 values and their scales, or elements of
the model dtype) and the bytes of the routing data sent beside them (expert ids and weights, the weights'
gradients). Row counts that only the device knows (DeepEP's layout) are summed there and read once, by
:meth:`Traffic.summary`; without a ``Traffic`` nothing is counted and nothing runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KINDS", "Traffic"]

KINDS = ("dispatch", "combine", "dispatch_backward", "combine_backward")
"""The all-to-alls of one MoE block, forward then backward."""

Count = int | torch.Tensor


@dataclass(slots=True)
class _Tally:
    calls: int = 0
    rows: Count = 0
    data_bytes: Count = 0
    meta_bytes: Count = 0


class Traffic:
    """Running totals per kind of all-to-all (see the module docstring)."""

    def __init__(self) -> None:
        self._tallies = {kind: _Tally() for kind in KINDS}

    def add(self, kind: str, rows: Count, row_bytes: int, meta_row_bytes: int = 0) -> None:
        """One all-to-all of ``kind`` that sent ``rows`` rows of ``row_bytes`` bytes each, plus ``meta_row_bytes``
        of routing data per row. ``rows`` may be a device tensor (no host sync here)."""
        if isinstance(rows, torch.Tensor):
            rows = rows.to(torch.int64)  # int32 counts times row bytes overflow past 2 GB
        t = self._tallies[kind]
        t.calls += 1
        t.rows = t.rows + rows
        t.data_bytes = t.data_bytes + rows * row_bytes
        t.meta_bytes = t.meta_bytes + rows * meta_row_bytes

    def clear(self) -> None:
        """Start counting afresh."""
        self._tallies = {kind: _Tally() for kind in KINDS}

    def summary(self) -> dict[str, dict[str, int]]:
        """``{kind: {calls, rows, data_bytes, meta_bytes}}`` for every kind that ran (reads device counts)."""
        return {
            kind: {
                "calls": t.calls,
                "rows": int(t.rows),
                "data_bytes": int(t.data_bytes),
                "meta_bytes": int(t.meta_bytes),
            }
            for kind, t in self._tallies.items()
            if t.calls
        }
