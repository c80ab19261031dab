"""Memory per GPU of a layout: parameters, gradients, optimizer state, activations, all-to-all buffers.

Precision policy of issue 12 (moe/optimizer.py): bf16 parameters, fp32 ``main_grad`` buffers (every
parameter, ZeRO-1 does not shard them), AdamW's two fp32 moments plus an fp32 master copy, sharded under
ZeRO-1 over the data-parallel group for dense parameters and over the edp replicas for expert parameters.
The optimizer's sharding is a size-balanced partition of whole parameters (:func:`moe.optimizer.partition`),
not an even split: this module runs the same partition and reports its most loaded rank. Pure bf16
(``master_weights=False``) keeps gradients and moments in bf16 and no master. A pure fp32 model
(``param_bytes=4``) steps the parameters themselves: no master.

Activations: the schedule's peak live modules (:func:`dualpipe.simulate.simulate`'s count, the same action
lists the executor runs) times one module's saved bytes for one micro-batch (:func:`layer_activations`:
every tensor autograd keeps, listed per sub-stage). With recompute, a module keeps only its pieces'
inputs; the backward then rebuilds one piece's graph at a time, so one layer's full activation is added
once as the working set.

Headroom: :data:`HEADROOM` of HBM is kept free for the caching allocator's fragmentation, the CUDA
context, NCCL/DeepEP buffers not listed here and kernel workspaces (cuBLAS, Triton autotuning). 10% is a
stated allowance, not a measurement: replace it with ``cuda_peak_allocated_bytes`` from a run (moe.memory).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dualpipe.schedule import build_schedule, schedule_spec
from dualpipe.simulate import simulate
from moe.config import MoEConfig
from moe.optimizer import OPTIMIZERS, partition
from moe.plan.costs import Parallelism, Workload
from moe.plan.hardware import GPU
from moe.plan.params import ParamSpec, rank_params, rank_stages
from moe.plan.routing import expected_ranks

__all__ = [
    "HEADROOM",
    "LEAVES",
    "Footprint",
    "footprint",
    "layer_activations",
    "module_activation_bytes",
    "state_bytes",
]

HEADROOM = 0.10
"""Fraction of HBM left free (see the module docstring)."""

FP32 = 4
INDEX = 8


LEAVES = frozenset({"attn.input", "mlp.received_rows"})
"""Entries of :func:`layer_activations` that no autograd op saves: piece inputs the overlap runtime keeps
for the backward (a bf16 block input, whose fp32 copy is what the norm saves; the rows an ep > 1 dispatch
received, which permute reads but does not save). moe.memory's tracker counts saved tensors only."""


def _norm(prefix: str, t: int, d: int, b: int) -> dict[str, float]:
    """RMSNorm (fp32 inside) feeding a Linear: fp32 input (the input itself for an fp32 model, else a copy),
    rsqrt, fp32 normalised output, the fp32 weight copy (bf16 models) and the cast output the Linear saves."""
    out = {
        prefix + "norm_fp32_input": FP32 * t * d,
        prefix + "norm_rsqrt": FP32 * t,
        prefix + "norm_fp32_output": FP32 * t * d,
        prefix + "norm_output": b * t * d,
    }
    if b < FP32:
        out[prefix + "norm_fp32_weight"] = FP32 * d
    return out


