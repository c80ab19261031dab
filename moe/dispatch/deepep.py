"""``deepep``: DeepEP's high-throughput V1 ``deep_ep.Buffer`` (NVLink intranode, RDMA internode).

Legend for shape suffixes: T local tokens, R received rows, K top-k slots, D hidden, E global experts.

DeepEP launches its kernels on its own communication stream on ``Buffer.num_sms`` SMs. Each call here
passes ``previous_event`` (the compute stream's progress, captured with ``Buffer.capture()``) so the comm
stream starts only after the producer of its input, and ``async_finish=True`` so the compute stream goes
on; ``Pending.wait()`` calls ``event.current_stream_wait()`` where the result is consumed. Backward reuses
the forward handle: the gradient of dispatch is a ``combine`` (which also sums the routing-weight
gradients), the gradient of combine is a cached-mode ``dispatch``.

Real DeepEP wants bf16 rows (or an fp8 tuple); run the model in bf16 on the cluster.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe.dispatch.base import DEFAULT_COMM_SMS, Dispatched, Pending, Route, TokenDispatcher
from moe.dispatch.registry import DispatcherSpec, register_dispatcher

__all__ = ["DEEPEP_INSTALL_HINT", "DeepEPDispatcher", "import_deep_ep"]

DEEPEP_INSTALL_HINT = (
    "the 'deepep' dispatcher needs DeepEP (module 'deep_ep'), which is built from source on a GPU machine "
    "with NVSHMEM: git clone https://github.com/deepseek-ai/DeepEP && cd DeepEP && "
    "NVSHMEM_DIR=/path/to/nvshmem python setup.py install (see its README). Do not use the PyPI package "
    "'deep-ep' (an unbuildable re-upload). Or pick dispatcher='alltoall'."
)


def import_deep_ep() -> Any:
    """Import ``deep_ep`` lazily; a missing install raises ImportError with build instructions."""
    try:
        return importlib.import_module("deep_ep")
    except ImportError as exc:
        raise ImportError(DEEPEP_INSTALL_HINT) from exc


@dataclass(slots=True)
class _DeepEPRoute(Route):
    topk_idx_TK: torch.Tensor
    num_tokens_per_rank: torch.Tensor
    num_tokens_per_rdma_rank: torch.Tensor | None
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor
    layout_event: Any
    handle: Any = None


class DeepEPDispatcher(TokenDispatcher):
    """Expert parallelism through one ``deep_ep.Buffer`` over ``group``.

    ``hidden_bytes`` (hidden size times the element size of the rows sent) sizes the NVLink/RDMA buffers
    from DeepEP's own hints. ``comm_sms`` is applied with ``Buffer.set_num_sms`` (DeepEP requires it even).
    """

    def __init__(
        self, num_experts: int, group: dist.ProcessGroup, hidden_bytes: int, comm_sms: int = DEFAULT_COMM_SMS
    ) -> None:
        super().__init__(num_experts, dist.get_world_size(group), dist.get_rank(group))
        deep_ep = import_deep_ep()
        if comm_sms % 2:
            raise ValueError(f"DeepEP needs an even SM count, got comm_sms={comm_sms}")
        buffer_cls = deep_ep.Buffer
        buffer_cls.set_num_sms(comm_sms)
        num_nvl_bytes = num_rdma_bytes = 0
        for cfg in (buffer_cls.get_dispatch_config(self.ep_size), buffer_cls.get_combine_config(self.ep_size)):
            num_nvl_bytes = max(num_nvl_bytes, cfg.get_nvl_buffer_size_hint(hidden_bytes, self.ep_size))
            num_rdma_bytes = max(num_rdma_bytes, cfg.get_rdma_buffer_size_hint(hidden_bytes, self.ep_size))
        self.buffer = buffer_cls(group, num_nvl_bytes, num_rdma_bytes)
        self._buffer_cls = buffer_cls

    def _launch_kwargs(self, device: torch.device) -> dict[str, Any]:
        # CUDA: order the comm stream after the compute stream's work so far and allocate results there.
        # Elsewhere (the in-test emulation on gloo) there is no stream to capture.
        if device.type == "cuda":
            return {"previous_event": self._buffer_cls.capture(), "async_finish": True, "allocate_on_comm_stream": True}
        return {"previous_event": None, "async_finish": True, "allocate_on_comm_stream": False}

    def plan(self, topk_idx_TK: torch.Tensor) -> Route:
        per_rank, per_rdma_rank, per_expert, in_rank, event = self.buffer.get_dispatch_layout(
            topk_idx_TK, self.num_experts, **self._launch_kwargs(topk_idx_TK.device)
        )
        return _DeepEPRoute(topk_idx_TK, per_rank, per_rdma_rank, per_expert, in_rank, event)

    def dispatch(self, route: Route, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending[Dispatched]:
        assert isinstance(route, _DeepEPRoute)
        kwargs = self._launch_kwargs(x_TD.device)
        if x_TD.device.type == "cuda":
            kwargs["previous_event"] = route.layout_event
        recv_x, recv_idx, recv_w, _, handle, event = self.buffer.dispatch(
            x_TD,
            num_tokens_per_rank=route.num_tokens_per_rank,
            num_tokens_per_rdma_rank=route.num_tokens_per_rdma_rank,
            is_token_in_rank=route.is_token_in_rank,
            num_tokens_per_expert=route.num_tokens_per_expert,
            topk_idx=route.topk_idx_TK,
            topk_weights=topk_weights_TK.float(),
            **kwargs,
        )
        route.handle = handle

        def finish() -> Dispatched:
            event.current_stream_wait()
            return Dispatched(recv_x, recv_idx.long(), recv_w)

        return Pending(finish)

    def combine(self, route: Route, y_RD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, _DeepEPRoute)
        combined_x, _, event = self.buffer.combine(y_RD, route.handle, **self._launch_kwargs(y_RD.device))

        def finish() -> torch.Tensor:
            event.current_stream_wait()
            return combined_x

        return Pending(finish)

    def dispatch_backward(
        self, route: Route, grad_x_RD: torch.Tensor, grad_weights_RK: torch.Tensor
    ) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        assert isinstance(route, _DeepEPRoute)
        grad_x_TD, grad_w_TK, event = self.buffer.combine(
            grad_x_RD, route.handle, topk_weights=grad_weights_RK.float(), **self._launch_kwargs(grad_x_RD.device)
        )

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            event.current_stream_wait()
            return grad_x_TD, grad_w_TK

        return Pending(finish)

    def combine_backward(self, route: Route, grad_y_TD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, _DeepEPRoute)
        grad_y_RD, _, _, _, _, event = self.buffer.dispatch(
            grad_y_TD, handle=route.handle, **self._launch_kwargs(grad_y_TD.device)
        )

        def finish() -> torch.Tensor:
            event.current_stream_wait()
            return grad_y_RD

        return Pending(finish)


def _make_deepep(
    num_experts: int, group: dist.ProcessGroup | None, *, hidden_size: int, dtype: torch.dtype, comm_sms: int
) -> TokenDispatcher:
    assert group is not None  # needs_group: make_dispatcher refused None already
    hidden_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
    return DeepEPDispatcher(num_experts, group, hidden_bytes=hidden_bytes, comm_sms=comm_sms)


# CUDA and bf16 are the real library's needs (V1 combine takes bf16 only); they are recorded, not enforced,
# because the tests run this backend over a CPU emulation in fp32.
register_dispatcher(
    DispatcherSpec(
        name="deepep",
        factory=_make_deepep,
        needs_group=True,
        needs_cuda=True,
        dtypes=(torch.bfloat16,),
        package="deep_ep",
        install_hint=DEEPEP_INSTALL_HINT,
    )
)
