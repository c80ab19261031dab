"""Memory per GPU of a layout: parameters, gradients, optimizer state, activations, all-to-all buffers.

Precision policy of issue 12 (moe/train/optimizer.py): bf16 parameters, fp32 ``main_grad`` buffers (every
parameter, ZeRO-1 does not shard them), AdamW's two fp32 moments plus an fp32 master copy, sharded under
ZeRO-1 over the data-parallel group for dense parameters and over the edp replicas for expert parameters.
The optimizer's sharding splits every checkpoint entry (a tensor, or one expert of an expert tensor) along its
dim 0 by :func:`moe.optim_state.shard_rows` (torch.chunk's rule): its most loaded rank, rank 0, holds
``ceil(rows / size)`` rows of each, which this module counts. Pure bf16
(``master_weights=False``) keeps gradients and moments in bf16 and no master. A pure fp32 model
(``param_bytes=4``) steps the parameters themselves: no master. ``Workload.state_dtype="bfloat16"`` keeps
the moments in bf16 (the DeepSeek-V3 report, 3.3.3: moments in bf16, masters and gradients in fp32).

Activations: one module's saved bytes for one micro-batch (:func:`layer_activations`: every tensor autograd
keeps, listed per sub-stage and per attention variant, MTP modules on the last stage) weighted by the
schedule's live micro-batches of each module at every step (the action lists the executor runs; the peak
count is :func:`dualpipe.simulate.simulate`'s). The memory options the DeepSeek-V3 report fits 80 GB with
(3.2.3, 3.3.3), each a field of :class:`moe.plan.costs.Workload` and reported with the plan:

- ``recompute="full"``: a module keeps only its pieces' inputs; the backward rebuilds one piece's graph at a
  time, so one layer's full activation is added once as the working set.
- ``recompute="selective"``: every RMSNorm's saved tensors (its fp32 copies and the output a Linear saves)
  and, for MLA, SDPA's q, k and v (the up-projections' products) are dropped; what rebuilds them is kept
  instead (the norm inputs: the block input, the residual before the MLP norm, MLA's two latents, Qwen3's
  q/k projections). One layer's dropped tensors are added once as the working set.
- ``state_dtype="bfloat16"``: 2-byte moments.
- ``mtp_shared``: the MTP modules use the main embedding and head (:mod:`moe.plan.params`).
- ``fp8_activations`` (with FP8 GEMMs; the trainer's ``training.fp8_activations``, :mod:`kernels.fp8`'s
  ``save_fp8``), the report's caching (3.3.3), each tensor once for all its readers: the routed experts keep
  their up-projection input (the expert-sorted rows ``[M, D]``, the FP8 copy its GEMM made) and SwiGLU input
  ``[M, 2F]`` in FP8 with one fp32 scale per 1x128 tile along the last dim (:func:`fp8_elem_bytes`: 1 + 4/128
  bytes an element when the width is a multiple of 128) instead of the activation dtype; the MLP's normed
  input ``[T, D]`` is one FP8 copy for the router's gate and the shared experts (or the dense MLP); a SwiGLU
  MLP keeps its SwiGLU input in FP8 and recomputes its output, the down projection's input, which it no longer
  keeps; SDPA's output ``[T, H x W]`` is one E5M6 copy (:func:`kernels.e5m6.e5m6_elem_bytes`: 1.5 bytes + a
  power-of-2 fp32 scale per 1x128 tile) for SDPA's backward and the output projection. The attention's other
  linears, MTP's ``eh_proj`` and the head keep their inputs in the activation dtype. Selective recompute
  neither drops nor reruns these, so the two options compose; under full recompute the rebuilt layer caches
  in FP8 as well.

Under every option but full recompute an MoE layer keeps neither its experts' output (the routing weight is
applied inside the experts, :func:`kernels.functional.row_weights`) nor the rows an ep > 1 dispatch received
(freed once permute has copied them into expert order, :meth:`moe.models.block.Block._mlp_moe`).

Headroom: :data:`HEADROOM` of HBM is kept free for the caching allocator's fragmentation, the CUDA
context, NCCL/DeepEP buffers not listed here and kernel workspaces (cuBLAS, Triton autotuning). 10% is a
stated allowance, not a measurement: replace it with ``cuda_peak_allocated_bytes`` from a run (moe.train.memory).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from dualpipe.offload import reload_points
from dualpipe.schedule import Op, build_schedule, schedule_spec
from kernels.e5m6 import e5m6_elem_bytes
from kernels.reference_fp8 import TILE
from moe.models.config import MoEConfig
from moe.models.mla import sdpa_head_dim
from moe.optim_state import EMA_HOST_BYTES, OPTIMIZERS, shard_rows
from moe.plan.costs import Parallelism, Workload, recompute_granularity
from moe.plan.hardware import GPU
from moe.plan.offload import NAMED, OffloadPolicy, parse_offload
from moe.plan.params import ConfigKey, ParamSpec, rank_params, rank_stages
from moe.plan.routing import expected_ranks

__all__ = [
    "HEADROOM",
    "LEAVES",
    "Footprint",
    "Saved",
    "footprint",
    "fp8_elem_bytes",
    "held_elements",
    "layer_activations",
    "module_activation_bytes",
    "offload_bytes",
    "offload_names",
    "offloaded_bytes",
    "saved_tensors",
    "state_bytes",
]

HEADROOM = 0.10
"""Fraction of HBM left free (see the module docstring)."""

FP32 = 4
INDEX = 8

# Tags of a saved tensor (:class:`Saved`): what each memory option does to it.
LEAF = "leaf"  # kept by the overlap runtime as a piece input, not saved by autograd
NORM = "norm"  # an RMSNorm's saved tensors: selective recompute drops them
UP = "up"  # MLA's up-projection products that SDPA saves (q, k, v): selective recompute drops them
SELECTIVE = "selective"  # kept only under selective recompute (what rebuilds the dropped tensors)

LEAVES = frozenset({"attn.input", "mlp.routing_weights"})
"""Entries of :func:`layer_activations` that no autograd op saves: piece inputs the overlap runtime keeps
for the backward (a bf16 block input, whose fp32 copy is what the norm saves; the routing weights of the
received rows, which the experts gather per row and keep in that form). moe.train.memory's tracker counts saved
tensors only."""


@dataclass(frozen=True, slots=True)
class Saved:
    """One tensor kept from a module's forward for its backward: ``elements`` of ``elem_bytes`` each."""

    name: str
    elements: float
    elem_bytes: float
    tags: frozenset[str] = frozenset()

    @property
    def nbytes(self) -> float:
        return self.elements * self.elem_bytes