def layer_activations(
    cfg: MoEConfig, layer: int, tokens: int, seq_len: int, act_bytes: int, ep: int = 1
) -> dict[str, float]:
    """Bytes one micro-batch of ``tokens`` leaves for backward in block ``layer``, by tensor.

    Follows the modules (moe/layers.py, moe/block.py, moe/router.py, kernels/functional.py): each RMSNorm
    saves what :func:`_norm` lists; rotary saves only its cos/sin tables (the multiplications by constants
    need no input); SDPA saves q, k, v, its output and the fp32 log-sum-exp (FlashAttention's set; its output
    is laid out ``[B, S, H, C]``, so the output projection's input is a view of it, not a copy); the router
    saves fp32 sigmoid scores, the int64 top-k ids and the chosen scores; the grouped experts save the
    sorted rows and the gate/up output, unpermute the expert outputs, the int64 row ids and the fp32
    routing weights; a SwiGLU MLP saves its input, the gate/up output and the down projection's input.
    Received rows per rank are ``T x`` :func:`moe.plan.routing.expected_ranks`; at ep = 1 they are the
    normed tokens themselves (no copy). Keys ``"attn.<tensor>"`` / ``"mlp.<tensor>"``; :data:`LEAVES`
    marks the ones kept by the runtime rather than saved by autograd.
    """
    t, d, c, b = tokens, cfg.hidden_size, cfg.attn_head_dim, act_bytes
    h, g, k = cfg.num_heads, cfg.num_kv_heads, cfg.top_k
    seqs = t // seq_len
    out: dict[str, float] = {"attn.input": b * t * d} if b < FP32 else {}
    out.update(_norm("attn.", t, d, b))
    out.update(
        {
            "attn.rotary_tables": 2 * FP32 * seq_len * c // 2,
            "attn.sdpa_qkv": b * t * (h + 2 * g) * c,
            "attn.sdpa_out": b * t * h * c,
            "attn.sdpa_lse": FP32 * seqs * h * seq_len,
        }
    )
    out.update(_norm("attn.mlp_", t, d, b))
    if not cfg.is_moe_layer(layer):
        f = cfg.dense_intermediate_size
        out.update({"mlp.swiglu_input": b * t * 2 * f, "mlp.down_input": b * t * f})
        return out
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    rows = t * expected_ranks(cfg, ep) if ep > 1 else 0.0
    m = t * k
    out.update(
        {
            "attn.router_scores_fp32": FP32 * t * e,
            "attn.router_topk": t * k * (INDEX + FP32) + FP32 * t,  # ids, chosen scores, their sum
            "mlp.received_rows": b * rows * d,
            "mlp.routing_weights": FP32 * (rows if ep > 1 else t) * k,
            "mlp.row_ids": INDEX * m,
            "mlp.experts_input": b * m * d,
            "mlp.experts_gate_up_output": b * m * 2 * f,
            "mlp.experts_output": b * m * d,
        }
    )
    if cfg.num_shared_experts:
        fs = cfg.num_shared_experts * f
        out.update({"mlp.shared_swiglu_input": b * t * 2 * fs, "mlp.shared_down_input": b * t * fs})
    return out


def _kept_with_recompute(cfg: MoEConfig, layer: int, tokens: int, act_bytes: int, ep: int) -> float:
    """What a recomputed layer keeps per micro-batch: the attention input ``h``, the MLP inputs (``z``; MoE:
    the received rows and weights) and the routing decision replayed by the recompute (int64 ids)."""
    t, d, b = tokens, cfg.hidden_size, act_bytes
    kept = 2 * b * t * d
    if cfg.is_moe_layer(layer):
        rows = t * (expected_ranks(cfg, ep) if ep > 1 else 1.0)
        kept += b * rows * d + FP32 * rows * cfg.top_k + INDEX * t * cfg.top_k
    return kept


def _stage_extras(cfg: MoEConfig, tokens: int, act_bytes: int, first: bool, last: bool) -> float:
    """Embedding (int64 ids) and head: the final norm's fp32 tensors, the head's input, the logits and
    the loss's fp32 log-sum-exp (moe/loss.py); kept with or without recompute (those pieces never recompute)."""
    t, d, b = tokens, cfg.hidden_size, act_bytes
    extra = INDEX * t if first else 0.0
    if last:
        extra += sum(_norm("head.", t, d, b).values()) + b * t * cfg.vocab_size + (FP32 + INDEX + 1) * t
    return extra


def module_activation_bytes(
    cfg: MoEConfig,
    layers: range,
    tokens: int,
    seq_len: int,
    act_bytes: int,
    ep: int,
    *,
    first: bool,
    last: bool,
    recompute: bool,
) -> float:
    """Bytes one module (a stage's layers) keeps for one micro-batch between its forward and backward."""
    if recompute:
        body = sum(_kept_with_recompute(cfg, i, tokens, act_bytes, ep) for i in layers)
    else:
        body = sum(sum(layer_activations(cfg, i, tokens, seq_len, act_bytes, ep).values()) for i in layers)
    return body + _stage_extras(cfg, tokens, act_bytes, first, last)


