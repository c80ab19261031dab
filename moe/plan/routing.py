"""Where a routed token goes: expected distinct ranks and nodes under group-limited routing.

Model (uniform routing, the balanced state auxiliary-loss-free balancing aims at): a token picks
``topk_group`` of the ``n_group`` expert groups, every subset equally likely, then ``top_k`` distinct experts
uniformly among the experts of the chosen groups. Experts are contiguous over the ep ranks (rank r holds
experts ``[r E/ep, (r+1) E/ep)``, as :class:`moe.dispatch` lays them out) and the ep ranks are contiguous
over nodes (ep innermost in the mesh: a node holds ``gpus_per_node`` consecutive ep ranks).

Expected distinct bins, exactly: by linearity, E[#bins hit] = sum over bins b of P(b hit) = sum_b (1 -
P(miss b)). Given the chosen groups S, bin b has m_b(S) = sum_{j in S} c_bj eligible experts (c_bj: b's
experts in group j) out of ``topk_group * E / n_group``, and the top-k misses all of them with the
hypergeometric probability C(n - m, K) / C(n, K). P(miss b) averages that over the C(n_group, topk_group)
subsets S; a small dynamic programme over the groups gives the distribution of m_b(S) without listing S.
"""

from __future__ import annotations

import functools
from math import comb

from moe.models.config import MoEConfig

__all__ = ["expected_distinct", "expected_nodes", "expected_ranks"]


def _bin_counts(cfg: MoEConfig, num_bins: int) -> list[list[int]]:
    """``counts[b][j]``: experts of group j held by bin b, for experts split contiguously into ``num_bins``."""
    e, g = cfg.num_experts, cfg.n_group
    if e % num_bins:
        raise ValueError(f"num_experts={e} does not split into {num_bins} contiguous bins")
    per_bin, per_group = e // num_bins, e // g
    counts = [[0] * g for _ in range(num_bins)]
    for x in range(e):
        counts[x // per_bin][x // per_group] += 1
    return counts


def _miss_probability(cfg: MoEConfig, c_j: list[int]) -> float:
    g, tg, k = cfg.n_group, cfg.topk_group, cfg.top_k
    eligible = tg * (cfg.num_experts // g)
    # ways[t][m]: number of subsets of the groups seen so far with t groups and m of this bin's experts.
    ways = [[0] * (sum(c_j) + 1) for _ in range(tg + 1)]
    ways[0][0] = 1
    for c in c_j:
        for t in range(tg, 0, -1):
            for m in range(len(ways[t]) - 1, c - 1, -1):
                ways[t][m] += ways[t - 1][m - c]
    total = comb(g, tg)
    return sum(w * comb(eligible - m, k) / comb(eligible, k) for m, w in enumerate(ways[tg]) if w) / total


def expected_distinct(cfg: MoEConfig, num_bins: int) -> float:
    """Expected number of the ``num_bins`` contiguous expert bins one token's top-k experts fall in."""
    return _expected_distinct(cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.top_k, num_bins)


@functools.lru_cache(maxsize=1024)
def _expected_distinct(num_experts: int, n_group: int, topk_group: int, top_k: int, num_bins: int) -> float:
    # Cached on the routing fields alone: a planner search asks for the same few values thousands of times.
    cfg = MoEConfig(num_experts=num_experts, n_group=n_group, topk_group=topk_group, top_k=top_k)
    return sum(1.0 - _miss_probability(cfg, c_j) for c_j in _bin_counts(cfg, num_bins))


def expected_ranks(cfg: MoEConfig, ep: int) -> float:
    """Expected distinct ep ranks a token is sent to (its own rank included when it holds a chosen expert)."""
    return expected_distinct(cfg, ep)


def expected_nodes(cfg: MoEConfig, ep: int, gpus_per_node: int) -> float:
    """Expected distinct nodes a token's experts live on, ep ranks laid over nodes of ``gpus_per_node``.

    An ep group no larger than a node sits on one node (1.0); a larger one must be whole nodes (DeepEP's
    internode kernels take groups of consecutive 8-rank nodes; moe.parallel checks node alignment)."""
    if ep <= gpus_per_node:
        return 1.0
    if ep % gpus_per_node:
        raise ValueError(f"ep={ep} is not node-aligned: it must be a multiple of gpus_per_node={gpus_per_node}")
    return expected_distinct(cfg, ep // gpus_per_node)
