"""Bad input fails early with a message that says what to change."""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist

from moe import MoEConfig, MoEStage
from moe.dispatch import DispatchOptions, make_dispatcher
from moe.dispatch.deepep import DEEPEP_INSTALL_HINT
from moe.dispatch.deepep_common import import_deep_ep
from moe.parallel import ParallelConfig, build_stages, init_layout
from tests.distributed import run_ranks
from tests.moe.helpers import tiny_config


def _bad_layouts(rank: int, world: int) -> list[str]:
    messages = []
    with pytest.raises(ValueError, match=r"pp x dp = 2 x 2 = 4 does not equal the world size 2") as e:
        init_layout(ParallelConfig(pp=2, ep=2))
    messages.append(str(e.value))
    layout = init_layout(ParallelConfig(pp=1, ep=2))
    with pytest.raises(ValueError, match="num_experts=7 is not divisible by the expert-parallel size") as e:
        make_dispatcher("alltoall", 7, layout.ep_group)
    messages.append(str(e.value))
    with pytest.raises(ValueError, match=r"parallel\.ep = 2: must divide the model's 5 experts"):
        build_stages(tiny_config(num_experts=5, n_group=1, topk_group=1), layout)
    sys.modules.pop("deep_ep", None)
    with pytest.raises(ImportError, match="built from source") as e:
        make_dispatcher("deepep", 8, dist.group.WORLD, DispatchOptions(hidden_size=32))
    messages.append(str(e.value))
    return messages


def test_bad_parallel_input_raises_clear_errors():
    messages = run_ranks(_bad_layouts, world_size=2, timeout=60)[0]
    assert "github.com/deepseek-ai/DeepEP" in messages[-1] and "alltoall" in messages[-1]


def test_deepep_missing_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # an import of deep_ep now fails
    with pytest.raises(ImportError, match="NVSHMEM"):
        import_deep_ep(DEEPEP_INSTALL_HINT)


def test_top_k_larger_than_experts():
    with pytest.raises(ValueError, match="top_k=5 is larger than num_experts=4"):
        MoEConfig(num_experts=4, top_k=5, n_group=1, topk_group=1)


def test_bad_parallel_config():
    with pytest.raises(ValueError, match="unknown dispatcher"):
        ParallelConfig(dispatcher="nccl")
    with pytest.raises(ValueError, match="even number of pipeline ranks"):
        ParallelConfig(pp=3, schedule="dualpipe")
    # Plain-graph stages (piecewise=False) run expert parallelism with blocking all-to-alls, but cannot pair.
    plain = MoEStage(tiny_config(), range(2), first=True, last=True, piecewise=False)
    with pytest.raises(ValueError, match="needs piecewise=True stages"):
        MoEStage.overlapped_forward_backward(plain, [], None, [], plain, None, [], [])
