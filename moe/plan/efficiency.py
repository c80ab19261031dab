"""What each GPU achieves, entry by entry, each with its published source: the planner's efficiency table.

One table per device profile (:data:`TABLES`, read by :mod:`moe.plan.hardware`). An entry is a :class:`Cited`:
its value, its unit, and a source that names where the number was published, the number as published and how
the value was derived from it. Where no number is published for a device, the entry says so and derives it
from a cited one (e.g. the H800 computes as the H100: the same die); nothing here was chosen by comparing a
prediction with a training run. Keys (:data:`KEYS`):

- ``gemm.<precision>.<shape>``: achieved fraction of the device's dense peak for ``bf16`` or ``fp8`` GEMMs of
  shape class ``dense`` (one large GEMM), ``grouped`` (the experts' grouped GEMM) or ``small_m`` (at most
  :data:`SMALL_M` rows per GEMM or group; :func:`moe.plan.flops.shape_class`);
- ``attention.fwd`` / ``attention.bwd``: fused causal attention, fraction of the bf16 peak (FLOPs counted as
  :mod:`moe.plan.flops` counts them: the causal half, backward 2.5 x forward, as FlashAttention's benchmarks do);
- ``deepep.<intranode|internode>.<dispatch|combine>``: DeepEP's normal kernels, bytes/s per GPU one direction
  on the bytes :func:`moe.plan.costs.all_to_all_bytes` counts (NVLink inside a node, RDMA between), at the
  entry's ``sms``;
- ``nccl.allreduce.intranode``: all-reduce bus bandwidth inside a node; ``nccl.allreduce.internode``: per GPU
  and its NIC across nodes (:func:`moe.plan.costs.allreduce_busbw`); ``nccl.p2p.<intranode|internode>``: one
  GPU's send to a pipeline neighbour, bytes/s;
- ``launch``: one kernel's launch latency, and ``host``: the host's time per op, seconds. Listed, not yet
  applied by :func:`moe.plan.costs.op_seconds`: the host runs ahead of the GPU, and what host work costs per
  piece is the calibration's to measure (``bench.overlap --calibrate``).

Entries are data; :func:`moe.plan.hardware.GPU.entry` says where a plan's value came from (cited, an override
flag, a costs file), and ``moe.plan --explain`` prints the ones a plan used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["KEYS", "SMALL_M", "TABLES", "Cited", "flop_weighted"]

GB = 1e9
TB = 1e12

SMALL_M = 512
"""Rows per GEMM (per group for a grouped GEMM) at or under which a GEMM is ``small_m``: DeepGEMM's published
grouped rows (below) run 932-1,346 TFLOPS at 4,096-8,192 rows a group, 815-1,040 at 256-512."""

KEYS = (
    *(f"gemm.{p}.{s}" for p in ("bf16", "fp8") for s in ("dense", "grouped", "small_m")),
    "attention.fwd",
    "attention.bwd",
    *(f"deepep.{where}.{way}" for where in ("intranode", "internode") for way in ("dispatch", "combine")),
    "nccl.allreduce.intranode",
    "nccl.allreduce.internode",
    "nccl.p2p.intranode",
    "nccl.p2p.internode",
    "launch",
    "host",
)
"""Every entry a device's table holds."""

UNITS = {"gemm": "of peak", "attention": "of bf16 peak", "deepep": "B/s", "nccl": "B/s", "launch": "s", "host": "s"}


@dataclass(frozen=True, slots=True)
class Cited:
    """One published (or derived-from-published) figure."""

    value: float
    source: str
    """Where it was published, the number as published, and how ``value`` follows from it."""
    sms: int | None = None
    """The SMs the measurement ran its kernels on (DeepEP's entries)."""

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise ValueError(f"an efficiency entry of {self.value} has no source")
        if not self.value > 0:
            raise ValueError(f"an efficiency entry must be positive, got {self.value} ({self.source})")


def flop_weighted(rows: Sequence[tuple[float, int, int, float]], peak_tflops: float) -> float:
    """The fraction of ``peak_tflops`` a set of published GEMMs ``(M, N, K, TFLOPS)`` achieves together: their
    FLOPs over the seconds they take at their published rates (a FLOP-weighted harmonic mean)."""
    flops = [2.0 * m * n * k for m, n, k, _ in rows]
    seconds = sum(f / (rate * TB) for f, (*_, rate) in zip(flops, rows))
    return sum(flops) / seconds / (peak_tflops * TB)


