"""dualpipe.events.timeline_text: a recorded timeline drawn as text, one line per span."""

from __future__ import annotations

import pytest

from dualpipe.events import timeline_text


def test_a_hand_made_pair_drawn_to_scale() -> None:
    rows = [  # (name, direction, layer, edge, seconds): milliseconds apart
        ("combine", "bwd", 1, "start", 0.0e-3),
        ("attn", "fwd", 0, "begin", 0.0e-3),
        ("attn", "fwd", 0, "end", 2.0e-3),
        ("dispatch", "fwd", 0, "start", 2.0e-3),
        ("combine", "bwd", 1, "wait", 2.0e-3),
        ("mlp.dx", "bwd", 1, "begin", 2.0e-3),
        ("mlp.dx", "bwd", 1, "end", 6.0e-3),
        ("mlp.dw", "bwd", 1, "begin", 6.0e-3),
        ("mlp.dw", "bwd", 1, "empty", 6.0e-3),
        ("dispatch", "fwd", 0, "wait", 7.0e-3),
        ("step", "FB", -1, "begin", 0.0e-3),  # another direction's span (a pipeline action): left out
        ("step", "FB", -1, "end", 8.0e-3),
    ]
    assert timeline_text(rows, width=7).splitlines() == [  # one character a millisecond
        "              |0.0 ms 7.0 ms|",
        "B.combine 1   |==     |",
        "F.attn 0      |##     |",
        "F.dispatch 0  |  =====|",
        "B.mlp.dx 1    |  #### |",
        "B.mlp.dw 1    |      .|",
    ]
    # a window: spans that end before it or begin after it are left out, the rest clipped to it
    assert timeline_text(rows, window=(2e-3, 6e-3), width=4).splitlines()[1:] == [
        "F.dispatch 0  |====|",
        "B.mlp.dx 1    |####|",
    ]
    with pytest.raises(ValueError, match=r"timeline_text: combine.bwd \(layer 1\) was waited without a start"):
        timeline_text(rows[4:5])
