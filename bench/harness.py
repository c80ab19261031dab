"""One benchmark harness for every benchmark of the project.

Each measurement: warm-up calls (compilation, autotuning, allocator and handle creation stay out of the
numbers), then timed repeats and their median. Rates come from explicit formulas the caller passes in
(FLOPs and the fewest bytes the op must move), never from a profiler's guess, and each op is compared
with baseline rows measured in the same run on the same device: ratios, not absolute numbers, are what
carries between machines. Results are saved as JSON to ``<out>/<name>-<device>-<YYYY-MM-DD>.json``.

On CUDA the repeats are timed with CUDA events around each call; elsewhere with a host clock (CPU work is
synchronous).
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["Bench", "Row", "device_slug", "time_ms"]


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def device_slug(device: torch.device) -> str:
    """A file-name-safe device name: 'nvidia-h100-80gb-hbm3', 'cpu'."""
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return device.type


@dataclass(kw_only=True, slots=True)
class Row:
    """One measured implementation of one op at one shape."""

    op: str
    """What is computed, e.g. 'grouped_gemm'."""
    impl: str
    """Who computes it, e.g. 'ops[triton]', 'reference', 'torch._grouped_mm'."""
    shape: str
    """The shape label of the case, e.g. 'E8 T4096 D7168 F2048'."""
    ms: float
    """Median time of one call."""
    ms_min: float
    ms_max: float
    flops: float | None = None
    """Floating-point operations of one call (None for memory-bound ops)."""
    bytes: float | None = None
    """Fewest bytes one call must move through device memory: inputs read once, outputs written once."""
    baseline: bool = False
    """A reference point (dense matmul, copy) rather than an implementation of the op."""
    ratios: dict[str, float] = field(default_factory=dict)
    """Named ratios against other rows of the same run, filled by :meth:`Bench.compare`."""

    @property
    def tflops(self) -> float | None:
        return None if self.flops is None else self.flops / (self.ms * 1e-3) / 1e12

    @property
    def gbps(self) -> float | None:
        return None if self.bytes is None else self.bytes / (self.ms * 1e-3) / 1e9

    def to_json(self) -> dict:
        return {**asdict(self), "tflops": self.tflops, "gbps": self.gbps}


class Bench:
    """Collects rows of one benchmark run on one device, compares them, prints and saves them."""

    def __init__(self, name: str, device: torch.device, *, warmup: int = 10, repeats: int = 50) -> None:
        self.name = name
        self.device = torch.device(device)
        self.warmup = warmup
        self.repeats = repeats
        self.rows: list[Row] = []
        self.notes: list[str] = []

    def measure(
        self,
        op: str,
        impl: str,
        shape: str,
        fn: Callable[[], object],
        *,
        flops: float | None = None,
        bytes: float | None = None,
        baseline: bool = False,
    ) -> Row:
        """Time ``fn`` (warm-up, then the median of the repeats) and record it as a row."""
        times = time_ms(fn, self.device, warmup=self.warmup, repeats=self.repeats)
        row = Row(
            op=op, impl=impl, shape=shape, ms=statistics.median(times), ms_min=min(times), ms_max=max(times),
            flops=flops, bytes=bytes, baseline=baseline,
        )  # fmt: skip
        self.rows.append(row)
        return row

    @staticmethod
    def compare(row: Row, other: Row, name: str, metric: str = "time") -> float:
        """Record row's ratio to other under ``name``: 'time' is other.ms / row.ms (> 1: row is faster);
        'tflops' and 'gbps' are row's rate over other's rate."""
        if metric == "time":
            ratio = other.ms / row.ms
        elif metric in ("tflops", "gbps"):
            ratio = getattr(row, metric) / getattr(other, metric)
        else:
            raise ValueError(f"metric {metric!r} is not one of time, tflops, gbps")
        row.ratios[name] = ratio
        return ratio

    def table(self) -> str:
        """A fixed-width table of all rows, baselines marked with '*'."""
        header = f"{'op':<22} {'impl':<24} {'shape':<30} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>8}  ratios"
        lines = [header, "-" * len(header)]
        for r in self.rows:
            tflops = f"{r.tflops:8.1f}" if r.tflops is not None else f"{'':8}"
            gbps = f"{r.gbps:8.1f}" if r.gbps is not None else f"{'':8}"
            ratios = "  ".join(f"{k}={v:.2f}" for k, v in r.ratios.items())
            impl = r.impl + ("*" if r.baseline else "")
            lines.append(f"{r.op:<22} {impl:<24} {r.shape:<30} {r.ms:9.3f} {tflops} {gbps}  {ratios}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def save(self, out_dir: str | Path, *, extra: dict | None = None) -> Path:
        """Write all rows and the run's context to ``<out_dir>/<name>-<device>-<YYYY-MM-DD>.json``."""
        today = datetime.date.today().isoformat()
        path = Path(out_dir) / f"{self.name}-{device_slug(self.device)}-{today}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "name": self.name,
            "device": device_slug(self.device),
            "date": today,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "warmup": self.warmup,
            "repeats": self.repeats,
            "rows": [r.to_json() for r in self.rows],
            "notes": self.notes,
            **(extra or {}),
        }
        path.write_text(json.dumps(record, indent=2) + "\n")
        return path