# DeepGEMM README at deepseek-ai/DeepGEMM@55ab91f72f76e8a6db0e86282c3169a88d93df1b (2025-03-25, the last README
# with its performance tables), "tested on H800 SXM5 with NVCC 12.8" at DeepSeek-V3's shapes: FP8 with 1x128 /
# 128x128 scaling, as moe.plan.flops times FP8 GEMMs. Rows (M, N, K, TFLOPS as published).
_DG = "DeepGEMM README@55ab91f (2025-03-25), H800 SXM5"
DEEPGEMM_DENSE = ((4096, 2112, 7168, 1009), (4096, 24576, 1536, 1125), (4096, 32768, 512, 751),
                  (4096, 7168, 16384, 1426), (4096, 4096, 7168, 1265), (4096, 7168, 2048, 1168))  # fmt: skip
"""'Normal GEMMs for dense models', the M = 4096 rows (a training micro-batch of 4,096 tokens)."""
DEEPGEMM_GROUPED = ((32768, 4096, 7168, 1346), (32768, 7168, 2048, 1214),
                    (32768, 4096, 7168, 1346), (32768, 7168, 2048, 1214))  # fmt: skip
"""'Grouped GEMMs (contiguous layout)': 4 groups x 8,192 and 8 x 4,096 rows (M here: all groups)."""
DEEPGEMM_SMALL = ((1024, 4096, 7168, 1040), (1024, 7168, 2048, 916), (1024, 4096, 7168, 932),
                  (1024, 7168, 2048, 815))  # fmt: skip
"""'Grouped GEMMs (masked layout)': 2 groups x 512 and 4 x 256 rows (M here: all groups)."""
_H100_FP8_PEAK = 1979.0  # dense FP8 TFLOPS, H100/H800 SXM datasheet (3,958 with sparsity)
_H100_BF16_PEAK = 989.4

