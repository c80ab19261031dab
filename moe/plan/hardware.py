"""Device profiles and the cluster a plan runs on.

Units: FLOP/s, bytes/s and bytes. Every bandwidth is per GPU and per direction (what one GPU can send while
it also receives the same amount), the unit all-to-all and ring all-reduce times are computed in.

A profile holds the datasheet's peaks and nominal link rates, and its table of achieved figures
(:mod:`moe.plan.efficiency`: GEMM and attention efficiencies, DeepEP's and NCCL's bandwidths, launch
overheads), each with its published source. :meth:`GPU.entry` gives the value a plan uses and where it came
from: the cited table, or an override (the planner's ``--gemm-efficiency``, ``--nvlink-gbps`` and
``--internode-gbps``, :func:`with_overrides`), or the link rates a measured costs file ran on
(:mod:`moe.plan.measured`). An override of ``nvlink_bytes_per_s`` replaces every intra-node rate of the table,
``internode_bytes_per_s`` every inter-node one, ``gemm_efficiency`` every GEMM's. A profile without a table (a
measured CPU "device", :func:`moe.plan.measured.device_of`) runs every FLOP at ``gemm_efficiency`` and its
links at the nominal fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from moe.plan.efficiency import TABLES, Cited

__all__ = ["GPU", "GPUS", "Cluster", "gpu", "with_overrides"]

GB = 1e9
TB = 1e12

_LINK_FIELDS = {"intranode": "nvlink_bytes_per_s", "internode": "internode_bytes_per_s"}


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator's rates (see the module docstring for the conventions)."""

    name: str
    bf16_flops: float
    """Dense (no sparsity) bf16 tensor-core peak, FLOP/s."""
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
    gemm_efficiency: float | None = None
    """Every GEMM's achieved fraction of its peak, in place of the table's (an override); on a profile without a
    table, every FLOP's. None: the table's, by precision and shape class."""
    efficiencies: Mapping[str, Cited] = field(default_factory=dict, compare=False)
    """The cited table (:data:`moe.plan.efficiency.TABLES`; empty: a measured device, none)."""
    overrides: tuple[tuple[str, str], ...] = ()
    """(field, where its value came from) for the fields that replace table entries (:func:`with_overrides`)."""

    def __post_init__(self) -> None:
        rates = ("bf16_flops", "hbm_bytes_per_s", "hbm_bytes", "nvlink_bytes_per_s", "internode_bytes_per_s")
        for name in (*rates, "host_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GPU {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        if self.fp8_flops is not None and not self.fp8_flops > 0:
            raise ValueError(f"GPU {self.name!r}: fp8_flops must be positive or None, got {self.fp8_flops}")
        if self.gemm_efficiency is None and not self.efficiencies:
            raise ValueError(f"GPU {self.name!r}: no efficiency table and no gemm_efficiency")
        if self.gemm_efficiency is not None and not 0 < self.gemm_efficiency <= 1:
            raise ValueError(f"GPU {self.name!r}: gemm_efficiency must lie in (0, 1], got {self.gemm_efficiency}")
        if self.sms < 1:
            raise ValueError(f"GPU {self.name!r}: sms must be >= 1, got {self.sms}")

    def entry(self, key: str) -> tuple[float, str]:
        """The value this profile uses for efficiency-table entry ``key`` (:data:`moe.plan.efficiency.KEYS`) and
        where it came from: ``"cited: <source>"``, or the override that replaced it."""
        origin = dict(self.overrides)
        kind = key.split(".")[0]
        if kind == "gemm" and self.gemm_efficiency is not None:
            return self.gemm_efficiency, origin.get("gemm_efficiency", "gemm_efficiency (no cited table)")
        link = next((f for where, f in _LINK_FIELDS.items() if kind in ("deepep", "nccl") and where in key), None)
        if link is not None and (link in origin or not self.efficiencies):
            return getattr(self, link), origin.get(link, f"{link} (no cited table)")
        if key in self.efficiencies:
            cited = self.efficiencies[key]
            return cited.value, f"cited: {cited.source}"
        if kind == "attention" and self.gemm_efficiency is not None:
            return self.gemm_efficiency, origin.get("gemm_efficiency", "gemm_efficiency (no cited table)")
        if kind in ("launch", "host"):
            return 0.0, "none (no cited table)"
        raise KeyError(f"GPU {self.name!r} has no efficiency entry {key!r}")

    def to_dict(self) -> dict[str, object]:
        """The profile as JSON: its fields, and each table entry as ``[value, where it came from]``."""
        out: dict[str, object] = {k: getattr(self, k) for k in self.__slots__ if k not in ("efficiencies", "overrides")}
        out["efficiencies"] = {key: list(self.entry(key)) for key in self.efficiencies}
        return out

    def value(self, key: str) -> float:
        """:meth:`entry`'s value alone."""
        return self.entry(key)[0]

    def peak(self, fp8: bool) -> float:
        """The dense FP8 or bf16 peak, FLOP/s."""
        if not fp8:
            return self.bf16_flops
        if self.fp8_flops is None:
            raise ValueError(f"GPU {self.name!r} has no FP8 peak (fp8_flops): FP8 GEMMs cannot be planned on it")
        return self.fp8_flops

    @property
    def gemm_flops(self) -> float:
        """Achieved bf16 rate of a large dense GEMM on all SMs, FLOP/s."""
        return self.bf16_flops * self.value("gemm.bf16.dense")

    @property
    def fp8_gemm_flops(self) -> float:
        """Achieved FP8 rate of a large dense GEMM on all SMs, FLOP/s."""
        return self.peak(True) * self.value("gemm.fp8.dense")


GPUS: Mapping[str, GPU] = MappingProxyType(
    {
        "h100": GPU(
            name="h100",
            efficiencies=TABLES["h100"],
            # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 Tensor Core 1,979 TFLOPS "with sparsity";
            # dense is half of it.
            bf16_flops=989.4 * TB,
            # Same datasheet, SXM: FP8 Tensor Core 3,958 TFLOPS "with sparsity" -> 1,979 dense, twice bf16.
            fp8_flops=1979 * TB,
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
            efficiencies=TABLES["h800"],
            # H800 SXM5 is the H100 SXM5 die with the chip-to-chip links cut down (NVIDIA H800 product brief):
            # the same 989.4 TFLOPS dense bf16 (1,979 dense FP8), 80 GB HBM3 at 3.35 TB/s and 132 SMs.
            bf16_flops=989.4 * TB,
            fp8_flops=1979 * TB,
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
            efficiencies=TABLES["h200"],
            # NVIDIA H200 datasheet, SXM: BF16 1,979 TFLOPS with sparsity -> 989.4 dense; FP8 3,958 with
            # sparsity -> 1,979 dense (the H100's Hopper compute, more and faster memory).
            bf16_flops=989.4 * TB,
            fp8_flops=1979 * TB,
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
        "b200": GPU(
            name="b200",
            efficiencies=TABLES["b200"],
            # NVIDIA HGX B200 datasheet (8 GPUs): FP8/FP6 Tensor Core 72 PFLOPS and BF16 36 PFLOPS "with sparsity"
            # -> per GPU 4.5 PFLOPS dense FP8, 2.25 dense bf16.
            bf16_flops=2250 * TB,
            fp8_flops=4500 * TB,
            # Same datasheet: 1.4 TB HBM3e (180 GB a GPU, as DGX B200's 1,440 GB / 8), 62 TB/s -> 7.7 TB/s a GPU.
            hbm_bytes_per_s=7.7 * TB,
            hbm_bytes=180 * GB,
            # NVIDIA Blackwell architecture technical brief: B200 has 148 SMs (DeepGEMM and DeepEP size for 148 on
            # SM100).
            sms=148,
            # Same datasheet: NVLink 5, 1.8 TB/s a GPU both ways -> 900 GB/s each way.
            nvlink_bytes_per_s=900 * GB,
            # DGX B200 user guide: 8 ConnectX-7 400 Gb/s compute NICs for 8 GPUs -> 50 GB/s per GPU.
            internode_bytes_per_s=50 * GB,
            # PCIe Gen5 x16 to the host: 64 GB/s each way, as the Hopper profiles.
            host_bytes_per_s=64 * GB,
        ),
    }
)


def gpu(name: str) -> GPU:
    """The profile ``name`` of :data:`GPUS` (``KeyError`` lists the known ones)."""
    if name not in GPUS:
        raise KeyError(f"unknown GPU {name!r}; known: {sorted(GPUS)}")
    return GPUS[name]


def with_overrides(base: GPU, origin: str = "override", **changes: float | int | None) -> GPU:
    """``base`` with the fields in ``changes`` replaced, each recorded as coming from ``origin`` (what
    :meth:`GPU.entry` reports; default ``"override <field>"``); ``None`` values are ignored (unset CLI flags)."""
    set_ = {k: v for k, v in changes.items() if v is not None}
    why = {k: f"{origin} {k}={v:g}" for k, v in set_.items()}
    kept = tuple((k, v) for k, v in base.overrides if k not in set_)
    return dataclasses.replace(base, **set_, overrides=kept + tuple(why.items()))


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
