"""Device profiles and the cluster a plan runs on.

Units: FLOP/s, bytes/s and bytes. Every bandwidth is per GPU and per direction (what one GPU can send while
it also receives the same amount), the unit all-to-all and ring all-reduce times are computed in.

Link rates are the *nominal* datasheet rates, the same convention for every GPU. Achievable figures are
published only for the H800, from the DeepSeek-V3 report (3.2.2: NVLink 160 GB/s, IB 50 GB/s) and
DeepEP's README (H800 "~160 GB/s NVLink maximum bandwidth", CX7 400 Gb/s "~50 GB/s"; its normal kernels
measured 153 GB/s dispatch and 158 GB/s combine over NVLink at EP8, 43 GB/s over RDMA at EP16). Taking
achievable rates for one GPU and nominal ones for the others would favour the others, so every profile
holds nominal rates (H800 NVLink 200 GB/s a direction; IB 50 GB/s is the NIC's nominal 400 Gb/s) and a
user who has measured a fabric overrides them (:func:`with_overrides`, the planner's flags). Measured
costs files (:mod:`moe.plan.measured`) carry the rates their all-to-alls ran on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["DEFAULT_GEMM_EFFICIENCY", "GPU", "GPUS", "Cluster", "gpu", "with_overrides"]

GB = 1e9
TB = 1e12

DEFAULT_GEMM_EFFICIENCY = 0.70
"""Achieved fraction of the dense peak for large GEMMs, bf16 and FP8 alike. No measurement exists for these
kernels yet (kernels/NOTES.md: "Not yet run on a GPU"), so this is a stated prior, not a fitted value: a
round figure below the peak that large cuBLAS GEMMs approach, left for ``bench.kernels`` (``--costs``) or the
planner's ``--gemm-efficiency`` flag to replace. It is the same for every GPU and both precisions (no FP8
kernel of ours has run either) and was not chosen by comparing any prediction with the DeepSeek-V3 report."""


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator's rates (see the module docstring for the conventions)."""

    name: str
    bf16_flops: float
    """Dense (no sparsity) bf16 tensor-core peak, FLOP/s."""
    gemm_efficiency: float
    """Achieved fraction of ``bf16_flops`` for large bf16 GEMMs (0, 1]."""
    hbm_bytes_per_s: float
    """HBM bandwidth, bytes/s."""
    hbm_bytes: float
    """HBM capacity, bytes (decimal GB as the datasheets state them)."""
    sms: int
    """Streaming multiprocessors."""
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU, one direction, bytes/s (datasheets quote both directions together)."""
    internode_bytes_per_s: float
    """Inter-node bandwidth per GPU, one direction: the NIC that serves this GPU, bytes/s."""
    fp8_flops: float | None = None
    """Dense FP8 (E4M3) tensor-core peak, FLOP/s; None: the device has none (a measured CPU "device"), and a
    plan with FP8 GEMMs is refused."""
    host_bytes_per_s: float = 64 * GB
    """The host link (PCIe) per GPU, one direction, bytes/s: what activation offloading copies over. Default:
    PCIe Gen5 x16's nominal 64 GB/s a direction (128 GB/s both), the Hopper profiles' datasheet figure."""

    def __post_init__(self) -> None:
        rates = ("bf16_flops", "hbm_bytes_per_s", "hbm_bytes", "nvlink_bytes_per_s", "internode_bytes_per_s")
        for field in (*rates, "host_bytes_per_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"GPU {self.name!r}: {field} must be positive, got {getattr(self, field)}")
        if self.fp8_flops is not None and not self.fp8_flops > 0:
            raise ValueError(f"GPU {self.name!r}: fp8_flops must be positive or None, got {self.fp8_flops}")
        if not 0 < self.gemm_efficiency <= 1:
            raise ValueError(f"GPU {self.name!r}: gemm_efficiency must lie in (0, 1], got {self.gemm_efficiency}")
        if self.sms < 1:
            raise ValueError(f"GPU {self.name!r}: sms must be >= 1, got {self.sms}")

    @property
    def gemm_flops(self) -> float:
        """Achieved bf16 GEMM rate on all SMs, FLOP/s."""
        return self.bf16_flops * self.gemm_efficiency

    @property
    def fp8_gemm_flops(self) -> float:
        """Achieved FP8 GEMM rate on all SMs, FLOP/s (the same ``gemm_efficiency`` of its own peak)."""
        if self.fp8_flops is None:
            raise ValueError(f"GPU {self.name!r} has no FP8 peak (fp8_flops): FP8 GEMMs cannot be planned on it")
        return self.fp8_flops * self.gemm_efficiency


GPUS: Mapping[str, GPU] = MappingProxyType(
    {
        "h100": GPU(
            name="h100",
            # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 Tensor Core 1,979 TFLOPS "with sparsity";
            # dense is half of it.
            bf16_flops=989.4 * TB,
            # Same datasheet, SXM: FP8 Tensor Core 3,958 TFLOPS "with sparsity" -> 1,979 dense, twice bf16.
            fp8_flops=1979 * TB,
            gemm_efficiency=DEFAULT_GEMM_EFFICIENCY,
            # Same datasheet, SXM: GPU memory 80 GB, bandwidth 3.35 TB/s.
            hbm_bytes_per_s=3.35 * TB,
            hbm_bytes=80 * GB,
            # NVIDIA H100 architecture whitepaper: the SXM5 H100 has 132 SMs.
            sms=132,
            # Datasheet, SXM: NVLink 900 GB/s (both directions together) -> 450 GB/s each way.
            nvlink_bytes_per_s=450 * GB,
            # DGX H100 user guide: 8 ConnectX-7 400 Gb/s compute NICs for 8 GPUs -> 400 Gb/s = 50 GB/s per GPU.
            internode_bytes_per_s=50 * GB,
            # Datasheet, SXM: PCIe Gen5 128 GB/s (both directions together) -> 64 GB/s each way.
            host_bytes_per_s=64 * GB,
        ),
        "h800": GPU(
            name="h800",
            # H800 SXM5 is the H100 SXM5 die with the chip-to-chip links cut down (NVIDIA H800 product brief):
            # the same 989.4 TFLOPS dense bf16 (1,979 dense FP8), 80 GB HBM3 at 3.35 TB/s and 132 SMs.
            bf16_flops=989.4 * TB,
            fp8_flops=1979 * TB,
            gemm_efficiency=DEFAULT_GEMM_EFFICIENCY,
            hbm_bytes_per_s=3.35 * TB,
            hbm_bytes=80 * GB,
            sms=132,
            # H800 SXM: NVLink 400 GB/s both directions (product brief) -> 200 GB/s each way, nominal. The
            # DeepSeek-V3 report (3.2.2) works with 160 GB/s, the achievable figure; see the module docstring.
            nvlink_bytes_per_s=200 * GB,
            # DeepSeek-V3 report 3.2.2 / DeepEP README: one CX7 400 Gb/s InfiniBand NIC per GPU, 50 GB/s.
            internode_bytes_per_s=50 * GB,
            # H800 SXM product brief: PCIe Gen5 128 GB/s (both directions) -> 64 GB/s each way, as the H100's.
            host_bytes_per_s=64 * GB,
        ),
        "h200": GPU(
            name="h200",
            # NVIDIA H200 datasheet, SXM: BF16 1,979 TFLOPS with sparsity -> 989.4 dense; FP8 3,958 with
            # sparsity -> 1,979 dense (the H100's Hopper compute, more and faster memory).
            bf16_flops=989.4 * TB,
            fp8_flops=1979 * TB,
            gemm_efficiency=DEFAULT_GEMM_EFFICIENCY,
            # Same datasheet: 141 GB HBM3e at 4.8 TB/s.
            hbm_bytes_per_s=4.8 * TB,
            hbm_bytes=141 * GB,
            sms=132,
            # Same datasheet: NVLink 900 GB/s (both directions) -> 450 GB/s each way.
            nvlink_bytes_per_s=450 * GB,
            # HGX H200 reference node: one 400 Gb/s ConnectX-7 NIC per GPU, as DGX H100 -> 50 GB/s.
            internode_bytes_per_s=50 * GB,
            # Same datasheet: PCIe Gen5 128 GB/s (both directions) -> 64 GB/s each way.
            host_bytes_per_s=64 * GB,
        ),
    }
)


def gpu(name: str) -> GPU:
    """The profile ``name`` of :data:`GPUS` (``KeyError`` lists the known ones)."""
    if name not in GPUS:
        raise KeyError(f"unknown GPU {name!r}; known: {sorted(GPUS)}")
    return GPUS[name]


def with_overrides(base: GPU, **changes: float | int | None) -> GPU:
    """``base`` with the fields in ``changes`` replaced; ``None`` values are ignored (unset CLI flags)."""
    return dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True, slots=True)
class Cluster:
    """``num_gpus`` GPUs of one kind, ``gpus_per_node`` to a node (NVLink inside a node, the NICs between)."""

    gpu: GPU
    num_gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"num_gpus and gpus_per_node must be >= 1, got {self.num_gpus}, {self.gpus_per_node}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"num_gpus={self.num_gpus} is not a whole number of nodes of gpus_per_node={self.gpus_per_node}"
            )

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    def ranks_per_node(self, group: int) -> int:
        """Ranks of a group of ``group`` consecutive ranks that share one node (node-aligned placement)."""
        return min(group, self.gpus_per_node)