_FP8 = {
    "dense": Cited(
        flop_weighted(DEEPGEMM_DENSE, _H100_FP8_PEAK),
        f"{_DG}, 'Normal GEMMs for dense models' at M=4096: 1009, 1125, 751, 1426, 1265, 1168 TFLOPS for V3's six "
        "(N, K); their FLOPs over their summed seconds (1,223 TFLOPS) / 1,979 dense FP8 peak",
    ),
    "grouped": Cited(
        flop_weighted(DEEPGEMM_GROUPED, _H100_FP8_PEAK),
        f"{_DG}, 'Grouped GEMMs (contiguous layout)', 4 x 8192 and 8 x 4096 rows: 1346 TFLOPS (N=4096, K=7168) and "
        "1214 (N=7168, K=2048); FLOP-weighted (1,299 TFLOPS) / 1,979 dense FP8 peak",
    ),
    "small_m": Cited(
        flop_weighted(DEEPGEMM_SMALL, _H100_FP8_PEAK),
        f"{_DG}, 'Grouped GEMMs (masked layout)', 2 x 512 and 4 x 256 rows: 1040, 916, 932, 815 TFLOPS; "
        "FLOP-weighted (939 TFLOPS) / 1,979 dense FP8 peak",
    ),
}
_BF16 = {
    shape: Cited(
        c.value,
        f"no bf16 table at V3's shapes is published (DeepGEMM's bf16 kernels came later, without one): taken as the "
        f"FP8 fraction of the same shape class, derived from: {c.source}. The same WGMMA pipeline without FP8's "
        "scale promotion, so not below it",
    )
    for shape, c in _FP8.items()
}
# FlashAttention-3 paper (Shah et al., arXiv 2407.08608), H100 80GB SXM5, head dim 128, BF16/FP16, seqlen 4k.
_FA3_FWD_CAUSAL, _FA3_FWD_FULL, _FA3_BWD_FULL = 579.0, 638.0, 542.0
_ATTENTION = {
    "attention.fwd": Cited(
        _FA3_FWD_CAUSAL / _H100_BF16_PEAK,
        "FlashAttention-3 paper (arXiv 2407.08608) Figure 5, 'Attention forward speed, with causal mask, head dim "
        "128 (H100 80GB SXM5)': FlashAttention-3 579 TFLOPS at seqlen 4k / 989.4 dense bf16 peak (MLA's 192-wide "
        "head is timed at this head-128 figure)",
    ),
    "attention.bwd": Cited(
        _FA3_BWD_FULL * (_FA3_FWD_CAUSAL / _FA3_FWD_FULL) / _H100_BF16_PEAK,
        "FlashAttention-3 paper Figure 6, 'Attention backward speed, head dim 128 (H100 80GB SXM5)': 542 TFLOPS at "
        "4k without causal mask; no causal backward is published, so x the forward's causal/non-causal ratio at 4k "
        "(579 / 638) = 492 TFLOPS / 989.4 dense bf16 peak",
    ),
}
# DeepEP's normal kernels, V1 (docs/legacy.md at deepseek-ai/DeepEP@dd758ca, the README's table before V2): H800,
# "~160 GB/s NVLink", CX7 400 Gb/s ("~50 GB/s"), V3's pre-training setting (4096 tokens, 7168 hidden, top-8,
# FP8 dispatch, BF16 combine), "bottleneck bandwidth". tests/test_intranode.py and test_internode.py run 24 SMs.
_DEEPEP_V1 = "DeepEP docs/legacy.md@dd758ca (V1 normal kernels on H800, 24 SMs as its tests run them)"
_INTERNODE = {
    "deepep.internode.dispatch": Cited(
        51 * GB, f"{_DEEPEP_V1}: internode EP64 dispatch 51 GB/s (RDMA), V3's EP (EP16 43, EP32 58)", sms=24
    ),
    "deepep.internode.combine": Cited(
        50 * GB, f"{_DEEPEP_V1}: internode EP64 combine 50 GB/s (RDMA), V3's EP (EP16 43, EP32 57)", sms=24
    ),
}
_NIC = {
    # One ConnectX-7 400 Gb/s per GPU on every profile here (hardware.py); a ring across nodes with r ranks per node
    # sends through r NICs at once.
    "nccl.allreduce.internode": Cited(
        50 * GB,
        "Saturn Cloud, 'Validating Multi-Node GPU Clusters with NCCL Tests': all_reduce_perf bus bandwidth 400-450 "
        "GB/s expected for H100 and H200 SXM with NVLink + IB NDR (8 GPUs and 8 NICs a node) -> 400 / 8 = 50 GB/s "
        "per GPU and its NIC (the low end)",
    ),
    "nccl.p2p.internode": Cited(
        50 * GB,
        "DeepEP README (V1, H800): a CX7 400 Gb/s RDMA NIC, '~50 GB/s maximum bandwidth'; one NIC per GPU",
    ),
}
_LAUNCH = {
    "launch": Cited(
        5e-6,
        "susun-blog 'pegainfer (3): From Launch Overhead to CUDA Graph': a kernel launch's driver and runtime calls "
        "take 'about 4-6 us' (CUDA 13); a host-side cost, the same for every device here: the middle, 5 us",
    ),
    "host": Cited(
        5e-6,
        "no published per-op host time for this runtime (bench.overlap --calibrate measures it on the emulated "
        "cluster): taken equal to the launch latency, the least an eager op costs the host",
    ),
}


def _hopper(nvlink: dict[str, Cited]) -> dict[str, Cited]:
    """A Hopper table: DeepGEMM's and FlashAttention-3's fractions, the links given."""
    table = {f"gemm.fp8.{s}": c for s, c in _FP8.items()}
    table |= {f"gemm.bf16.{s}": c for s, c in _BF16.items()}
    return {**table, **_ATTENTION, **_INTERNODE, **_NIC, **_LAUNCH, **nvlink}


def _derived(why: str, prefixes: tuple[str, ...]) -> dict[str, Cited]:
    """The H100 table's compute entries starting with ``prefixes``, each source prefixed by ``why``."""
    return {k: Cited(c.value, f"{why} {c.source}") for k, c in _hopper({}).items() if k.startswith(prefixes)}


