"""FLOPs and HBM bytes of every operation of one layer (and embedding, head) for one micro-batch.

Legend: T tokens of the micro-batch (micro-batch sequences x S), S sequence length, D hidden, H query heads,
G key/value heads, C query/key head dim, Cv value head dim (C but for MLA), E experts, K top-k, F expert
intermediate, Fs shared width (shared experts x F), Fd dense intermediate, V vocabulary, R rows a rank's
experts receive, M expert-sorted rows (T x K on average per rank), b bytes per activation element; MLA: Q
query latent, L key/value latent, N and P the per-head dims without and with position (C = N + P).

Conventions
-----------
- A GEMM ``[M, K] x [K, N]`` costs ``2 M K N`` FLOPs forward; backward splits into dX (``2 M K N``) and dW
  (``2 M K N``): the usual "backward = 2 x forward" of the 6 N T rule.
- SDPA with causal masking: the causal half is counted, ``2 x 2 (B H S^2 C) / 2`` forward (QK^T and PV over
  the lower triangle): FlashAttention kernels skip the fully masked tiles, so that is what runs. Backward
  is 2.5 x forward (FlashAttention-2, section 3.2: five S^2 matmuls against two, the scores recomputed),
  all of it dX (no weights). Model FLOPs (:func:`model_flops_per_token`) use the usual 2 x instead: the
  recomputed scores are executed work, not model work.
- Bytes are what an op reads and writes in HBM at least once (no cache reuse between ops): the memory
  floor of memory-bound ops. GEMMs count operands, weights and result; a weight gradient is accumulated
  into an fp32 ``main_grad`` (read and written, 8 bytes an element), as moe.train.optimizer does.
- FP8 GEMMs (``fp8=True``; the trainer's ``training.fp8``, DeepSeek-V3's recipe as :mod:`kernels.fp8` runs
  it): every linear but the output head and the router's gate (``moe.models.layers.use_fp8``: attention's
  projections, the dense and shared MLPs, the routed experts, MTP's ``eh_proj``) multiplies E4M3 operands,
  activations and gradients in 1x128 tiles and weights in 128x128 blocks with one fp32 scale each
  (:data:`FP8_BYTES`, :data:`FP8_WEIGHT_BYTES`), at the device's FP8 peak (:attr:`Op.fp8`). Its bytes add the
  quantization, a pass of its own for each operand as :mod:`kernels.fp8` runs it: read in the activation
  dtype, write FP8 and scales, then the GEMM reads those (the weight is quantized from its bf16 copy on every
  call; the weight gradient quantizes ``dy`` and ``x`` again in 128x1 tiles). Outputs keep the activation
  dtype. SDPA, the norms, the router and the head stay in the activation dtype.
- Attention follows ``MoEConfig.attention``: ``gqa`` (one fused QKV GEMM), ``gqa-qk-norm`` (Qwen3: the same
  plus an RMSNorm over each head's q and k) and ``mla`` (DeepSeek-V3: the down-projections to the latents,
  their norms, the up-projections per head, a rotary key shared by every head, SDPA with C = N + P and a
  value head dim of its own). MLA runs SDPA at one head dim ``max(C, Cv)`` (:mod:`moe.models.mla` pads the
  narrower side with zeros so that a fused kernel runs): the padded columns are executed work, counted in the
  ``sdpa`` op (for DeepSeek-V3, PV at 192 instead of 128); :func:`model_flops_per_token` counts ``C + Cv``.
- :attr:`Op.selective` marks what selective recompute (``Workload.recompute == "selective"``, the DeepSeek-V3
  report 3.2.3) runs again in backward: every RMSNorm, and MLA's up-projections with the rotary and the
  concatenation that build SDPA's q, k and v.
- The router sits in the attention sub-stage: :meth:`moe.models.block.Block.attn_compute` runs it (its routing
  must exist before the dispatch starts); permute, experts, unpermute and the shared experts are the MLP
  sub-stage (:meth:`moe.models.block.Block.mlp_compute`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.reference_fp8 import TILE
from moe.models.config import MoEConfig
from moe.models.mla import sdpa_head_dim
from moe.plan.efficiency import SMALL_M
from moe.plan.params import active_params

__all__ = [
    "FP8_BYTES",
    "FP8_WEIGHT_BYTES",
    "SHARED_PREFIX",
    "Op",
    "attention_dims",
    "attention_ops",
    "dense_mlp_ops",
    "efficiency_key",
    "embed_ops",
    "head_ops",
    "model_flops_per_token",
    "moe_mlp_ops",
    "mtp_ops",
    "router_ops",
    "shape_class",
    "total",
]

FP32 = 4
INDEX = 8  # int64 indices (topk ids, row ids)
FP8_BYTES = 1 + FP32 / TILE
"""An E4M3 activation or gradient element with its share of one fp32 scale per 1x128 tile (DeepSeek-V3 report
3.3.2; :mod:`kernels.reference_fp8`): what an FP8 dispatch moves and an FP8-cached expert input keeps."""
FP8_WEIGHT_BYTES = 1 + FP32 / TILE**2
"""An E4M3 weight element with its share of one fp32 scale per 128x128 block."""


@dataclass(frozen=True, slots=True)
class Op:
    """One operation's work: FLOPs and HBM bytes forward, input-gradient (dX) and weight-gradient (dW)."""

    name: str
    fwd_flops: float = 0.0
    dx_flops: float = 0.0
    dw_flops: float = 0.0
    fwd_bytes: float = 0.0
    dx_bytes: float = 0.0
    dw_bytes: float = 0.0
    experts: bool = False
    """Runs on the SMs communication leaves (the grouped expert GEMMs)."""
    selective: bool = False
    """Run again in backward under selective recompute (norms, MLA up-projections)."""
    fp8: bool = False
    """An FP8 GEMM (see the module docstring): its FLOPs run at the device's FP8 peak."""
    rows: float = 0.0
    """A GEMM's rows (M) per GEMM, per expert for a grouped one (:func:`shape_class`); 0: not a GEMM."""
    attention: bool = False
    """The fused attention core (its FLOPs at the device's attention efficiency, not a GEMM's)."""