def _s(name: str, elements: float, elem_bytes: float, *tags: str) -> Saved:
    return Saved(name, elements, elem_bytes, frozenset(tags))


def _norm(prefix: str, t: float, d: int, b: int, *, input_elems: float | None = None) -> list[Saved]:
    """RMSNorm (fp32 inside) over ``[t, d]``: the fp32 input (the input itself for an fp32 model, else a
    copy; ``input_elems``: the storage it is a view of), rsqrt, the fp32 normalised output and the fp32
    weight copy (bf16 models), all dropped under selective recompute (the norm keeps its input instead). Its
    cast output, which the following linears save, is listed by the caller."""
    out = [
        _s(prefix + "norm_fp32_input", t * d if input_elems is None or b < FP32 else input_elems, FP32, NORM),
        _s(prefix + "norm_rsqrt", t, FP32, NORM),
        _s(prefix + "norm_fp32_output", t * d, FP32, NORM),
    ]
    if b < FP32:
        out.append(_s(prefix + "norm_fp32_weight", d, FP32, NORM))
    return out


def fp8_elem_bytes(width: int) -> float:
    """Bytes an element of a ``[rows, width]`` tensor kept in FP8 with one fp32 scale per 1x128 tile along
    ``width`` (:func:`kernels.fp8.quantize_rows`; a partial last tile has a scale of its own)."""
    return 1 + FP32 * math.ceil(width / TILE) / width


