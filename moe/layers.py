"""Dense building blocks: linear with a deferrable weight gradient, RMSNorm, rotary attention, SwiGLU MLP.

Legend for shape suffixes: B batch, S sequence, D hidden, H query heads, G key/value heads, C head dim,
F intermediate width, T tokens (B*S).

Every matrix multiply goes through :class:`Linear`, whose backward computes the input gradient at once and
hands the weight gradient to ``WeightGradStore`` when it is enabled (:func:`defer_wgrad`, DualPipe's
protocol). That is what lets a compute piece's backward run as "dX now, dW later" (:mod:`dualpipe.pieces`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dualpipe.weight_grad import WeightGradStore
from kernels import functional
from kernels.functional import accumulate_grad

__all__ = ["Attention", "DenseMLP", "Linear", "RMSNorm", "accumulate_grad", "causal_attention", "defer_wgrad"]


def _without_grad(fn: Callable[[], None]) -> Callable[[], None]:
    # A deferred closure runs later, maybe with grad mode on: its saved activations may be leaves that
    # require grad, and the product must not grow a graph.
    def run() -> None:
        with torch.no_grad():
            fn()

    return run


def defer_wgrad(fn: Callable[[], None]) -> None:
    """DualPipe's protocol for a weight gradient: hand the closure to ``WeightGradStore`` when it is enabled
    (the piece runtime's dW, or a zero-bubble ``W`` slot), else compute it now."""
    if WeightGradStore.enabled:
        WeightGradStore.put(_without_grad(fn))
    else:
        _without_grad(fn)()


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # The weight is kept on ctx, not saved: its backward accumulates into ``weight.grad``, which needs the
        # parameter object itself, and a saved tensor comes back as a new alias under saved-tensors hooks
        # (activation checkpointing, offloading, moe.memory's tracker).
        ctx.save_for_backward(x)
        ctx.weight = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            # The weight never gets an autograd gradient: the closure accumulates into .grad directly, so a
            # deferred closure and an immediate one leave the same result.
            def wgrad() -> None:
                accumulate_grad(weight, dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))

            defer_wgrad(wgrad)
        return dx, None


class Linear(nn.Module):
    """``y = x @ W^T`` (no bias) whose weight gradient can be deferred; W is ``[out, in]``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def _rotate(x_BSHC: torch.Tensor, cos_SC: torch.Tensor, sin_SC: torch.Tensor) -> torch.Tensor:
    # Rotate pairs (first half, second half) of each head by the position angle.
    x1, x2 = x_BSHC.float().chunk(2, dim=-1)
    cos, sin = cos_SC[None, :, None, :], sin_SC[None, :, None, :]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x_BSHC.dtype)


def causal_attention(
    q_BSHC: torch.Tensor, k_BSGC: torch.Tensor, v_BSGV: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal softmax attention of every attention variant (SDPA: FlashAttention's kernel where it applies):
    ``[B, S, H, C]`` queries over ``G`` key/value heads (``H % G == 0``, grouped-query when ``G < H``), value
    width ``V`` (may differ from ``C``, as in MLA) -> ``[B, S, H, V]``. ``scale``: the softmax scale (None:
    ``C ** -0.5``)."""
    o_BHSV = F.scaled_dot_product_attention(
        q_BSHC.transpose(1, 2),
        k_BSGC.transpose(1, 2),
        v_BSGV.transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=k_BSGC.shape[2] != q_BSHC.shape[2],
    )
    return o_BHSV.transpose(1, 2)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions (SDPA does the softmax)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.wq = Linear(hidden, num_heads * head_dim)
        self.wk = Linear(hidden, num_kv_heads * head_dim)
        self.wv = Linear(hidden, num_kv_heads * head_dim)
        self.wo = Linear(num_heads * head_dim, hidden)
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSD.shape
        q_BSHC = self.wq(x_BSD).view(b, s, self.num_heads, self.head_dim)
        k_BSGC = self.wk(x_BSD).view(b, s, self.num_kv_heads, self.head_dim)
        v_BSGC = self.wv(x_BSD).view(b, s, self.num_kv_heads, self.head_dim)
        angles_SC = torch.arange(s, device=x_BSD.device, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos_SC, sin_SC = angles_SC.cos(), angles_SC.sin()
        q_BSHC, k_BSGC = _rotate(q_BSHC, cos_SC, sin_SC), _rotate(k_BSGC, cos_SC, sin_SC)
        return self.wo(causal_attention(q_BSHC, k_BSGC, v_BSGC).reshape(b, s, -1))


class DenseMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matrix."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = Linear(hidden, 2 * intermediate)
        self.down = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., D] -> [..., D]`` (``functional.swiglu`` flattens the leading dims for the kernel)."""
        return self.down(functional.swiglu(self.gate_up(x)))