def efficiency_key(op: Op, phase: str) -> str | None:
    """The efficiency-table entry (:mod:`moe.plan.efficiency`) that times ``op``'s FLOPs in ``phase``; None
    for an op without FLOPs there."""
    if not getattr(op, f"{phase}_flops"):
        return None
    if op.attention:
        return "attention.fwd" if phase == "fwd" else "attention.bwd"
    return f"gemm.{'fp8' if op.fp8 else 'bf16'}.{shape_class(op)}"


def shape_class(op: Op) -> str:
    """``small_m`` for a GEMM of at most :data:`moe.plan.efficiency.SMALL_M` rows (per group), else ``grouped``
    for the experts' grouped GEMMs and ``dense`` for the rest."""
    if op.rows <= SMALL_M:
        return "small_m"
    return "grouped" if op.experts else "dense"


def total(ops: list[Op], field: str) -> float:
    """Sum of ``field`` (``"fwd_flops"``, ``"dx_bytes"``, ...) over ``ops``."""
    return float(sum(getattr(op, field) for op in ops))


def _gemm(
    name: str,
    m: float,
    k: int,
    n: int,
    b: int,
    *,
    weights: float | None = None,
    experts: bool = False,
    selective: bool = False,
    fp8: bool = False,
) -> Op:
    """``[m, k] x [k, n]`` (``weights`` elements of weight, default ``k n``: a grouped GEMM has more); ``fp8``:
    an FP8 GEMM, its operands quantized first (the module docstring)."""
    w = k * n if weights is None else weights
    flops = 2.0 * m * k * n
    if not fp8:
        fwd, dx = b * (m * k + w + m * n), b * (m * n + w + m * k)
        dw = b * (m * n + m * k)
    else:
        a8, w8 = FP8_BYTES, FP8_WEIGHT_BYTES
        weight = (b + 2 * w8) * w  # the bf16 weight read, its FP8 copy written and read by the GEMM
        fwd = (b + 2 * a8) * m * k + weight + b * m * n  # x quantized in 1x128 tiles; y written
        dx = (b + 2 * a8) * m * n + weight + b * m * k  # dy quantized in 1x128 tiles; dx written
        dw = (b + 2 * a8) * (m * n + m * k)  # dy and x quantized again in 128x1 tiles
    return Op(
        name,
        fwd_flops=flops,
        dx_flops=flops,
        dw_flops=flops,
        fwd_bytes=fwd,
        dx_bytes=dx,
        dw_bytes=dw + 2 * FP32 * w,
        experts=experts,
        selective=selective,
        fp8=fp8,
        rows=m * k * n / w if experts else m,  # a grouped GEMM holds w / (k n) experts' weights
    )


