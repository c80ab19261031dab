"""Where a step's record goes: the progress line, a JSONL file, TensorBoard; the MFU's FLOP rates; the host
syncs counted inside a step.

A record is a flat dict per step (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``mfu``, the worst
``expert_imbalance`` and ``expert_imbalance_per_layer``, the memory figures of moe.train.memory, the pre-flight
``memory_estimate_bytes`` beside them, ``val_loss`` when evaluated, ``mtp_loss`` for a model with multi-token
prediction: the main loss is ``loss`` alone; with ``metrics.sync_debug`` on CUDA, ``host_syncs`` and
``host_sync_sites``, this rank's: :class:`SyncDebug`).
The trainer's own sinks (progress, JSONL, TensorBoard) run on global rank 0; callbacks passed to
``Trainer(config, callbacks=...)`` run on every rank (the figures are already global). A callback is an object
with ``on_step`` and ``close``.
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from moe.plan import GPUS

__all__ = [
    "SYNC_WARNING",
    "Callback",
    "HostSyncs",
    "JsonlWriter",
    "ProgressPrinter",
    "SyncDebug",
    "TensorBoardWriter",
    "count_host_syncs",
    "drop_records_after",
    "format_bytes",
    "peak_flops",
]

GiB = 2**30


class Callback(Protocol):
    def on_step(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def format_bytes(n: float) -> str:
    """``12.3 MiB``: ``n`` bytes in the largest binary unit that keeps the number at 1 or more."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def drop_records_after(path: str | Path, step: int) -> None:
    """Rewrite the JSONL file ``path`` keeping its records of steps up to ``step``, atomically (a new file renamed
    over it): what a run resumed at ``step`` does before it appends its own. A line that does not parse (the
    torn last write of a killed run) goes too."""
    path = Path(path)
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass
    if len(kept) == len(lines):
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class JsonlWriter:
    """One JSON line per step, appended and flushed. ``resumed_at``: the step a resumed run starts after; the
    records past it (the interrupted run's steps, about to be run again) are dropped first."""

    def __init__(self, path: str | Path, resumed_at: int | None = None) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if resumed_at is not None:
            drop_records_after(path, resumed_at)
        self._file = open(path, "a")  # noqa: SIM115 (held for the run, closed in close())

    def on_step(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter:
    """TensorBoard event files: every number of the record as a scalar (per-layer imbalance under
    ``expert_imbalance/layer_N``), at its step. Needs the ``tensorboard`` extra. ``resumed_at``: the step a
    resumed run starts after; TensorBoard hides the events of later steps already in ``log_dir`` (a
    ``SummaryWriter`` ``purge_step``: the files are not rewritten, readers drop those events)."""

    def __init__(self, log_dir: str | Path, resumed_at: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazily: tensorboard is an optional extra

        purge = None if resumed_at is None else resumed_at + 1
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def on_step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key == "step":
                continue
            if key == "expert_imbalance_per_layer":
                for layer, v in value.items():
                    self._writer.add_scalar(f"expert_imbalance/layer_{layer}", v, step)
            elif isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class ProgressPrinter:
    """The progress line every ``log_every`` steps (and the first, the last and every evaluated one)."""

    def __init__(self, total_steps: int, log_every: int) -> None:
        self.total, self.every = total_steps, log_every
        self.first: int | None = None
        """The run's first step (a resumed run's is past 1): the first record's."""
        self._t0 = time.monotonic()

    def on_step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if self.first is None:
            self.first = step
        if not (step % self.every == 0 or step in (self.first, self.total) or "val_loss" in record):
            return
        done = step - self.first + 1
        eta = (time.monotonic() - self._t0) / done * (self.total - step)
        val = f"  val {record['val_loss']:.4f}" if "val_loss" in record else ""
        mtp = f"  mtp {record['mtp_loss']:.4f}" if "mtp_loss" in record else ""
        # the allocator's peak of the step beside the pre-flight estimate (CUDA), the host syncs (--sync-debug)
        peak = record.get("cuda_peak_allocated_bytes")
        memory = f"  mem {peak / GiB:.1f}/{record['memory_estimate_bytes'] / GiB:.1f} GiB" if peak is not None else ""
        syncs = f"  syncs {record['host_syncs']}" if "host_syncs" in record else ""
        print(
            f"step {step:5d}/{self.total}  loss {record['loss']:.4f}{mtp}{val}  lr {record['lr']:.2e}  "
            f"{record['tokens_per_s']:8.0f} tok/s  MFU {record['mfu']:6.2%}  "
            f"imbalance {record['expert_imbalance']:4.2f}{memory}{syncs}  eta {eta:6.1f}s",
            flush=True,
        )
        if record.get("host_sync_sites"):
            sites = ", ".join(f"{where} x{n}" for where, n in record["host_sync_sites"].items())
            print(f"  host syncs at step {step}: {sites}", flush=True)

    def close(self) -> None:
        pass


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one rank, where the figure comes from) for MFU.

    ``override_tflops`` if set; on CUDA the dense bf16 peak of the planner's profile whose name the device's
    name contains (H100, H800, H200...); otherwise a dense fp32 matmul measured now on this rank (CPU: what
    these cores reach under the same thread count, so MFU reads as a fraction of the achievable).
    """
    if override_tflops > 0:
        return override_tflops * 1e12, "metrics.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for key, gpu in GPUS.items():
            if key in name:
                return gpu.bf16_flops, f"{key} dense bf16 peak"
    return _measured_matmul_flops(device), "measured fp32 matmul"


def _measured_matmul_flops(device: torch.device, n: int = 512, reps: int = 5) -> float:
    """The fastest of ``reps`` timed ``n``-cube matmuls: ranks sharing cores slow some repetitions down, and a
    peak is what the hardware reaches when it is not interrupted."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / max(best, 1e-9)


SYNC_WARNING = "called a synchronizing CUDA operation"
"""The warning ``torch.cuda.set_sync_debug_mode("warn")`` gives for each op that makes the host wait for the device
(c10's ``warn_or_error_on_sync``: a blocking copy, ``item()``, a data-dependent size, a stream or event sync;
``torch.cuda.synchronize`` itself is not reported)."""

SYNC_SITES = 5
"""Call sites a step's record names (the first ones met)."""


@dataclass(frozen=True, slots=True)
class HostSyncs:
    """The host syncs of one step."""

    count: int
    sites: dict[str, int] = field(default_factory=dict)
    """``"file:line in function" -> syncs there``, the first :data:`SYNC_SITES` sites in the order they were met."""


def count_host_syncs(sites: Iterable[str], named: int = SYNC_SITES) -> HostSyncs:
    """The syncs at ``sites`` (one call site per sync, in order), the first ``named`` sites with their counts."""
    count, where = 0, {}
    for site in sites:
        count += 1
        if site in where or len(where) < named:
            where[site] = where.get(site, 0) + 1
    return HostSyncs(count, where)


_NOT_A_SITE = (f"{os.sep}torch{os.sep}", warnings.__file__, __file__)


def _call_site() -> str:
    """The innermost frame of the stack outside torch, the warnings module and this file: the line whose op made
    the host wait (for an op of autograd's backward, whose warnings torch replays when the backward returns: the
    line that ran the backward)."""
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in _NOT_A_SITE):
            path = os.path.relpath(frame.filename) if frame.filename.startswith(os.getcwd()) else frame.filename
            return f"{path}:{frame.lineno} in {frame.name}"
    return "?"


