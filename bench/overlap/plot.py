"""The timeline picture of an overlap benchmark run: one panel per mode, its last timed step.

Each rank has two rows: compute (top-level pipeline actions, coloured by kind) and communication (each
all-to-all from start to wait, light where compute ran meanwhile, dark where the rank was blocked on it).
All panels share one time scale, so step times compare by eye.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.overlap.stats import RankSteps

__all__ = ["render_timelines"]

_ACTION_COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#8fd19e", "W": "#dd8452", "FB": "#8172b3"}
_HIDDEN, _EXPOSED = "#f2c2c2", "#c0392b"


def _panel(ax, ranks: dict[int, RankSteps], title: str, xmax: float) -> None:
    t0 = min(r.begin for r in ranks.values())
    for rank, r in sorted(ranks.items()):
        y = 2 * rank
        for a in r.actions:
            if a.depth == 0:
                ax.barh(y, (a.end - a.start) * 1e3, left=(a.start - t0) * 1e3, height=0.8,
                        color=_ACTION_COLORS[a.op], edgecolor="black", lw=0.2)  # fmt: skip
        for c in r.comm:
            ax.barh(y + 1, (c.wait - c.start) * 1e3, left=(c.start - t0) * 1e3, height=0.6, color=_HIDDEN, lw=0)
            ax.barh(y + 1, c.exposed * 1e3, left=(c.blocked_from - t0) * 1e3, height=0.6, color=_EXPOSED, lw=0)
    n = len(ranks)
    ax.set_yticks(range(2 * n), [f"r{r} {k}" for r in sorted(ranks) for k in ("compute", "a2a")], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(0, xmax)
    ax.set_title(title, fontsize=8, loc="left")
    ax.tick_params(axis="x", labelsize=6)


def render_timelines(panels: Sequence[tuple[str, dict[int, RankSteps]]], path: str, title: str = "") -> None:
    """Draw ``(label, {rank: spans of one step})`` panels, stacked, into a PNG at ``path``."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state
    from matplotlib.patches import Patch

    if not panels:
        raise ValueError("nothing to draw")
    xmax = max((max(r.end for r in ranks.values()) - min(r.begin for r in ranks.values())) * 1e3 for _, ranks in panels)
    rows = sum(2 * len(ranks) for _, ranks in panels)
    fig = Figure(figsize=(11, 1.0 + 0.22 * rows + 0.35 * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)[:, 0]
    for ax, (label, ranks) in zip(axes, panels):
        _panel(ax, ranks, label, xmax)
    axes[-1].set_xlabel("ms since the step began", fontsize=7)
    legend = [Patch(color=c, label=k) for k, c in _ACTION_COLORS.items()]
    legend += [Patch(color=_HIDDEN, label="a2a in flight"), Patch(color=_EXPOSED, label="a2a blocked")]
    fig.legend(handles=legend, loc="upper right", fontsize=6, ncol=len(legend))
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=130)