def _attention(cfg: MoEConfig, t: int, seq_len: int, b: int, fp8: bool = False) -> list[Saved]:
    """What the attention module saves (its input, the block norm's output, is the block's); ``fp8``: SDPA's
    output in E5M6 (:func:`_sdpa_out`)."""
    h, seqs = cfg.num_heads, t // seq_len
    lse = _s("attn.sdpa_lse", seqs * h * seq_len, FP32)
    if cfg.attention == "mla":
        n, r, v, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        c = n + r
        # Selective recompute reruns the up-projection (latent norms, q_b_proj, kv_b_proj, rotary) from what it
        # keeps: the query latent (the queries themselves without one) and kv_a_proj's output [T, L + R], the
        # latent and the shared rotary key (an fp32 model's latent norm input is a view of it).
        q_in = t * h * c if cfg.q_lora_rank is None else t * cfg.q_lora_rank
        out = [_s("attn.q_latent", q_in, b, SELECTIVE)]
        if cfg.q_lora_rank is not None:
            q = cfg.q_lora_rank
            out += [*_norm("attn.q_a_", t, q, b), _s("attn.q_a_norm_output", t * q, b, NORM)]
        out += [
            *_norm("attn.kv_a_", t, lat, b, input_elems=t * (lat + r)),
            _s("attn.kv_a_norm_output", t * lat, b, NORM),
            _s("attn.kv_latent", t * (lat + r), b, SELECTIVE),
        ]
        # SDPA runs at one head dim W for q, k, v and its output (moe.models.mla pads the narrower side with zeros)
        w = sdpa_head_dim(c, v)
        # v padded to W is a copy; unpadded (V == W) it is a view of kv_b_proj's output, which it keeps whole
        v_kept = t * h * (w if v < w else n + v)
        return [
            *out,
            _s("attn.rotary_tables", 2 * seq_len * (r // 2), FP32),
            _s("attn.sdpa_q", t * h * w, b, UP),
            _s("attn.sdpa_k", t * h * w, b, UP),
            _s("attn.sdpa_v", v_kept, b, UP),
            _sdpa_out(t, h * w, b, fp8),  # o_proj's input is a view of it, sliced back to V
            lse,
        ]
    c, g = cfg.attn_head_dim, cfg.num_kv_heads
    out = []
    if cfg.attention == "gqa-qk-norm":  # per-head RMSNorm on q and k; rotary saves none of its output
        out += [
            _s("attn.qk_norm_fp32_input", t * (h + g) * c, FP32, NORM),
            _s("attn.qk_norm_rsqrt", t * (h + g), FP32, NORM),
            _s("attn.qk_norm_fp32_output", t * (h + g) * c, FP32, NORM),
            _s("attn.qk_norm_input", t * (h + g) * c, b, SELECTIVE),
        ]
        if b < FP32:
            out.append(_s("attn.qk_norm_fp32_weight", 2 * c, FP32, NORM))
    return [
        *out,
        _s("attn.rotary_tables", 2 * seq_len * (c // 2), FP32),
        _s("attn.sdpa_qkv", t * (h + 2 * g) * c, b),
        _sdpa_out(t, h * c, b, fp8),
        lse,
    ]


def saved_tensors(
    cfg: MoEConfig,
    layer: int,
    tokens: int,
    seq_len: int,
    act_bytes: int,
    ep: int = 1,
    prefix: str = "",
    *,
    fp8: bool = False,
) -> list[Saved]:
    """Every tensor one micro-batch of ``tokens`` leaves for backward in block ``layer``, tagged with what
    each recompute granularity does to it (entries tagged ``selective`` exist only under selective
    recompute); ``fp8``: FP8 caching (the module docstring).

    Follows the modules (moe/models/: layers.py, mla.py, block.py, router.py; kernels/functional.py): each
    RMSNorm saves what :func:`_norm` lists; rotary saves only its cos/sin tables (the multiplications by
    constants need no input); SDPA saves q, k, v (a view keeps its whole storage: MLA's unpadded v is a view of
    kv_b_proj's output), its output and the fp32 log-sum-exp (FlashAttention's set; its output is laid out
    ``[B, S, H, Cv]``, so the output projection's input is a view of it, not a copy); MLA hands SDPA q, k and v
    at one head dim ``W = max(C, V)`` (:func:`moe.models.mla.sdpa_head_dim`): the padded ones are copies, the
    output is ``W`` wide and the output projection saves its slice back to ``V``, a view; MLA's latent norms
    save as a block norm does; the router saves fp32 sigmoid scores, the int64 top-k ids and the chosen
    scores; the grouped experts save the sorted rows, the gate/up output and one fp32 routing weight per
    row (applied to the SwiGLU output: no expert output is kept), permute and the combine the int64 row
    ids; the received rows' routing weights stay as a piece input; the received rows themselves are freed
    once permuted; a SwiGLU MLP saves its input, the gate/up output and the down projection's input. The
    linears save their inputs; the router's gate saves an MoE layer's normed input (the shared experts read
    it too). ``fp8``: FP8 caching (the module docstring): the entries ending in ``_fp8`` (the
    experts' two tensors, the normed MLP input, the SwiGLU MLPs' SwiGLU input, :func:`fp8_elem_bytes`) and
    ``attn.sdpa_out_e5m6``, no down-projection inputs.
    Received rows per rank are ``T x`` :func:`moe.plan.routing.expected_ranks`; at ep = 1 they are the
    normed tokens themselves (no copy). Names ``"attn.<tensor>"`` /
    ``"mlp.<tensor>"`` after ``prefix``; :data:`LEAVES` marks the ones kept by the runtime.
    """
    t, d, b, k = tokens, cfg.hidden_size, act_bytes, cfg.top_k
    # An fp32 model's block norm saves the block input itself: the input is listed apart only in bf16, or
    # under selective recompute, which keeps it in place of the norm's tensors.
    out = [_s("attn.input", t * d, b, LEAF, *(() if b < FP32 else (SELECTIVE,)))]
    # selective recompute frees the attention norm's output once its readers have run (moe.models.layers.release)
    out += [*_norm("attn.", t, d, b), _s("attn.norm_output", t * d, b, NORM)]
    out += _attention(cfg, t, seq_len, b, fp8)
    out += [*_norm("attn.mlp_", t, d, b), _s("attn.mlp_norm_input", t * d, b, SELECTIVE)]
    if fp8:  # one FP8 copy, saved by the router's gate and the shared experts (or the dense MLP)
        out.append(_s("attn.mlp_norm_output_fp8", t * d, fp8_elem_bytes(d)))
    else:
        out.append(_s("attn.mlp_norm_output", t * d, b))
    if not cfg.is_moe_layer(layer):
        out += _swiglu_mlp_kept("mlp.", t, cfg.dense_intermediate_size, b, fp8)
    else:
        e, f = cfg.num_experts, cfg.moe_intermediate_size
        rows = t * expected_ranks(cfg, ep) if ep > 1 else 0.0
        m = t * k
        out += [
            _s("attn.router_scores_fp32", t * e, FP32),
            _s("attn.router_topk", t * k * (INDEX + FP32) + FP32 * t, 1),  # ids, chosen scores, their sum
            _s("mlp.routing_weights", (rows if ep > 1 else t) * k, FP32, LEAF),
            _s("mlp.row_ids", m, INDEX),
            _s("mlp.row_weights", m, FP32),
            *_experts_kept(m, d, f, b, fp8),
        ]
        if cfg.num_shared_experts:
            out += _swiglu_mlp_kept("mlp.shared_", t, cfg.num_shared_experts * f, b, fp8)
    return [Saved(prefix + s.name, s.elements, s.elem_bytes, s.tags) for s in out]


def _sdpa_out(t: int, width: int, b: int, fp8: bool) -> Saved:
    """SDPA's output ``[T, H x W]``, read by SDPA's backward and the output projection's weight gradient: in the
    activation dtype, or with ``fp8`` caching one E5M6 copy for both (:func:`moe.models.layers.project_attention`,
    :func:`kernels.e5m6.e5m6_elem_bytes`)."""
    if fp8:
        return _s("attn.sdpa_out_e5m6", t * width, e5m6_elem_bytes(width))
    return _s("attn.sdpa_out", t * width, b)


def _swiglu_mlp_kept(prefix: str, t: int, f: int, b: int, fp8: bool) -> list[Saved]:
    """A SwiGLU MLP's SwiGLU input ``[T, 2F]`` and down projection's input ``[T, F]`` (its input is the block's
    normed ``z``); with ``fp8`` caching the SwiGLU input in FP8 only, the down projection's input recomputed from
    it (``moe.models.layers._KeptMLP``)."""
    if fp8:
        return [_s(prefix + "swiglu_input_fp8", t * 2 * f, fp8_elem_bytes(2 * f))]
    return [_s(prefix + "swiglu_input", t * 2 * f, b), _s(prefix + "down_input", t * f, b)]


def _experts_kept(m: float, d: int, f: int, b: int, fp8: bool) -> list[Saved]:
    """The routed experts' up-projection input ``[M, D]`` and SwiGLU input ``[M, 2F]`` (the gate/up output):
    in the activation dtype, or with ``fp8`` caching in FP8 with their 1x128 scales (as
    ``kernels.functional._GroupedExperts`` saves them under ``save_fp8``)."""
    if not fp8:
        return [_s("mlp.experts_input", m * d, b), _s("mlp.experts_gate_up_output", m * 2 * f, b)]
    return [
        _s("mlp.experts_input_fp8", m * d, fp8_elem_bytes(d)),
        _s("mlp.experts_gate_up_output_fp8", m * 2 * f, fp8_elem_bytes(2 * f)),
    ]


def _with_options(saved: Sequence[Saved], recompute: str) -> list[Saved]:
    """``saved`` as kept under ``recompute`` (none or selective)."""
    out = []
    for s in saved:
        if recompute == "selective" and s.tags & {NORM, UP}:
            continue
        if recompute != "selective" and SELECTIVE in s.tags:
            continue
        out.append(s)
    return out


def layer_activations(
    cfg: MoEConfig,
    layer: int,
    tokens: int,
    seq_len: int,
    act_bytes: int,
    ep: int = 1,
    *,
    recompute: str | bool = "none",
    fp8: bool = False,
) -> dict[str, float]:
    """Bytes one micro-batch of ``tokens`` leaves for backward in block ``layer``, by tensor
    (:func:`saved_tensors`), under ``recompute`` ``"none"`` or ``"selective"`` and ``fp8`` caching."""
    granularity = recompute_granularity(recompute)
    if granularity == "full":
        raise ValueError("layer_activations lists what autograd saves: full recompute keeps piece inputs only")
    saved = _with_options(saved_tensors(cfg, layer, tokens, seq_len, act_bytes, ep, fp8=fp8), granularity)
    return {s.name: s.nbytes for s in saved}


def _kept_with_recompute(cfg: MoEConfig, layer: int, tokens: int, act_bytes: int, ep: int) -> float:
    """What a recomputed layer keeps per micro-batch: the attention input ``h``, the MLP inputs (``z``; MoE:
    the received rows and weights) and the routing decision replayed by the recompute (int64 ids)."""
    t, d, b = tokens, cfg.hidden_size, act_bytes
    kept = 2 * b * t * d
    if cfg.is_moe_layer(layer):
        rows = t * (expected_ranks(cfg, ep) if ep > 1 else 1.0)
        kept += b * rows * d + FP32 * rows * cfg.top_k + INDEX * t * cfg.top_k
    return kept


def _head(prefix: str, t: int, cfg: MoEConfig, b: int) -> list[Saved]:
    """Final norm (its input kept under selective recompute), the head's input (the head stays out of FP8),
    the logits and the loss's fp32 log-sum-exp, int64 targets and mask (moe/models/loss.py)."""
    return [
        *_norm(prefix, t, cfg.hidden_size, b),
        _s(prefix + "norm_output", t * cfg.hidden_size, b),
        _s(prefix + "norm_input", t * cfg.hidden_size, b, SELECTIVE),
        _s(prefix + "logits", t * cfg.vocab_size, b),
        _s(prefix + "loss", t, FP32 + INDEX + 1),
    ]


def _mtp_extras(cfg: MoEConfig, k: int, t: int, b: int) -> list[Saved]:
    """MTP module ``k`` around its block (:mod:`moe.models.mtp`): the shifted ids the shared embedding saves,
    the main final norm again (depth 0: the head's normed input feeds ``hnorm``), ``enorm`` and ``hnorm``
    (their outputs are concatenated, not saved), ``eh_proj``'s input ``[T, 2D]`` (in the activation dtype under
    FP8 caching too), then ``head_norm``, the shared head and the loss. Under selective recompute the norms
    keep their inputs (the embedding rows, depth 0's normed hidden state, the block's output)."""
    d, p = cfg.hidden_size, f"mtp{k}."
    out = [_s(p + "embed_ids", t, INDEX)]
    if k == 0:
        out += [*_norm(p + "main_", t, d, b), _s(p + "hnorm_input", t * d, b, SELECTIVE)]
    out += [
        *_norm(p + "enorm_", t, d, b),
        _s(p + "enorm_input", t * d, b, SELECTIVE),
        *_norm(p + "hnorm_", t, d, b),
        _s(p + "eh_proj_input", t * 2 * d, b),
        *_head(p + "head_", t, cfg, b),
    ]
    return out


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
    recompute: str | bool,
    fp8: bool = False,
    mtp: int | None = None,
) -> float:
    """Bytes one module (a stage's layers; its ``mtp`` MTP modules, ``None``: all of them on the last stage)
    keeps for one micro-batch between its forward and backward. The embedding (int64 ids) and the head pieces
    never recompute whole. Cached by value: a search sizes the same module for many candidates."""
    granularity = recompute_granularity(recompute)
    key = (layers, tokens, seq_len, act_bytes, ep, first, last, granularity, fp8, mtp)
    return _module_activation_bytes(ConfigKey.of(cfg), *key)


@functools.lru_cache(maxsize=4096)
def _module_activation_bytes(
    key: ConfigKey,
    layers: range,
    tokens: int,
    seq_len: int,
    act_bytes: int,
    ep: int,
    first: bool,
    last: bool,
    granularity: str,
    fp8: bool,
    mtp: int | None,
) -> float:
    cfg = key.cfg
    t, b = tokens, act_bytes
    mtp = cfg.mtp_layers * last if mtp is None else mtp
    blocks = list(layers) + list(range(cfg.num_layers, cfg.num_layers + mtp))
    if granularity == "full":
        body = sum(_kept_with_recompute(cfg, i, t, b, ep) for i in blocks)
        granularity = "none"  # for the stage extras
    else:
        body = sum(_layer_bytes(key, i, t, seq_len, b, ep, granularity, fp8) for i in blocks)
    extras = [_s("embed.ids", t, INDEX)] if first else []
    if last:
        extras += _head("head.", t, cfg, b)
    for k in range(mtp):
        extras += _mtp_extras(cfg, k, t, b)
    return body + sum(s.nbytes for s in _with_options(extras, granularity))


def _working_set(cfg: MoEConfig, layers: Sequence[int], work: Workload, ep: int) -> float:
    """What the backward of one recomputed layer rebuilds at a time (the largest of the rank's layers)."""
    t, s, b, fp8 = work.tokens, work.seq_len, work.act_bytes, work.fp8_activations
    if work.recompute == "none":
        return 0.0

    key = ConfigKey.of(cfg)

    def rebuilt(i: int) -> float:
        full = _layer_bytes(key, i, t, s, b, ep, "none", fp8)
        if work.recompute == "full":
            return full
        return full - _layer_bytes(key, i, t, s, b, ep, "selective", fp8)

    return max((rebuilt(i) for i in layers), default=0.0)


@functools.lru_cache(maxsize=8192)
def _layer_bytes(
    key: ConfigKey, layer: int, tokens: int, seq_len: int, act_bytes: int, ep: int, recompute: str, fp8: bool
) -> float:
    """The bytes :func:`layer_activations` lists, summed (cached by value: a search asks once per rank)."""
    acts = layer_activations(key.cfg, layer, tokens, seq_len, act_bytes, ep, recompute=recompute, fp8=fp8)
    return sum(acts.values())


def state_bytes(
    specs: list[ParamSpec],
    *,
    param_bytes: int,
    master_weights: bool,
    dp: int,
    edp: int,
    zero: bool,
    optimizer: str = "adamw",
    state_dtype: str = "float32",
) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of one rank holding ``specs``.

    Optimizer state: the optimizer's state tensors of the parameter's size (AdamW's two moments, SGD's one
    momentum: :attr:`moe.optim_state.OptimizerSpec.moments`), in fp32 (the parameter's dtype without masters)
    or bf16 (``state_dtype``), plus an fp32 master where the parameters are lower precision and
    ``master_weights``; with ``zero`` the worst rank of moe.train.optimizer's split (dense over ``dp``, experts over
    ``edp``): rank 0, which holds the largest chunk of every entry. The 0-d step counters are left out, as
    ``DistributedOptimizer.state_bytes`` leaves them."""
    moments = OPTIMIZERS.lookup(optimizer).moments
    mixed = master_weights and param_bytes < FP32
    grad_elem = FP32 if mixed else param_bytes
    moment_elem = 2 if state_dtype == "bfloat16" else (FP32 if master_weights else param_bytes)
    state_elem = moments * moment_elem + (FP32 if mixed else 0)
    params = sum(p.numel for p in specs) * param_bytes
    grads = sum(p.numel for p in specs) * grad_elem
    return params, grads, held_elements(specs, dp=dp, edp=edp, zero=zero) * state_elem


def held_elements(specs: list[ParamSpec], *, dp: int, edp: int, zero: bool) -> int:
    """Elements of ``specs`` whose optimizer state the worst rank holds (and its moving average of the weights):
    all of them without ``zero``, with it rank 0's rows of every entry (dense over ``dp``, experts over ``edp``)."""
    held = 0
    for p in specs:
        size = (edp if p.expert else dp) if zero else 1
        start, stop = shard_rows(p.entry_rows, size, 0)
        held += (stop - start) * (p.numel // p.entry_rows)  # rank 0's rows of every entry of the tensor
    return held


@dataclass(frozen=True, slots=True)
class Footprint:
    """Bytes per GPU on the most loaded pipeline rank."""

    pp_rank: int
    params: float
    grads: float
    optimizer: float
    activations: float
    """The live modules' bytes at the schedule's worst step (+ the recompute working set)."""
    peak_modules: int
    """The schedule's peak live activations on this rank, in modules (dualpipe.simulate)."""
    all_to_all_buffers: float
    """Send and receive buffers of one dispatch (and its combine) in flight, per micro-batch kept alive by
    the overlap: two micro-batches' worth (the overlapped pair)."""
    options: dict[str, object] = field(default_factory=dict, compare=False)
    """The memory options it was sized with (:meth:`moe.plan.costs.Workload.memory_options`)."""
    host: float = 0.0
    """Host (CPU) memory of this rank, not in :attr:`total`: the moving average of the weights (``Workload.ema``),
    :data:`moe.optim_state.EMA_HOST_BYTES` per element of the optimizer state's rows it holds."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.all_to_all_buffers

    def fits(self, gpu: GPU, headroom: float = HEADROOM) -> bool:
        """``total <= (1 - headroom) x HBM``."""
        return self.total <= (1 - headroom) * gpu.hbm_bytes


def _planner_names(cfg: MoEConfig, fp8: bool) -> set[str]:
    names = {"embed.ids", "head.norm_output", *(f"head.norm_{t}" for t in ("fp32_input", "rsqrt", "fp32_output"))}
    names.add("head.norm_fp32_weight")
    for layer in range(cfg.num_layers):
        names.update(s.name for s in saved_tensors(cfg, layer, 1, 1, 2, 2, fp8=fp8))
    return names - LEAVES


def offload_names(cfg: MoEConfig, fp8: bool = False) -> list[str]:
    """The names a policy may use for this model: the planner's names of its saved tensors that the trainer
    recognises at run time (:data:`NAMED`), sorted."""
    names = NAMED & _planner_names(cfg, fp8)
    if cfg.attention != "gqa":  # only the plain GQA attention's own saves are named (MLA's, Qwen3's are not)
        names -= {"attn.rotary_tables", "attn.sdpa_qkv", "attn.sdpa_lse"}
    return sorted(names)


def offload_bytes(
    policy: OffloadPolicy,
    rank: int,
    cfg: MoEConfig,
    layers: Sequence[int],
    tokens: int,
    seq_len: int,
    act_bytes: int,
    ep: int = 1,
    *,
    recompute: str = "none",
    fp8: bool = False,
) -> float:
    """Bytes ``policy`` moves to the host for one micro-batch of ``tokens`` through a stage holding blocks
    ``layers`` at pipeline rank ``rank`` (the planner's per-tensor figures,
    :func:`moe.plan.footprint.layer_activations`; the piece inputs the runtime keeps,
    :data:`moe.plan.footprint.LEAVES`, never move). ``all`` also counts what the trainer cannot name (MLA's SDPA
    inputs, for one), as the trainer does. The embedding and head are left out; under full recompute a block
    keeps only its piece inputs, so nothing moves."""
    if recompute_granularity(recompute) == "full":
        return 0.0
    total = 0.0
    for i, layer in enumerate(layers):
        table = layer_activations(cfg, layer, tokens, seq_len, act_bytes, ep, recompute=recompute, fp8=fp8)
        for name, nbytes in table.items():
            if name not in LEAVES and policy.picks(rank, name if name in NAMED else None, i, len(layers)):
                total += nbytes
    return total


def offloaded_bytes(cfg: MoEConfig, par: Parallelism, work: Workload, rank: int, stages: Sequence) -> list[float]:
    """Per local module of pipeline rank ``rank`` (its ``stages``), the bytes ``par.offload`` moves to the host
    for one micro-batch (:func:`offload_bytes`: the blocks' saved tensors; the embedding's, the
    head's and the MTP modules' stay, an undercount where the runtime's ``all`` moves them too)."""
    layers = tuple(tuple(sp.layers) for sp in stages)
    shape = (work.tokens, work.seq_len, work.act_bytes, work.recompute, work.fp8_activations)
    return list(_offloaded_bytes(ConfigKey.of(cfg), par.offload, par.pp, par.ep, rank, layers, *shape))


@functools.lru_cache(maxsize=4096)
def _offloaded_bytes(
    key: ConfigKey,
    offload: str,
    pp: int,
    ep: int,
    rank: int,
    layers: tuple[tuple[int, ...], ...],
    tokens: int,
    seq_len: int,
    act_bytes: int,
    recompute: str,
    fp8: bool,
) -> tuple[float, ...]:
    """:func:`offloaded_bytes` by value, once per shape (sizing and timing both ask, candidate after candidate)."""
    policy = parse_offload(offload, pp)
    return tuple(
        offload_bytes(policy, rank, key.cfg, held, tokens, seq_len, act_bytes, ep, recompute=recompute, fp8=fp8)
        for held in layers
    )


@functools.lru_cache(maxsize=256)
def _offload_counts(
    schedule: str, pp: int, chunks: int, modules_per_rank: int | None, extra_warmup: int = 0
) -> tuple[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], ...]:
    """Per rank, every distinct (micro-batches whose saved tensors are on the device, micro-batches whose
    offloadable ones are on the host), per local module, after each compute action: a forward's tensors in, a
    backward's out (an ``FB`` both), as :func:`dualpipe.simulate.simulate` counts, while an offloader would move
    them (:func:`dualpipe.offload.reload_points`): a backward's come back at the compute action before it, a
    forward's leave once it ends (not those ``reload_points`` keeps, whose backward is one of the next two
    compute actions: the count after it still holds them). Both together are the live micro-batches, what a run
    without offloading holds. Cached: a search asks for the same schedule shape once per candidate."""
    built = build_schedule(schedule, pp, chunks, modules_per_rank=modules_per_rank, extra_warmup=extra_warmup)
    out = []
    for actions in built.ranks:
        reloads, kept = reload_points(actions)
        on_device: set[tuple[int, int]] = set()
        away: set[tuple[int, int]] = set()
        seen = set()
        for i, a in enumerate(actions):
            if not a.op.is_compute:
                continue
            for key in reloads.get(i, ()):
                away.discard(key)
                on_device.add(key)
            made = (a.module, a.chunk) if a.op in (Op.F, Op.FB) else None
            done = (a.module, a.chunk) if a.op in (Op.B, Op.I) else (a.b_module, a.b_chunk) if a.op is Op.FB else None
            on_device.update([made] if made is not None else [])
            on_device.discard(done)
            counts = [0] * built.layout.modules_per_rank, [0] * built.layout.modules_per_rank
            for which, keys in zip(counts, (on_device, away), strict=True):
                for module, _ in keys:
                    which[module] += 1
            seen.add((tuple(counts[0]), tuple(counts[1])))
            if made is not None and made not in kept:
                on_device.discard(made)
                away.add(made)
        out.append(tuple(sorted(seen)))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _rank_state(
    key: ConfigKey,
    pp: int,
    dp: int,
    ep: int,
    schedule: str,
    pp_rank: int,
    modules_per_rank: int | None,
    pipeline_layout: str,
    mtp_shared: bool,
    param_bytes: int,
    master_weights: bool,
    zero: bool,
    optimizer: str,
    state_dtype: str,
) -> tuple[int, int, int, int]:
    """:func:`state_bytes` of the parameters pipeline rank ``pp_rank`` holds, and the elements it holds optimizer
    state for (cached by value: candidates that differ in recompute, micro-batches or warm-up hold the same)."""
    specs = rank_params(
        key.cfg, pp, ep, schedule, pp_rank, modules_per_rank, mtp_shared=mtp_shared, pipeline_layout=pipeline_layout
    )
    edp = dp // ep
    kw = dict(param_bytes=param_bytes, master_weights=master_weights, optimizer=optimizer, state_dtype=state_dtype)
    p, g, o = state_bytes(specs, dp=dp, edp=edp, zero=zero, **kw)
    return p, g, o, held_elements(specs, dp=dp, edp=edp, zero=zero)


def footprint(
    cfg: MoEConfig,
    par: Parallelism,
    work: Workload,
    *,
    num_chunks: int | None = None,
    zero: bool = True,
    param_bytes: int = 2,
    optimizer: str = "adamw",
    pp_rank: int | None = None,
) -> Footprint:
    """Memory of every pipeline rank of ``par`` running ``work``; the largest is returned (``pp_rank``: that
    rank's instead).

    ``num_chunks``: micro-batches per step (default: the schedule's default for ``pp``; the peak stops
    growing once it reaches the pipeline depth). ``param_bytes``: 2 for bf16 parameters (issue 12's
    default), 4 for an fp32 model. ``optimizer``: a name of :data:`moe.optim_state.OPTIMIZERS`. The memory
    options (recompute granularity, optimizer-state dtype, MTP sharing, FP8 caching) are ``work``'s."""
    spec = schedule_spec(par.schedule)
    chunks = num_chunks if num_chunks is not None else spec.default_chunks(par.pp)
    counts = _offload_counts(par.schedule, par.pp, chunks, par.modules_per_rank, par.extra_warmup)
    t, b = work.tokens, work.act_bytes
    if pp_rank is not None and not 0 <= pp_rank < par.pp:
        raise ValueError(f"footprint: pp_rank={pp_rank} is not a rank of pp={par.pp}")
    lay = par.pipeline_layout
    worst: Footprint | None = None
    for r in range(par.pp) if pp_rank is None else (pp_rank,):
        stages = [sp for _, sp in rank_stages(cfg, par.pp, par.schedule, r, par.modules_per_rank, pipeline_layout=lay)]
        modules = [
            module_activation_bytes(
                cfg, sp.layers, t, work.seq_len, b, par.ep, first=sp.first, last=sp.last, recompute=work.recompute,
                fp8=work.fp8_activations, mtp=sp.mtp,
            )
            for sp in stages
        ]  # fmt: skip
        moved = offloaded_bytes(cfg, par, work, r, stages) if par.offload else [0.0] * len(stages)
        acts = max(
            sum(n * m + k * (m - x) for n, k, m, x in zip(full, away, modules, moved, strict=True))
            for full, away in counts[r]
        )
        layers = [i for sp in stages for i in [*sp.layers, *range(cfg.num_layers, cfg.num_layers + sp.mtp)]]
        acts += _working_set(cfg, layers, work, par.ep)
        moe_layers = any(cfg.is_moe_layer(i) for i in layers)
        rows = t * expected_ranks(cfg, par.ep) if par.ep > 1 and moe_layers else 0.0
        # send + receive rows, two micro-batches in flight; in the activation dtype, which the combine's rows
        # keep (an FP8 dispatch's are smaller and use the same buffers)
        a2a = 2 * 2 * rows * cfg.hidden_size * b
        shape = (par.pp, par.dp, par.ep, par.schedule, r, par.modules_per_rank, lay, work.mtp_shared)
        p, g, o, held = _rank_state(
            ConfigKey.of(cfg), *shape, param_bytes, work.master_weights, zero, optimizer, work.state_dtype
        )
        peak = max(sum(full) + sum(away) for full, away in counts[r])
        # the moving average lives on the host: no GPU bytes
        host = EMA_HOST_BYTES * held if work.ema else 0.0
        fp = Footprint(r, p, g, o, acts, peak, a2a, work.memory_options(), host)
        if worst is None or fp.total > worst.total:
            worst = fp
    assert worst is not None
    return worst
