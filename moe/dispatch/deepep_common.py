"""What the ``deepep`` (V1 ``Buffer``) and ``deepep-v2`` (V2 ``ElasticBuffer``) dispatchers share.

Legend for shape suffixes: T local tokens, R received rows, K top-k slots.

Both import ``deep_ep`` lazily (it only exists where it was built, on GPU machines), hand it routing in the
dtypes its host asserts require, and read back local expert ids in the dtype the rest of the project uses.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["as_local_idx", "as_topk_idx", "as_topk_weights", "import_deep_ep", "row_bytes"]


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
