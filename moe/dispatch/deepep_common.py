"""What the ``deepep`` (V1 ``Buffer``) and ``deepep-v2`` (V2 ``ElasticBuffer``) dispatchers share.

Legend for shape suffixes: T local tokens, R received rows, K top-k slots.

Both import ``deep_ep`` lazily (it only exists where it was built, on GPU machines), hand it routing in the
dtypes its host asserts require, and read back local expert ids in the dtype the rest of the project uses.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from kernels.fp8 import Quantized, quantize_rows

__all__ = [
    "as_local_idx",
    "as_topk_idx",
    "as_topk_weights",
    "dispatch_input",
    "dispatch_output",
    "import_deep_ep",
    "received_rows",
    "row_bytes",
    "sent_rows",
]


def dispatch_input(x_TD: torch.Tensor, fp8: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rows as DeepEP's dispatch takes them: dense, in their dtype; or, with ``fp8``, the pair ``(x, scales)``
    in 1x128 tiles (:func:`kernels.fp8.quantize_rows`)."""
    return tuple(quantize_rows(x_TD)) if fp8 else x_TD.contiguous()


def dispatch_output(
    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, fp8: bool
) -> torch.Tensor:
    """Received rows in ``dtype``: the FP8 pair dequantized (rows past a sync-free dispatch's received count hold
    whatever DeepEP left there, and no expert reads them)."""
    return Quantized(*recv_x).dequantize(dtype) if fp8 else recv_x


def import_deep_ep(install_hint: str, *, needs: str | None = None) -> Any:
    """Import ``deep_ep`` lazily; a missing or unusable install raises ImportError with ``install_hint``.

    ``needs``: an attribute the backend uses (``ElasticBuffer``: DeepEP >= 2.0), checked so that an older
    build fails here, in words, rather than with an AttributeError later.
    """
    try:
        module = importlib.import_module("deep_ep")
    except ImportError as exc:
        raise ImportError(install_hint) from exc
    except AssertionError as exc:
        # DeepEP 2.x checks at import that the libnccl loaded in this process is byte-identical to the one it
        # links (deep_ep/__init__.py ``check_nccl_so``), and asserts; torch's bundled NCCL usually differs.
        raise ImportError(
            f"'import deep_ep' failed its NCCL check ({exc}): the libnccl loaded by torch is not the one DeepEP "
            f"was built against (DeepEP 2.x needs NCCL >= 2.30.4). {install_hint}"
        ) from exc
    if needs is not None and not hasattr(module, needs):
        version = getattr(module, "__version__", "unknown")
        raise ImportError(f"the installed deep_ep (version {version}) has no {needs}. {install_hint}")
    return module


def buffer_comm_stream(buffer: Any) -> Any:
    """A built DeepEP buffer's communication stream on CUDA, else None. Both APIs have it:
    ``Buffer.get_comm_stream()`` (V1, deep_ep/buffer.py:191 at 567632d) and ``ElasticBuffer.get_comm_stream()``
    (V2, deep_ep/buffers/elastic.py:539)."""
    if buffer is None or not torch.cuda.is_available():
        return None
    return buffer.get_comm_stream()


def row_bytes(hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of one row of ``hidden_size`` elements of ``dtype``."""
    return hidden_size * dtype.itemsize


def as_topk_idx(topk_idx_TK: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[T, K]`` expert ids as DeepEP's ``topk_idx_t`` (int64 unless built otherwise), dense: its host
    asserts check dtype and contiguity rather than converting."""
    return topk_idx_TK.to(dtype).contiguous()


def as_topk_weights(weights_TK: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` routing weights (or their gradients) as DeepEP takes them: fp32, dense."""
    return weights_TK.float().contiguous()


def as_local_idx(recv_topk_idx_RK: torch.Tensor) -> torch.Tensor:
    """DeepEP's received ``[R, K]`` local expert ids (-1: another rank's expert) as the project's int64."""
    return recv_topk_idx_RK.long()


def received_rows(local_idx_RK: torch.Tensor) -> torch.Tensor:
    """Rows a dispatch delivered, as a device count: each has a slot of this rank's (padding has none)."""
    return (local_idx_RK >= 0).any(dim=1).sum()


def sent_rows(topk_idx_TK: torch.Tensor, num_local_experts: int, num_ranks: int) -> torch.Tensor:
    """(token, rank) pairs a dispatch sends, as a device count: each token once to every rank holding one of its
    experts (slots of -1 go nowhere)."""
    rank_TK = torch.where(topk_idx_TK >= 0, topk_idx_TK // num_local_experts, num_ranks)
    in_rank = torch.zeros(topk_idx_TK.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx_TK.device)
    return in_rank.scatter_(1, rank_TK, True)[:, :num_ranks].sum()
