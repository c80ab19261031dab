"""The planner's cost model for one candidate: :mod:`moe.plan.costs` and :mod:`moe.plan.footprint` behind the
:class:`moe.plan.search.CostModel` interface the search times schedules with."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from moe.models.config import MoEConfig
from moe.plan.costs import (
    NO_FP8,
    TRAINER_DEFAULTS,
    MemoryOptions,
    Parallelism,
    Precision,
    SubstageCosts,
    Workload,
    substage_costs,
)
from moe.plan.flops import model_flops_per_token
from moe.plan.footprint import Footprint, footprint, offloaded_bytes
from moe.plan.hardware import Cluster
from moe.plan.measured import MeasuredCosts
from moe.plan.pair import BlockTimes
from moe.plan.params import ConfigKey, rank_stages
from moe.plan.search import Candidate

__all__ = ["LayerCostModel", "block_times"]


@functools.lru_cache(maxsize=1024)
def _footprint(key: ConfigKey, par: Parallelism, work: Workload, num_chunks: int, zero: bool) -> Footprint:
    return footprint(key.cfg, par, work, num_chunks=num_chunks, zero=zero)


def block_times(c: SubstageCosts) -> BlockTimes:
    """One layer's sub-stage seconds in the form the two-stream model takes."""
    return BlockTimes(
        attn_f=c.attn_F,
        attn_dx=c.attn_dX,
        attn_dw=c.attn_dW,
        mlp_f=c.mlp_F,
        mlp_dx=c.mlp_dX,
        mlp_dw=c.mlp_dW,
        dispatch=c.dispatch,
        combine=c.combine,
        shared_f=c.shared_F,
        shared_dx=c.shared_dX,
        shared_dw=c.shared_dW,
        host_f=c.host_F,
        host_b=c.host_B,
        counts=c.counts,
    )


@dataclass(frozen=True)
class LayerCostModel:
    """Analytic (or, with ``measured``, measured and scaled) costs of ``candidate`` on ``cluster``."""

    cfg: MoEConfig
    cluster: Cluster
    candidate: Candidate
    seq_len: int
    micro_batch: int
    tokens_per_step: int
    zero: bool = True
    measured: MeasuredCosts | None = None
    act_bytes: int | None = None
    """Bytes per activation element; None: the measured file's (a CPU benchmark runs fp32), else bf16's 2."""
    memory_options: MemoryOptions = TRAINER_DEFAULTS
    """Optimizer-state dtype, FP8 caching, MTP sharing (the recompute granularity is the candidate's)."""
    precision: Precision = NO_FP8
    """FP8 GEMMs and FP8 dispatch."""
    expert_imbalance: float = 1.0
    """The busiest expert-parallel rank's routed rows over the mean (:class:`moe.plan.costs.Workload`)."""

    @property
    def parallelism(self) -> Parallelism:
        c = self.candidate
        return Parallelism(
            pp=c.pp,
            dp=c.dp,
            ep=c.ep,
            schedule=c.schedule,
            pipeline_layout=c.pipeline_layout,
            extra_warmup=c.extra_warmup,
            offload=c.offload,
        )

    @property
    def workload(self) -> Workload:
        c = self.candidate
        act_bytes = self.act_bytes or (self.measured.act_bytes if self.measured is not None else 2)
        return Workload(
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            comm_sms=c.comm_sms,
            recompute=c.recompute,
            act_bytes=act_bytes,
            state_dtype=self.memory_options.state_dtype,
            fp8_activations=self.memory_options.fp8_activations,
            mtp_shared=self.memory_options.mtp_shared,
            ema=self.memory_options.ema,
            precision=self.precision,
            expert_imbalance=self.expert_imbalance,
        )

    def _costs(self, moe: bool) -> SubstageCosts:
        return substage_costs(self.cfg, self.cluster, self.parallelism, self.workload, moe=moe, measured=self.measured)

    @functools.cached_property
    def _moe(self) -> SubstageCosts:
        return self._costs(moe=True)

    @functools.cached_property
    def _dense(self) -> SubstageCosts:
        return self._costs(moe=False)

    def layer(self, layer: int) -> SubstageCosts:
        return self._moe if self.cfg.is_moe_layer(layer) else self._dense

    def block(self, layer: int) -> BlockTimes:
        return block_times(self.layer(layer))

    def embed(self) -> tuple[float, float]:
        return self._moe.embed_F, self._moe.embed_B

    def head(self) -> tuple[float, float]:
        return self._moe.head_F, self._moe.head_B

    def p2p(self) -> float:
        return self._moe.p2p

    def dp_reduce(self) -> float:
        return self._moe.dp_reduce

    def shared_cores(self) -> tuple[float, float, float] | None:
        return self.measured.shared_cores() if self.measured is not None else None

    def offload_seconds(self, rank: int) -> list[float]:
        c, par = self.candidate, self.parallelism
        stages = [sp for _, sp in rank_stages(self.cfg, c.pp, c.schedule, rank, pipeline_layout=c.pipeline_layout)]
        moved = offloaded_bytes(self.cfg, par, self.workload, rank, stages)
        return [b / self.cluster.gpu.host_bytes_per_s for b in moved]

    @functools.cached_property
    def _footprint(self) -> Footprint:
        # The SMs reserved for communication change no byte: candidates that differ only in them, or in overlap
        # (not part of the parallelism), share one footprint.
        work = dataclasses.replace(self.workload, comm_sms=0)
        return _footprint(ConfigKey.of(self.cfg), self.parallelism, work, self.candidate.num_chunks, self.zero)

    def memory(self, pp_rank: int | None = None) -> Footprint:
        """The footprint of pipeline rank ``pp_rank`` (None: the fullest rank's)."""
        if pp_rank is None:
            return self._footprint
        c = self.candidate
        par, work = self.parallelism, self.workload
        return footprint(self.cfg, par, work, num_chunks=c.num_chunks, zero=self.zero, pp_rank=pp_rank)

    def fits(self) -> bool:
        return self._footprint.fits(self.cluster.gpu)

    def model_flops(self) -> float:
        return model_flops_per_token(self.cfg, self.seq_len) * self.tokens_per_step
