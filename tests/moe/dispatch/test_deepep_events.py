"""DeepEP V1: every launch waits for an event captured once its inputs exist.

With ``previous_event`` DeepEP's comm stream waits for that event and nothing else, so an event older than
the tokens (the layout's, captured at plan time) lets dispatch read them before the compute stream writes
them. The V1 emulation's stream order (``fake_deep_ep.StreamOrder``) stamps what each torch op writes and
raises on such a launch; the ``deepep`` dispatcher launches as on CUDA (an event and comm-stream allocation
on every call) with tokens produced after routing, on 2 gloo ranks.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from moe.dispatch import DispatchOptions, make_dispatcher
from tests.distributed import run_ranks
from tests.moe.dispatch.test_dispatch import HIDDEN, NUM_EXPERTS, TOP_K, _routing

BF16 = torch.bfloat16


def _the_emulation_sees_a_stale_event(ep, rank: int) -> None:
    buf = ep.Buffer(dist.group.WORLD, 1 << 20, explicitly_destroy=True)
    launch = {"async_finish": True, "allocate_on_comm_stream": True}
    idx = _routing("random", rank, 4)
    per_rank, _, per_expert, in_rank, layout_event = buf.get_dispatch_layout(
        idx, NUM_EXPERTS, previous_event=ep.Buffer.capture(), **launch
    )
    x = torch.randn(4, HIDDEN).to(BF16)  # written after the layout's event
    w = torch.rand(4, TOP_K)
    rows = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}
    with pytest.raises(RuntimeError, match=r"race: x is written at step \d+ of the compute stream, after the event"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, previous_event=layout_event, **rows, **launch)
    *_, event = buf.dispatch(x, topk_idx=idx, topk_weights=w, previous_event=ep.Buffer.capture(), **rows, **launch)
    event.current_stream_wait()
    buf.destroy()


def _ordered(rank: int, world: int) -> list[tuple[bool, bool]]:
    from tests.moe.dispatch import fake_deep_ep as ep

    sys.modules["deep_ep"] = ep
    dispatcher = make_dispatcher(
        "deepep", NUM_EXPERTS, dist.group.WORLD, DispatchOptions(hidden_size=HIDDEN, dtype=BF16)
    )
    gen = torch.Generator().manual_seed(rank)
    h_TD, w_TK = torch.randn(5, HIDDEN, generator=gen), torch.rand(5, TOP_K, generator=gen)
    with ep.StreamOrder():
        _the_emulation_sees_a_stale_event(ep, rank)
        route = dispatcher.plan(_routing("random", rank, 5))
        x_TD = (2 * h_TD).to(BF16)  # the tokens: compute issued after routing
        got = dispatcher.dispatch(route, x_TD, w_TK).wait()
        y_TD = dispatcher.combine(route, 3 * got.x_RD).wait()  # the experts' output: after dispatch
        dispatcher.dispatch_backward(route, 2 * got.x_RD, 2 * got.weights_RK).wait()
        dispatcher.combine_backward(route, 2 * y_TD).wait()
    launches = dispatcher.buffer.launches
    dispatcher.close()
    return launches


def test_every_deepep_launch_waits_for_an_event_captured_after_its_inputs() -> None:
    for launches in run_ranks(_ordered, world_size=2, timeout=120):
        # layout, dispatch, combine, combine (dispatch backward), cached dispatch: each with its own event.
        assert launches == [(True, True)] * 5
