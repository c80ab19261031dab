"""One benchmark harness for every benchmark of the project.

Each measurement: warm-up calls (compilation, autotuning, allocator and handle creation stay out of the
numbers), then timed repeats and their median. Rates come from explicit formulas the caller passes in
(FLOPs and the fewest bytes the op must move), never from a profiler's guess, and each op is compared
with baseline rows measured in the same run on the same device: ratios, not absolute numbers, are what
carries between machines. Results are saved as JSON to ``<out>/<name>-<device>-<YYYY-MM-DD>.json``.

On CUDA the repeats are timed with CUDA events around each call; elsewhere with a host clock (CPU work is
synchronous).

Cold inputs: a measurement given its function's arguments (``measure(..., args=...)``) cycles through copies
of them (:func:`rotation`), enough that the bytes one call's copy and result take, times the other copies,
exceed the device's L2 cache: no call finds its inputs in L2, as a kernel inside a training step would not.

Checked outputs: :func:`check_close` compares an output with its reference (relative norm and largest
element error against :class:`Tolerance`, integers exactly), and a row carries the :class:`Check` it passed;
a row whose check failed is recorded untimed (``ms`` None) by :meth:`Bench.untimed`.
"""

from __future__ import annotations

import datetime
import itertools
import json
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = [
    "Bench",
    "Check",
    "Row",
    "Tolerance",
    "check_close",
    "copies_for",
    "device_slug",
    "l2_bytes",
    "rotation",
    "tensor_bytes",
    "time_ms",
]


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


# Every Hopper part this project targets (H100, H800, H200) has a 50 MB L2; used when torch does not report it.
_HOPPER_L2_BYTES = 50 * 2**20
# Off CUDA there is no L2 to outrun worth the memory: two copies still keep a call from reusing its own inputs.
_HOST_COPIES = 2


def l2_bytes(device: torch.device) -> int:
    """The L2 cache of a CUDA device in bytes (torch's ``L2_cache_size``, else Hopper's 50 MB); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or _HOPPER_L2_BYTES)


def tensor_bytes(value: object) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or tuples, lists and dicts of them; anything else is 0)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def copies_for(l2: int, touched: int) -> int:
    """Copies of a call's inputs such that between two uses of one copy the other copies' calls touch more than
    ``l2`` bytes, each call touching ``touched`` (its inputs and its result): ``(copies - 1) * touched > l2``.
    At least 2, so the memory held is at most ``2 * inputs + l2``."""
    return 2 + l2 // max(touched, 1)


def rotation(fn: Callable[..., object], args: tuple, device: torch.device) -> Callable[[], object]:
    """A zero-argument call of ``fn`` on the next of several copies of ``args`` (tensors cloned with their strides,
    anything else shared): :func:`copies_for` the device's L2 on CUDA, sized by one call made here; two elsewhere."""
    if device.type == "cuda":
        copies = copies_for(l2_bytes(device), tensor_bytes(args) + tensor_bytes(fn(*args)))
    else:
        copies = _HOST_COPIES
    sets = [args, *(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args) for _ in range(copies - 1))]
    cycle = itertools.cycle(sets)
    return lambda: fn(*next(cycle))


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerance:
    """How far a floating output may be from its reference."""

    norm: float
    """Bound on ``||out - ref|| / ||ref||``: errors spread over the whole output."""
    peak: float
    """Bound on ``max |out - ref| / max |ref|``: one wrong tile or row, which the norm of a large output hides."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """The outcome of comparing an output with its reference."""

    passed: bool
    detail: str
    """What was compared and found: the errors and their bounds, or the first difference."""


def _floating_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative norm, peak over max |ref|) of out - ref, in float32 on the tensors' device."""
    diff = out.float() - ref.float()
    ref_norm, ref_max = ref.float().norm().item(), ref.float().abs().max().item()
    norm, peak = diff.norm().item(), diff.abs().max().item()
    return norm / ref_norm if ref_norm > 0 else norm, peak / ref_max if ref_max > 0 else peak


def check_close(out: object, ref: object, tolerance: Callable[[torch.dtype], Tolerance]) -> Check:
    """Compare ``out`` with ``ref``: tensors or (nested) tuples of them, element by element. Shapes and dtypes must
    agree; integer and boolean tensors must be equal; floating ones finite and within ``tolerance(dtype)``."""
    outs, refs = _flatten(out), _flatten(ref)
    if len(outs) != len(refs):
        return Check(passed=False, detail=f"{len(outs)} outputs, the reference has {len(refs)}")
    details = []
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        name = f"output {i}" if len(outs) > 1 else "output"
        if o.shape != r.shape or o.dtype != r.dtype:
            found = f"{name}: {o.dtype} {tuple(o.shape)}, reference {r.dtype} {tuple(r.shape)}"
            return Check(passed=False, detail=found)
        if o.numel() == 0:
            details.append(f"{name} empty")
            continue
        if not o.is_floating_point():
            wrong = int((o != r).sum().item())
            if wrong:
                return Check(passed=False, detail=f"{name}: {wrong} of {o.numel()} {o.dtype} values differ")
            details.append(f"{name} equal")
            continue
        if not bool(torch.isfinite(o).all()) and bool(torch.isfinite(r).all()):
            return Check(passed=False, detail=f"{name}: non-finite values (an unwritten output?)")
        tol = tolerance(o.dtype)
        norm, peak = _floating_error(o, r)
        text = f"{name} rel {norm:.2e} (<= {tol.norm:.0e}) peak {peak:.2e} (<= {tol.peak:.0e})"
        if not (norm <= tol.norm and peak <= tol.peak):
            return Check(passed=False, detail=text)
        details.append(text)
    return Check(passed=True, detail="; ".join(details))


