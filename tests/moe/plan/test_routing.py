"""Expected distinct ranks and nodes per token against brute-force enumeration of the routing."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from moe.models.config import MoEConfig
from moe.plan.routing import expected_distinct, expected_nodes, expected_ranks


def _brute(cfg: MoEConfig, bins: int) -> Fraction:
    """Average distinct bins over every group subset and every top-k subset of its experts (all equally
    likely: uniform routing), experts contiguous over groups and over bins."""
    per_group, per_bin = cfg.num_experts // cfg.n_group, cfg.num_experts // bins
    total, count = Fraction(0), 0
    for groups in itertools.combinations(range(cfg.n_group), cfg.topk_group):
        eligible = [x for g in groups for x in range(g * per_group, (g + 1) * per_group)]
        for chosen in itertools.combinations(eligible, cfg.top_k):
            total += len({x // per_bin for x in chosen})
            count += 1
    return total / count


CASES = [
    # (experts, groups, groups per token, top-k, bins)
    (8, 2, 1, 2, 4),  # a token's experts stay in one half: at most 2 of 4 bins
    (8, 4, 2, 3, 4),  # bins = groups
    (12, 3, 2, 4, 6),  # bins inside groups
    (12, 4, 2, 3, 3),  # a bin straddles groups (3 experts per group, 4 per bin)
    (8, 1, 1, 3, 8),  # no group limit, one expert per bin
    (16, 8, 4, 8, 2),  # V3's routing shape at 16 experts over 2 bins
]


@pytest.mark.parametrize(("e", "g", "tg", "k", "bins"), CASES)
def test_expected_distinct_matches_enumeration(e: int, g: int, tg: int, k: int, bins: int) -> None:
    cfg = MoEConfig(num_experts=e, n_group=g, topk_group=tg, top_k=k)
    assert expected_distinct(cfg, bins) == pytest.approx(float(_brute(cfg, bins)), rel=1e-12)


def test_hand_value_and_node_cap() -> None:
    # 8 experts, 2 groups, one group per token, top-2, 4 ranks: the 2 experts fall among the group's 4
    # experts on 2 ranks; both on one rank with probability 2 C(2,2) / C(4,2) = 1/3: E = 1/3 + 2 (2/3) = 5/3.
    cfg = MoEConfig(num_experts=8, n_group=2, topk_group=1, top_k=2)
    assert expected_ranks(cfg, 4) == pytest.approx(5 / 3)
    assert expected_nodes(cfg, 4, 2) == pytest.approx(1.0)  # each group lives on one node of 2 ranks
    assert expected_nodes(cfg, 4, 8) == 1.0  # the ep group fits in a node
    with pytest.raises(ValueError, match="node-aligned"):
        expected_nodes(MoEConfig(num_experts=12, n_group=1, top_k=2), 6, 4)
    # DeepSeek-V3's routing: 256 experts, 8 groups, 4 per token, top-8, EP64 over 8 nodes: at most 4 nodes.
    v3 = MoEConfig(num_experts=256, n_group=8, topk_group=4, top_k=8)
    assert 3.0 < expected_nodes(v3, 64, 8) <= 4.0
    assert expected_nodes(v3, 64, 8) < expected_nodes(v3.replace(n_group=1, topk_group=1), 64, 8)
    assert 1.0 <= expected_ranks(v3, 64) <= 8.0