def _elementwise(name: str, read: float, write: float, *, selective: bool = False) -> Op:
    """A memory-bound op: backward reads what forward read plus the output gradient, writes the input grads."""
    return Op(name, fwd_bytes=read + write, dx_bytes=read + write + write, selective=selective)


def _norm(name: str, elements: float, b: int) -> Op:
    """An RMSNorm over ``elements`` values (recomputed under selective recompute)."""
    return _elementwise(name, b * elements, b * elements, selective=True)


def _sdpa(seqs: int, seq_len: int, h: int, g: int, c: int, cv: int, b: int) -> Op:
    """Causal SDPA: QK^T over the lower triangle (``seqs H S^2 C``) and PV (``seqs H S^2 Cv``) forward,
    2.5 x that backward; reads q, k, v and writes the output and the fp32 log-sum-exp; backward reads q, k,
    v, the output, its gradient and the log-sum-exp and writes dq, dk, dv."""
    t = seqs * seq_len
    fwd = 1.0 * seqs * h * seq_len * seq_len * (c + cv)  # causal half of 2 S^2 (C + Cv) per head
    lse = FP32 * seqs * h * seq_len
    return Op(
        "sdpa",
        attention=True,
        fwd_flops=fwd,
        dx_flops=2.5 * fwd,
        fwd_bytes=b * t * (h * c + g * c + g * cv + h * cv) + lse,
        dx_bytes=b * t * (h * c + g * c + g * cv + 2 * h * cv + h * c + g * c + g * cv) + lse,
    )


def _swiglu(name: str, rows: float, width: int, b: int) -> Op:
    # forward reads [rows, 2 width], writes [rows, width]; backward reads both and writes [rows, 2 width].
    return Op(name, fwd_bytes=b * rows * 3 * width, dx_bytes=b * rows * 5 * width)


def attention_ops(cfg: MoEConfig, tokens: int, seq_len: int, b: int, fp8: bool = False) -> list[Op]:
    """Attention of one layer: norm, projections, rotary, SDPA, output projection, residual and the MLP's
    norm (an MoE layer's attention sub-stage adds :func:`router_ops`); ``fp8``: the projections in FP8."""
    if tokens % seq_len:
        raise ValueError(f"tokens={tokens} is not a whole number of sequences of {seq_len}")
    t, d, h = tokens, cfg.hidden_size, cfg.num_heads
    seqs = t // seq_len
    ops = [_norm("attn_norm", t * d, b)]
    if cfg.attention == "mla":
        n, r, v, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        c = n + r
        if cfg.q_lora_rank is None:
            ops.append(_gemm("q_proj", t, d, h * c, b, selective=True, fp8=fp8))
        else:
            q = cfg.q_lora_rank
            ops += [_gemm("q_a_proj", t, d, q, b, fp8=fp8), _norm("q_a_norm", t * q, b)]
            ops.append(_gemm("q_b_proj", t, q, h * c, b, selective=True, fp8=fp8))
        w = sdpa_head_dim(c, v)  # SDPA's one head dim: the narrower of q/k and v padded with zeros
        pad_v = h * v if v < w else 0  # v copied into W columns
        ops += [
            _gemm("kv_a_proj", t, d, lat + r, b, fp8=fp8),
            _norm("kv_a_norm", t * lat, b),
            _gemm("kv_b_proj", t, lat, h * (n + v), b, selective=True, fp8=fp8),
            # rotary on q's and the shared key's P dims, then q and k assembled per head at W (C = N + P, zero
            # columns past C), v padded to W
            _elementwise(
                "rotary", b * t * (h * c + h * n + r + pad_v), b * t * h * (2 * w + w * bool(pad_v)), selective=True
            ),
            # the padded columns are executed work: PV and its backward at W (model FLOPs count V)
            _sdpa(seqs, seq_len, h, h, w, w, b),
        ]
        if v < w:  # o_proj's operand: the output sliced back to V, copied for its GEMM and again for its dW
            ops.append(
                Op(
                    "sdpa_out_slice",
                    fwd_bytes=2 * b * t * h * v,
                    dx_bytes=b * t * h * (v + w),
                    dw_bytes=2 * b * t * h * v,
                )
            )
        ops.append(_gemm("o_proj", t, h * v, d, b, fp8=fp8))
    else:
        c, g = cfg.attn_head_dim, cfg.num_kv_heads
        ops.append(_gemm("qkv", t, d, (h + 2 * g) * c, b, fp8=fp8))
        if cfg.attention == "gqa-qk-norm":
            ops.append(_norm("qk_norm", t * (h + g) * c, b))
        ops += [
            _elementwise("rotary", b * t * (h + g) * c, b * t * (h + g) * c),
            _sdpa(seqs, seq_len, h, g, c, c, b),
            _gemm("o_proj", t, h * c, d, b, fp8=fp8),
        ]
    ops += [_elementwise("residual", 2 * b * t * d, b * t * d), _norm("mlp_norm", t * d, b)]
    return ops