def _flatten(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flatten(v)]
    raise TypeError(f"cannot compare a {type(value).__name__}: expected tensors or tuples of them")


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
    ms: float | None
    """Median time of one call; None for a row that was not timed (its check failed, or the run only checks)."""
    ms_min: float | None
    ms_max: float | None
    flops: float | None = None
    """Floating-point operations of one call (None for memory-bound ops)."""
    bytes: float | None = None
    """Fewest bytes one call must move through device memory: inputs read once, outputs written once."""
    baseline: bool = False
    """A reference point (dense matmul, copy) rather than an implementation of the op."""
    ratios: dict[str, float] = field(default_factory=dict)
    """Named ratios against other rows of the same run, filled by :meth:`Bench.compare`."""
    check: Check | None = None
    """The output's comparison with its reference before timing; None for a row that has no reference (a
    baseline, or the reference itself)."""

    @property
    def tflops(self) -> float | None:
        return None if self.flops is None or self.ms is None else self.flops / (self.ms * 1e-3) / 1e12

    @property
    def gbps(self) -> float | None:
        return None if self.bytes is None or self.ms is None else self.bytes / (self.ms * 1e-3) / 1e9

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
        fn: Callable[..., object],
        *,
        args: tuple | None = None,
        flops: float | None = None,
        bytes: float | None = None,
        baseline: bool = False,
        check: Check | None = None,
    ) -> Row:
        """Time ``fn`` (warm-up, then the median of the repeats) and record it as a row.

        args: None to time ``fn()``; else ``fn(*args)`` on rotated copies of args (:func:`rotation`), so that the
        L2 cache holds none of them when a call starts. check: what the output's comparison found, kept with the row.
        """
        call = fn if args is None else rotation(fn, args, self.device)
        times = time_ms(call, self.device, warmup=self.warmup, repeats=self.repeats)
        row = Row(
            op=op, impl=impl, shape=shape, ms=statistics.median(times), ms_min=min(times), ms_max=max(times),
            flops=flops, bytes=bytes, baseline=baseline, check=check,
        )  # fmt: skip
        self.rows.append(row)
        return row

    def untimed(self, op: str, impl: str, shape: str, check: Check) -> Row:
        """Record a row that was checked and not timed: its output failed ``check``, or the run only checks."""
        row = Row(op=op, impl=impl, shape=shape, ms=None, ms_min=None, ms_max=None, check=check)
        self.rows.append(row)
        return row

    @staticmethod
    def compare(row: Row, other: Row, name: str, metric: str = "time") -> float | None:
        """Record row's ratio to other under ``name``: 'time' is other.ms / row.ms (> 1: row is faster);
        'tflops' and 'gbps' are row's rate over other's rate. None (nothing recorded) when either row is untimed."""
        if metric not in ("time", "tflops", "gbps"):
            raise ValueError(f"metric {metric!r} is not one of time, tflops, gbps")
        if row.ms is None or other.ms is None:
            return None
        if metric == "time":
            ratio = other.ms / row.ms
        else:
            ratio = getattr(row, metric) / getattr(other, metric)
        row.ratios[name] = ratio
        return ratio

    def table(self) -> str:
        """A fixed-width table of all rows, baselines marked with '*', the check column 'ok', 'FAIL' or '-' (none);
        a failed row's reason follows the table."""
        header = f"{'op':<22} {'impl':<28} {'shape':<30} {'check':>5} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>8}  ratios"
        lines, failed = [header, "-" * len(header)], []
        for r in self.rows:
            tflops = f"{r.tflops:8.1f}" if r.tflops is not None else f"{'':8}"
            gbps = f"{r.gbps:8.1f}" if r.gbps is not None else f"{'':8}"
            ms = f"{r.ms:9.3f}" if r.ms is not None else f"{'-':>9}"
            check = "-" if r.check is None else "ok" if r.check.passed else "FAIL"
            ratios = "  ".join(f"{k}={v:.2f}" for k, v in r.ratios.items())
            impl = r.impl + ("*" if r.baseline else "")
            lines.append(f"{r.op:<22} {impl:<28} {r.shape:<30} {check:>5} {ms} {tflops} {gbps}  {ratios}")
            if r.check is not None and not r.check.passed:
                failed.append(f"FAIL: {r.op} {r.impl} {r.shape}: {r.check.detail}")
        return "\n".join(lines + failed + [f"note: {n}" for n in self.notes])

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
