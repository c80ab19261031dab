"""Where a step's record goes: the progress line, a JSONL file, TensorBoard; and the MFU's FLOP rates.

A record is a flat dict per step (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``mfu``, the worst
``expert_imbalance`` and ``expert_imbalance_per_layer``, the memory figures, ``val_loss`` when evaluated,
``mtp_loss`` for a model with multi-token prediction: the main loss is ``loss`` alone).
The trainer's own sinks (progress, JSONL, TensorBoard) run on global rank 0; callbacks passed to
``Trainer(config, callbacks=...)`` run on every rank (the figures are already global). A callback is an object
with ``on_step`` and ``close``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from moe.plan import GPUS

__all__ = ["Callback", "JsonlWriter", "ProgressPrinter", "TensorBoardWriter", "peak_flops"]


class Callback(Protocol):
    def on_step(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    """One JSON line per step, appended and flushed (a restarted run appends its replayed steps again)."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a")  # noqa: SIM115 (held for the run, closed in close())

    def on_step(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter:
    """TensorBoard event files: every number of the record as a scalar (per-layer imbalance under
    ``expert_imbalance/layer_N``), at its step. Needs the ``tensorboard`` extra."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazily: tensorboard is an optional extra

        self._writer = SummaryWriter(log_dir=str(log_dir))

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
        print(
            f"step {step:5d}/{self.total}  loss {record['loss']:.4f}{mtp}{val}  lr {record['lr']:.2e}  "
            f"{record['tokens_per_s']:8.0f} tok/s  MFU {record['mfu']:6.2%}  "
            f"imbalance {record['expert_imbalance']:4.2f}  eta {eta:6.1f}s",
            flush=True,
        )

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
