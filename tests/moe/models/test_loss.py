"""The chunked cross-entropy against ``F.cross_entropy`` on fp32 logits: loss and gradient, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe.models.loss import chunk_tokens_for, chunked_cross_entropy
from moe.models.model import lm_loss


def _case(dtype: torch.dtype, tokens: int = 37, vocab: int = 50, ignored: int = 0):
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(tokens, vocab, generator=gen) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[:ignored] = -100
    return logits, labels


def _plain(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loss = F.cross_entropy(logits.float(), labels)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, grad


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("ignored", [0, 4])
def test_chunked_equals_plain_fp32(chunk: int, ignored: int) -> None:
    logits, labels = _case(torch.float32, ignored=ignored)
    want_loss, want_grad = _plain(logits, labels)
    loss = chunked_cross_entropy(logits, labels, chunk_tokens=chunk)
    (grad,) = torch.autograd.grad(loss * 3.0, logits)  # a non-unit upstream gradient too
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, 3.0 * want_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("chunk", [4, 64])
def test_chunked_equals_plain_bf16(chunk: int) -> None:
    logits, labels = _case(torch.bfloat16, tokens=64, vocab=300)
    want_loss, want_grad = _plain(logits, labels)
    loss = chunked_cross_entropy(logits, labels, chunk_tokens=chunk)
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    # Both are fp32 gradients rounded once to bf16: at most one bf16 ulp apart.
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=2**-7, atol=1e-9)


def test_lm_loss_is_chunked_and_equal() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    want = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    got = lm_loss(logits, labels)
    assert got.grad_fn is not None and "ChunkedCrossEntropy" in type(got.grad_fn).__name__
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_no_fp32_copy_of_the_logits_is_kept() -> None:
    """Forward saves the bf16 logits and [T] fp32 statistics only: no [T, V] fp32 tensor for backward."""
    logits, labels = _case(torch.bfloat16, tokens=64, vocab=300)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunked_cross_entropy(logits, labels, chunk_tokens=8)
    big_fp32 = [t for t in saved if t.dtype == torch.float32 and t.numel() >= logits.numel()]
    assert saved and not big_fp32
    plain: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t) or t, lambda t: t):
        F.cross_entropy(logits.float(), labels)
    assert any(t.dtype == torch.float32 and t.numel() >= logits.numel() for t in plain)  # what the plain one keeps


def test_chunk_size_and_errors() -> None:
    assert chunk_tokens_for(129_280) == 259  # 128 MiB of fp32 rows at DeepSeek-V3's vocabulary
    assert chunk_tokens_for(10**12) == 1
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match="expected logits"):
        chunked_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))