class SyncDebug:
    """Count the host syncs of a block on CUDA::

        with SyncDebug(device) as syncs:
            step()
        syncs.result  # HostSyncs

    Inside, ``torch.cuda.set_sync_debug_mode("warn")`` is on: torch issues :data:`SYNC_WARNING` as a Python warning
    for every op that syncs, and each is counted at its call site (:func:`_call_site`) instead of being shown;
    every other warning goes on to the caller's filters and display as before. On exit the previous mode, filters
    and display are back and ``result`` holds the count (:func:`count_host_syncs`). Off CUDA, or not ``enabled``,
    it does nothing and ``result`` stays None. Not re-entrant (warning filters are process-wide)."""

    def __init__(self, device: torch.device, *, enabled: bool = True) -> None:
        self.enabled = enabled and device.type == "cuda" and torch.cuda.is_available()
        self.result: HostSyncs | None = None
        self._catch: warnings.catch_warnings | None = None
        self._sites: list[str] = []
        self._mode = 0

    def __enter__(self) -> SyncDebug:
        if not self.enabled:
            return self
        self._catch = warnings.catch_warnings()  # restores the filters and warnings.showwarning on exit
        self._catch.__enter__()
        warnings.filterwarnings("always", message=re.escape(SYNC_WARNING))  # each sync, not once per site
        show = warnings.showwarning

        def count_or_show(message, category, filename, lineno, file=None, line=None) -> None:
            if SYNC_WARNING in str(message):
                self._sites.append(_call_site())
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = count_or_show
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._catch is None:
            return
        torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc)
        self._catch = None
        self.result = count_host_syncs(self._sites)