def router_ops(cfg: MoEConfig, tokens: int, b: int) -> list[Op]:
    """Gate GEMM ``[T, D] x [D, E]`` (never in FP8) and the group-limited top-k (fp32 scores, memory-bound)."""
    t, e, k = tokens, cfg.num_experts, cfg.top_k
    return [
        _gemm("router_gate", t, cfg.hidden_size, e, b),
        # sigmoid scores and the biased top-k read the [T, E] logits; write fp32 weights and int64 ids.
        Op("router_topk", fwd_bytes=FP32 * t * e * 2 + t * k * (FP32 + INDEX), dx_bytes=FP32 * t * e * 2),
    ]


SHARED_PREFIX = "shared_"
"""Names of the shared experts' ops start so: the cost model times them as a sub-stage of their own."""


def moe_mlp_ops(cfg: MoEConfig, tokens: int, rows_received: float, b: int, ep: int = 1, fp8: bool = False) -> list[Op]:
    """The MLP sub-stage of an MoE layer on one rank: permute the ``rows_received`` rows into ``T K``
    expert-sorted rows (balanced routing: each rank's experts get T K rows), the two grouped GEMMs and
    SwiGLU, unpermute, and the shared experts over the rank's own ``T`` tokens; ``fp8``: the GEMMs in FP8."""
    t, d, f, k = tokens, cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k
    r, m = rows_received, float(tokens * k)
    e_local = cfg.num_experts // ep
    ops = [
        # each received row read once and written to its sorted slots (kernels/NOTES.md: (T + M) D moved)
        Op("permute", fwd_bytes=b * (r + m) * d + INDEX * m, dx_bytes=b * (r + m) * d + INDEX * m),
        _gemm("experts_gate_up", m, d, 2 * f, b, weights=e_local * d * 2 * f, experts=True, fp8=fp8),
        _swiglu("experts_swiglu", m, f, b),
        _gemm("experts_down", m, f, d, b, weights=e_local * f * d, experts=True, fp8=fp8),
        Op(
            "unpermute",
            fwd_bytes=b * (m + r) * d + (INDEX + FP32) * m,
            dx_bytes=b * (m + r + m) * d + (INDEX + FP32) * m,
        ),
    ]
    if cfg.num_shared_experts:
        fs = cfg.num_shared_experts * f
        ops += [_gemm("shared_gate_up", t, d, 2 * fs, b, fp8=fp8), _swiglu("shared_swiglu", t, fs, b)]
        ops += [_gemm("shared_down", t, fs, d, b, fp8=fp8), _elementwise("shared_add", 2 * b * t * d, b * t * d)]
    return ops