_H20_ISSUE = (
    "DeepEP issue #16: its intranode test on H20 (NVLink 4, 900 GB/s both ways, as the H100 and H200) reached "
    "337.35 GB/s; one figure for both directions, the SMs not stated (the test's 24)"
)
_H100_LINKS = {
    "deepep.intranode.dispatch": Cited(337 * GB, _H20_ISSUE, sms=24),
    "deepep.intranode.combine": Cited(337 * GB, _H20_ISSUE, sms=24),
    "nccl.allreduce.intranode": Cited(
        460 * GB,
        "alayanew tech blog 'NCCL-tests in practice' (2026-05-06): 8 x H100 SXM5 NVLink-only all_reduce_perf "
        "busbw 460-480 GB/s at large sizes; the low end",
    ),
    "nccl.p2p.intranode": Cited(
        380 * GB,
        "NVIDIA/nccl issue #1264: p2pBandwidthLatencyTest on HGX H100 SXM, unidirectional ~380 GB/s of 450",
    ),
}
_H800_LINKS = {
    "deepep.intranode.dispatch": Cited(153 * GB, f"{_DEEPEP_V1}: intranode EP8 dispatch 153 GB/s (NVLink)", sms=24),
    "deepep.intranode.combine": Cited(158 * GB, f"{_DEEPEP_V1}: intranode EP8 combine 158 GB/s (NVLink)", sms=24),
    "nccl.allreduce.intranode": Cited(
        160 * GB,
        "no nccl-tests figure for H800 is published: the DeepSeek-V3 report (3.2.2) measures NVLink at 160 GB/s "
        "(one direction, its authors in deepseek-ai/DeepSeek-V3 issue #28), which bounds a ring's bus bandwidth",
    ),
    "nccl.p2p.intranode": Cited(160 * GB, "DeepSeek-V3 report 3.2.2: NVLink 160 GB/s, measured one way (issue #28)"),
}
_B200_SCALE = "B200's NVLink 5 (1.8 TB/s both ways) over Hopper's NVLink 4 (900 GB/s): x 2"
_B200 = {
    **_derived(
        "no B200 figure published: the Hopper fraction of the device's own peak, from:", ("gemm.", "attention.")
    ),
    **_INTERNODE,  # DGX B200: the same ConnectX-7 400 Gb/s per GPU
    **_NIC,
    **_LAUNCH,
    # DeepEP README@dd758ca (V2): SM100 EP8 643 GB/s dispatch, 675 combine (NVLink) at 24 SMs, "logical bandwidth"
    # that counts the local rank's rows; our bytes leave that 1/8 out -> x 7/8.
    "deepep.intranode.dispatch": Cited(
        643 * GB * 7 / 8,
        "DeepEP README@dd758ca (V2): SM100 EP8 dispatch 643 GB/s (NVLink) at 24 SMs, logical (the local rank's "
        "rows counted); the planner's bytes exclude that 1/8: x 7/8",
        sms=24,
    ),
    "deepep.intranode.combine": Cited(
        675 * GB * 7 / 8,
        "DeepEP README@dd758ca (V2): SM100 EP8 combine 675 GB/s (NVLink) at 24 SMs, logical; x 7/8 as dispatch",
        sms=24,
    ),
    "nccl.allreduce.intranode": Cited(
        920 * GB, f"no B200 nccl-tests figure found: H100's 460 GB/s (alayanew blog) x 2, {_B200_SCALE}"
    ),
    "nccl.p2p.intranode": Cited(
        760 * GB, f"no B200 figure found: H100's 380 GB/s (NVIDIA/nccl #1264) x 2, {_B200_SCALE}"
    ),
}


def _nic_of(device: str) -> dict[str, Cited]:
    """The NIC entries for a device whose nodes carry the same ConnectX-7 400 Gb/s per GPU as the H100's."""
    why = f"{device}: one ConnectX-7 400 Gb/s per GPU, as the H100 and H200 nodes measured; "
    cited = _NIC["nccl.allreduce.internode"]
    return {"nccl.allreduce.internode": Cited(cited.value, why + cited.source)}


TABLES: Mapping[str, Mapping[str, Cited]] = MappingProxyType(
    {
        "h100": MappingProxyType(_hopper(_H100_LINKS)),
        "h200": MappingProxyType(
            {
                k: Cited(c.value, f"H200 = H100 compute and NVLink 4 (NVIDIA H200 datasheet); {c.source}", c.sms)
                for k, c in _hopper(_H100_LINKS).items()
            }
        ),
        "h800": MappingProxyType(
            {
                **_derived("H800 = H100 compute (the same die, NVIDIA H800 product brief);", ("attention.",)),
                **{k: c for k, c in _hopper(_H800_LINKS).items() if not k.startswith("attention.")},
                **_nic_of("H800"),
            }
        ),
        "b200": MappingProxyType({**_B200, **_nic_of("B200")}),
    }
)