def state_bytes(
    specs: list[ParamSpec],
    *,
    param_bytes: int,
    master_weights: bool,
    dp: int,
    edp: int,
    zero: bool,
    optimizer: str = "adamw",
) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of one rank holding ``specs``.

    Optimizer state: the optimizer's state tensors of the parameter's size (AdamW's two moments, SGD's one
    momentum: :attr:`moe.optimizer.OptimizerSpec.moments`), plus an fp32 master where the parameters are lower
    precision and ``master_weights``; with ``zero`` the worst rank of moe.optimizer's partition (dense over
    ``dp``, experts over ``edp``). The 0-d step counters are left out, as ``DistributedOptimizer.state_bytes``
    leaves them."""
    moments = OPTIMIZERS.lookup(optimizer).moments
    mixed = master_weights and param_bytes < FP32
    grad_elem = FP32 if mixed else param_bytes
    state_elem = (moments + 1) * FP32 if mixed else moments * (FP32 if master_weights else param_bytes)
    params = sum(p.numel for p in specs) * param_bytes
    grads = sum(p.numel for p in specs) * grad_elem
    state = 0
    for expert, size in ((False, dp), (True, edp)):
        numels = [p.numel for p in specs if p.expert == expert]
        if zero and size > 1:
            load = [0] * size
            for n, owner in zip(numels, partition(numels, size)):
                load[owner] += n
            state += max(load) * state_elem
        else:
            state += sum(numels) * state_elem
    return params, grads, state


@dataclass(frozen=True, slots=True)
class Footprint:
    """Bytes per GPU on the most loaded pipeline rank."""

    pp_rank: int
    params: float
    grads: float
    optimizer: float
    activations: float
    """Peak live modules x one module's bytes per micro-batch (+ the recompute working set)."""
    peak_modules: int
    """The schedule's peak live activations on this rank, in modules (dualpipe.simulate)."""
    all_to_all_buffers: float
    """Send and receive buffers of one dispatch (and its combine) in flight, per micro-batch kept alive by
    the overlap: two micro-batches' worth (the overlapped pair)."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.all_to_all_buffers

    def fits(self, gpu: GPU, headroom: float = HEADROOM) -> bool:
        """``total <= (1 - headroom) x HBM``."""
        return self.total <= (1 - headroom) * gpu.hbm_bytes


@functools.lru_cache(maxsize=256)
def _peak_modules(schedule: str, pp: int, chunks: int, modules_per_rank: int | None) -> tuple[int, ...]:
    """Peak live activations per rank, in modules (the simulator's count; cached: a search asks for the same
    schedule shape once per candidate)."""
    return simulate(build_schedule(schedule, pp, chunks, modules_per_rank=modules_per_rank)).peak_activations


def footprint(
    cfg: MoEConfig,
    par: Parallelism,
    work: Workload,
    *,
    num_chunks: int | None = None,
    zero: bool = True,
    param_bytes: int = 2,
    optimizer: str = "adamw",
) -> Footprint:
    """Memory of every pipeline rank of ``par`` running ``work``; the largest is returned.

    ``num_chunks``: micro-batches per step (default: the schedule's default for ``pp``; the peak stops
    growing once it reaches the pipeline depth). ``param_bytes``: 2 for bf16 parameters (issue 12's
    default), 4 for an fp32 model. ``optimizer``: a name of :data:`moe.optimizer.OPTIMIZERS`."""
    spec = schedule_spec(par.schedule)
    chunks = num_chunks if num_chunks is not None else spec.default_chunks(par.pp)
    peaks = _peak_modules(par.schedule, par.pp, chunks, par.modules_per_rank)
    t, b = work.tokens, work.act_bytes
    worst: Footprint | None = None
    for r in range(par.pp):
        stages = rank_stages(cfg, par.pp, par.schedule, r, par.modules_per_rank)
        modules = [
            module_activation_bytes(
                cfg, layers, t, work.seq_len, b, par.ep, first=first, last=last, recompute=work.recompute
            )
            for _, layers, first, last in stages
        ]
        # The simulator counts modules, not which: charge the rank's heaviest module for every live one.
        acts = peaks[r] * max(modules)
        if work.recompute:
            acts += max(
                (
                    sum(layer_activations(cfg, i, t, work.seq_len, b, par.ep).values())
                    for _, ls, _, _ in stages
                    for i in ls
                ),
                default=0.0,
            )
        moe_layers = any(cfg.is_moe_layer(i) for _, ls, _, _ in stages for i in ls)
        rows = t * expected_ranks(cfg, par.ep) if par.ep > 1 and moe_layers else 0.0
        a2a = 2 * 2 * rows * cfg.hidden_size * b  # send + receive rows, two micro-batches in flight
        p, g, o = state_bytes(
            rank_params(cfg, par.pp, par.ep, par.schedule, r, par.modules_per_rank),
            param_bytes=param_bytes,
            master_weights=work.master_weights,
            dp=par.dp,
            edp=par.edp,
            zero=zero,
            optimizer=optimizer,
        )
        fp = Footprint(r, p, g, o, acts, peaks[r], a2a)
        if worst is None or fp.total > worst.total:
            worst = fp
    assert worst is not None
    return worst
