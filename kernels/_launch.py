"""Launch helpers shared by the Triton launchers: tile configs, the SM budget, argument checks.

Nothing here imports Triton, so the backend switch can use it without Triton installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockConfig", "num_programs", "sm_count", "validate_counts"]

# The interpreter has no SMs. Four pretend ones make each persistent program walk several work items
# in the tiny test shapes, so the tile loop itself is exercised, not just one tile per program.
INTERPRETER_SMS = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockConfig:
    """Tile shape and launch parameters of one kernel launch."""

    block_m: int
    """Rows of the token dimension per tile (or per reduction step in the weight-grad)."""
    block_n: int
    """Output columns per tile."""
    block_k: int
    """Reduction step over the input features (or output rows in the weight-grad)."""
    group_m: int = 1
    """m-tiles that sweep the n-tiles together (L2 reuse of the weight columns)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 1
    """Software-pipelining depth of the K loop (shared-memory buffers in flight)."""

    def to_triton(self, *, with_group: bool = True):
        """As a ``triton.Config`` (BLOCK_M, BLOCK_N, BLOCK_K and, with_group, GROUP_M)."""
        import triton

        meta = {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k}
        if with_group:
            meta["GROUP_M"] = self.group_m
        return triton.Config(meta, num_warps=self.num_warps, num_stages=self.num_stages)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; :data:`INTERPRETER_SMS` elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def num_programs(device: torch.device, comm_sms: int, work_items: int) -> int:
    """Programs for a persistent launch: the SMs left after communication, capped by the work.

    comm_sms is the number of SMs communication kernels (DeepEP ``Buffer.set_num_sms``, NCCL's CTA
    limit) keep for themselves while this kernel runs; at least one SM must remain for compute.
    """
    total = sm_count(device)
    if not 0 <= comm_sms < total:
        raise ValueError(f"comm_sms={comm_sms} must be in [0, {total}) on {device} ({total} SMs)")
    return max(1, min(total - comm_sms, work_items))


def validate_counts(name: str, tokens_per_expert_E: torch.Tensor) -> None:
    """tokens_per_expert must be a 1-D int32/int64 tensor (its sum is not checked: that would sync)."""
    if tokens_per_expert_E.dim() != 1 or tokens_per_expert_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name}: tokens_per_expert must be a 1-D int32/int64 tensor, got "
            f"{tokens_per_expert_E.dtype} {tuple(tokens_per_expert_E.shape)}"
        )