def dense_mlp_ops(cfg: MoEConfig, tokens: int, b: int, fp8: bool = False) -> list[Op]:
    """The MLP sub-stage of a dense layer: SwiGLU of width ``dense_intermediate_size`` and the residual;
    ``fp8``: the GEMMs in FP8."""
    t, d, f = tokens, cfg.hidden_size, cfg.dense_intermediate_size
    return [
        _gemm("mlp_gate_up", t, d, 2 * f, b, fp8=fp8),
        _swiglu("mlp_swiglu", t, f, b),
        _gemm("mlp_down", t, f, d, b, fp8=fp8),
        _elementwise("residual", 2 * b * t * d, b * t * d),
    ]


def embed_ops(cfg: MoEConfig, tokens: int, b: int) -> list[Op]:
    """Embedding lookup; its backward adds rows into the fp32 gradient of the table (a dW)."""
    t, d = tokens, cfg.hidden_size
    return [Op("embed", fwd_bytes=INDEX * t + 2 * b * t * d, dw_bytes=INDEX * t + b * t * d + 2 * FP32 * t * d)]


def head_ops(cfg: MoEConfig, tokens: int, b: int) -> list[Op]:
    """Final norm, head GEMM ``[T, D] x [D, V]`` and the chunked cross-entropy (moe/models/loss.py: forward reads
    the logits once; backward reads them and writes their gradient). The head stays out of FP8."""
    t, d, v = tokens, cfg.hidden_size, cfg.vocab_size
    return [
        _norm("final_norm", t * d, b),
        _gemm("head", t, d, v, b),
        Op("cross_entropy", fwd_bytes=b * t * v + FP32 * t, dx_bytes=2 * b * t * v + FP32 * t),
    ]


def mtp_ops(cfg: MoEConfig, tokens: int, b: int, fp8: bool = False) -> list[Op]:
    """One MTP module around its block (DeepSeek-V3 report 2.2): the next token's embedding looked up in the
    shared table (its backward adds into the table's fp32 gradient), ``enorm`` and ``hnorm``, the
    concatenation, ``eh_proj`` ``[T, 2D] x [2D, D]``; then its final norm, the shared head and its own
    cross-entropy (:func:`head_ops`); ``fp8``: ``eh_proj`` in FP8. Its block is timed as a block
    (``num_layers + k``)."""
    t, d = tokens, cfg.hidden_size
    return [
        Op("mtp_embed", fwd_bytes=INDEX * t + 2 * b * t * d, dw_bytes=INDEX * t + b * t * d + 2 * FP32 * t * d),
        _norm("mtp_norms", 2 * t * d, b),
        _elementwise("mtp_concat", 2 * b * t * d, 2 * b * t * d),
        _gemm("eh_proj", t, 2 * d, d, b, fp8=fp8),
        *head_ops(cfg, tokens, b),
    ]


def attention_dims(cfg: MoEConfig) -> tuple[int, int]:
    """(query/key head dim, value head dim) of one attention head."""
    if cfg.attention == "mla":
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.attn_head_dim, cfg.attn_head_dim


def model_flops_per_token(cfg: MoEConfig, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward + backward) for MFU.

    ``6 x active parameters`` (matmul weights a token meets: top-k routed experts, shared experts, attention,
    router, head; the embedding lookup is not a matmul) plus the attention term ``3 x L x H x (C + Cv) x S``:
    QK^T and PV are ``2 H (C + Cv) S`` FLOPs per token forward over the full square, half of it under the
    causal mask, times 3 for forward and backward (``6 L H C S`` when ``Cv = C``; PaLM's appendix B counts the
    full square, ``12 L H C S``; we count what a causal kernel must do). The MTP modules are trained work of
    the step: each adds its block, ``eh_proj`` and the shared head once more (``L`` counts their blocks).
    Recomputation and FlashAttention's score recompute are executed work, not model FLOPs: they are not here.
    """
    c, cv = attention_dims(cfg)
    attn = 3.0 * (cfg.num_layers + cfg.mtp_layers) * cfg.num_heads * (c + cv) * seq_len
    return 6.0 * active_params(cfg, mtp=True) + attn
