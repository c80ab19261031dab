"""FLOPs and HBM bytes of every operation of one layer (and embedding, head) for one micro-batch.

Legend: T tokens of the micro-batch (micro-batch sequences x S), S sequence length, D hidden, H query heads,
G key/value heads, C head dim, E experts, K top-k, F expert intermediate, Fs shared width (shared experts x
F), Fd dense intermediate, V vocabulary, R rows a rank's experts receive, M expert-sorted rows (T x K on
average per rank), b bytes per activation element.

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
  into an fp32 ``main_grad`` (read and written, 8 bytes an element), as moe.optimizer does.
- The router sits in the attention sub-stage: :meth:`moe.block.Block.attn_compute` runs it (its routing
  must exist before the dispatch starts); permute, experts, unpermute and the shared experts are the MLP
  sub-stage (:meth:`moe.block.Block.mlp_compute`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe.config import MoEConfig
from moe.plan.params import active_params

__all__ = [
    "Op",
    "attention_ops",
    "dense_mlp_ops",
    "embed_ops",
    "head_ops",
    "model_flops_per_token",
    "moe_mlp_ops",
    "router_ops",
    "total",
]

FP32 = 4
INDEX = 8  # int64 indices (topk ids, row ids)


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


def total(ops: list[Op], field: str) -> float:
    """Sum of ``field`` (``"fwd_flops"``, ``"dx_bytes"``, ...) over ``ops``."""
    return float(sum(getattr(op, field) for op in ops))


def _gemm(name: str, m: float, k: int, n: int, b: int, *, weights: float | None = None, experts: bool = False) -> Op:
    """``[m, k] x [k, n]`` (``weights`` elements of weight, default ``k n``: a grouped GEMM has more)."""
    w = k * n if weights is None else weights
    flops = 2.0 * m * k * n
    return Op(
        name,
        fwd_flops=flops,
        dx_flops=flops,
        dw_flops=flops,
        fwd_bytes=b * (m * k + w + m * n),
        dx_bytes=b * (m * n + w + m * k),
        dw_bytes=b * (m * n + m * k) + 2 * FP32 * w,
        experts=experts,
    )


def _elementwise(name: str, read: float, write: float) -> Op:
    """A memory-bound op: backward reads what forward read plus the output gradient, writes the input grads."""
    return Op(name, fwd_bytes=read + write, dx_bytes=read + write + write)


def _swiglu(name: str, rows: float, width: int, b: int) -> Op:
    # forward reads [rows, 2 width], writes [rows, width]; backward reads both and writes [rows, 2 width].
    return Op(name, fwd_bytes=b * rows * 3 * width, dx_bytes=b * rows * 5 * width)


def attention_ops(cfg: MoEConfig, tokens: int, seq_len: int, b: int) -> list[Op]:
    """Attention of one layer: norm, QKV, rotary, SDPA, output projection, residual and the MLP's norm (an
    MoE layer's attention sub-stage adds :func:`router_ops`)."""
    if tokens % seq_len:
        raise ValueError(f"tokens={tokens} is not a whole number of sequences of {seq_len}")
    t, d, c = tokens, cfg.hidden_size, cfg.attn_head_dim
    h, g = cfg.num_heads, cfg.num_kv_heads
    seqs = t // seq_len
    sdpa_fwd = 2.0 * seqs * h * seq_len * seq_len * c  # causal half of 4 B H S^2 C
    ops = [
        _elementwise("attn_norm", b * t * d, b * t * d),
        _gemm("qkv", t, d, (h + 2 * g) * c, b),
        _elementwise("rotary", b * t * (h + g) * c, b * t * (h + g) * c),
        Op(
            "sdpa",
            fwd_flops=sdpa_fwd,
            dx_flops=2.5 * sdpa_fwd,
            fwd_bytes=b * t * (2 * h + 2 * g) * c + FP32 * seqs * h * seq_len,
            # reads q, k, v, o, dO and the log-sum-exp; writes dq, dk, dv
            dx_bytes=b * t * (3 * h + 2 * g + h + 2 * g) * c + FP32 * seqs * h * seq_len,
        ),
        _gemm("o_proj", t, h * c, d, b),
        _elementwise("residual", 2 * b * t * d, b * t * d),
        _elementwise("mlp_norm", b * t * d, b * t * d),
    ]
    return ops


