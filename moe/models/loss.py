"""Cross-entropy over a large vocabulary without an fp32 copy of the whole logits.

Legend for shape suffixes: T tokens, V vocabulary, C tokens of one chunk.

``F.cross_entropy(logits.float(), labels)`` materialises ``[T, V]`` fp32 twice over: the upcast copy and
the log-softmax it saves for backward (at a 129k vocabulary that is about 2 GB per 4k tokens each).
:func:`chunked_cross_entropy` walks the tokens in chunks instead: each chunk is upcast, reduced to its
log-sum-exp and target logit, and dropped; backward recomputes each chunk's softmax from the saved
log-sum-exp and writes the gradient straight into a tensor of the logits' own dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_CHUNK_BYTES", "chunk_tokens_for", "chunked_cross_entropy", "reference_cross_entropy"]

DEFAULT_CHUNK_BYTES = 128 * 2**20
"""fp32 bytes of one chunk's upcast logits (``C x V x 4``): 256 tokens at a 129k vocabulary. Large enough
that the per-chunk kernel launches are noise next to the head GEMM, small enough to be noise in memory."""


def chunk_tokens_for(vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take at most ``chunk_bytes`` (at least 1 token)."""
    return max(1, chunk_bytes // (4 * vocab))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV: torch.Tensor, labels_T: torch.Tensor, chunk: int, ignore_index: int):
        valid_T = labels_T != ignore_index
        safe_T = torch.where(valid_T, labels_T, 0)
        lse_T = torch.empty(labels_T.shape, dtype=torch.float32, device=logits_TV.device)
        total = torch.zeros((), dtype=torch.float32, device=logits_TV.device)
        for start in range(0, logits_TV.shape[0], chunk):
            x_CV = logits_TV[start : start + chunk].float()
            lse_C = torch.logsumexp(x_CV, dim=-1)
            target_C = x_CV.gather(1, safe_T[start : start + chunk, None]).squeeze(1)
            lse_T[start : start + chunk] = lse_C
            total += torch.where(valid_T[start : start + chunk], lse_C - target_C, 0.0).sum()
        count = valid_T.sum()
        ctx.save_for_backward(logits_TV, safe_T, valid_T, lse_T, count)
        ctx.chunk = chunk
        return total / count  # 0 / 0 = nan when every label is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits_TV, safe_T, valid_T, lse_T, count = ctx.saved_tensors
        chunk = ctx.chunk
        grad_TV = torch.empty_like(logits_TV)
        # d loss / d x = (softmax(x) - onehot(label)) * valid / count, per row
        scale_T = valid_T.float() * (grad_loss.float() / count)
        for start in range(0, logits_TV.shape[0], chunk):
            stop = start + chunk
            p_CV = torch.exp(logits_TV[start:stop].float() - lse_T[start:stop, None])
            p_CV.scatter_add_(1, safe_T[start:stop, None], torch.full_like(p_CV[:, :1], -1.0))
            p_CV *= scale_T[start:stop, None]
            grad_TV[start:stop] = p_CV
        return grad_TV, None, None, None


def chunked_cross_entropy(
    logits_TV: torch.Tensor, labels_T: torch.Tensor, *, chunk_tokens: int | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose label is not ``ignore_index``, computed in fp32 chunk by chunk.

    Args:
        logits_TV: ``[T, V]`` logits, any floating dtype (fp32, bf16, fp16).
        labels_T: ``[T]`` int64 target ids.
        chunk_tokens: tokens per chunk; ``None`` picks :func:`chunk_tokens_for` (128 MiB of fp32 logits).

    Returns a 0-d fp32 tensor equal to ``F.cross_entropy(logits_TV.float(), labels_T)`` (up to the order of
    summation), differentiable w.r.t. ``logits_TV``; its gradient comes back in ``logits_TV``'s dtype.

    Memory: beyond the logits themselves, forward keeps only ``[T]`` fp32 log-sum-exps for backward, and
    each pass holds at most a few ``[chunk_tokens, V]`` fp32 temporaries at a time; backward allocates the
    ``[T, V]`` gradient in the logits' dtype (which any loss must). The plain fp32 loss instead holds an fp32
    copy of the logits and saves its ``[T, V]`` fp32 log-softmax: ``8 T V`` bytes more than this at its peak.
    """
    if logits_TV.dim() != 2 or labels_T.shape != logits_TV.shape[:1]:
        raise ValueError(
            f"expected logits [T, V] and labels [T], got {tuple(logits_TV.shape)} and {tuple(labels_T.shape)}"
        )
    chunk = chunk_tokens if chunk_tokens is not None else chunk_tokens_for(logits_TV.shape[1])
    if chunk <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk}")
    return _ChunkedCrossEntropy.apply(logits_TV, labels_T, chunk, ignore_index)


def reference_cross_entropy(logits_TV: torch.Tensor, labels_T: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The plain fp32 loss :func:`chunked_cross_entropy` is tested against (materialises ``[T, V]`` fp32)."""
    return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=ignore_index)