def router_ops(cfg: MoEConfig, tokens: int, b: int) -> list[Op]:
    """Gate GEMM ``[T, D] x [D, E]`` and the group-limited top-k (fp32 scores, memory-bound)."""
    t, e, k = tokens, cfg.num_experts, cfg.top_k
    return [
        _gemm("router_gate", t, cfg.hidden_size, e, b),
        # sigmoid scores and the biased top-k read the [T, E] logits; write fp32 weights and int64 ids.
        Op("router_topk", fwd_bytes=FP32 * t * e * 2 + t * k * (FP32 + INDEX), dx_bytes=FP32 * t * e * 2),
    ]


def moe_mlp_ops(cfg: MoEConfig, tokens: int, rows_received: float, b: int, ep: int = 1) -> list[Op]:
    """The MLP sub-stage of an MoE layer on one rank: permute the ``rows_received`` rows into ``T K``
    expert-sorted rows (balanced routing: each rank's experts get T K rows), the two grouped GEMMs and
    SwiGLU, unpermute, and the shared experts over the rank's own ``T`` tokens."""
    t, d, f, k = tokens, cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k
    r, m = rows_received, float(tokens * k)
    e_local = cfg.num_experts // ep
    ops = [
        # each received row read once and written to its sorted slots (kernels/NOTES.md: (T + M) D moved)
        Op("permute", fwd_bytes=b * (r + m) * d + INDEX * m, dx_bytes=b * (r + m) * d + INDEX * m),
        _gemm("experts_gate_up", m, d, 2 * f, b, weights=e_local * d * 2 * f, experts=True),
        _swiglu("experts_swiglu", m, f, b),
        _gemm("experts_down", m, f, d, b, weights=e_local * f * d, experts=True),
        Op(
            "unpermute",
            fwd_bytes=b * (m + r) * d + (INDEX + FP32) * m,
            dx_bytes=b * (m + r + m) * d + (INDEX + FP32) * m,
        ),
    ]
    if cfg.num_shared_experts:
        fs = cfg.num_shared_experts * f
        ops += [_gemm("shared_gate_up", t, d, 2 * fs, b), _swiglu("shared_swiglu", t, fs, b)]
        ops += [_gemm("shared_down", t, fs, d, b), _elementwise("shared_add", 2 * b * t * d, b * t * d)]
    return ops


def dense_mlp_ops(cfg: MoEConfig, tokens: int, b: int) -> list[Op]:
    """The MLP sub-stage of a dense layer: SwiGLU of width ``dense_intermediate_size`` and the residual."""
    t, d, f = tokens, cfg.hidden_size, cfg.dense_intermediate_size
    return [
        _gemm("mlp_gate_up", t, d, 2 * f, b),
        _swiglu("mlp_swiglu", t, f, b),
        _gemm("mlp_down", t, f, d, b),
        _elementwise("residual", 2 * b * t * d, b * t * d),
    ]


def embed_ops(cfg: MoEConfig, tokens: int, b: int) -> list[Op]:
    """Embedding lookup; its backward adds rows into the fp32 gradient of the table (a dW)."""
    t, d = tokens, cfg.hidden_size
    return [Op("embed", fwd_bytes=INDEX * t + 2 * b * t * d, dw_bytes=INDEX * t + b * t * d + 2 * FP32 * t * d)]


def head_ops(cfg: MoEConfig, tokens: int, b: int) -> list[Op]:
    """Final norm, head GEMM ``[T, D] x [D, V]`` and the chunked cross-entropy (moe/loss.py: forward reads
    the logits once; backward reads them and writes their gradient)."""
    t, d, v = tokens, cfg.hidden_size, cfg.vocab_size
    return [
        _elementwise("final_norm", b * t * d, b * t * d),
        _gemm("head", t, d, v, b),
        Op("cross_entropy", fwd_bytes=b * t * v + FP32 * t, dx_bytes=2 * b * t * v + FP32 * t),
    ]


def model_flops_per_token(cfg: MoEConfig, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward + backward) for MFU.

    ``6 x active parameters`` (matmul weights a token meets: top-k routed experts, shared experts, attention,
    router, head; the embedding lookup is not a matmul) plus the attention term ``6 x L x H x C x S``: QK^T
    and PV are ``4 H C S`` FLOPs per token forward over the full square, half of it under the causal mask,
    times 3 for forward and backward (PaLM's appendix B counts the full square, ``12 L H C S``; we count
    what a causal kernel must do). Recomputation and FlashAttention's score recompute are executed work,
    not model FLOPs: they are not here.
    """
    attn = 6.0 * cfg.num_layers * cfg.num_heads * cfg.attn_head_dim * seq_len
    return 6.0 * active_params(cfg) + attn
