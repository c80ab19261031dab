"""The training job's configuration: one dataclass per table of the TOML file, validated once, on construction.

A job is a :class:`TrainConfig`, composed of sections that each own one concern::

    [model]        a preset by name and any MoEConfig field over it      (moe.models.config.MoEConfig)
    [parallel]     (pp, dp, ep), schedule, micro-batches, dispatcher     (moe.parallel.ParallelConfig)
    [optimizer]    update rule and its hyper-parameters, ZeRO, clipping  (OptimizerConfig)
    [lr_schedule]  warm-up and decay                                     (LRScheduleConfig)
    [data]         token files or a weighted blend                       (DataConfig)
    [training]     steps, batch shape, precision, validation             (TrainingConfig)
    [checkpoint]   where and how often, resuming                         (CheckpointConfig)
    [metrics]      JSONL, TensorBoard, progress, MFU                     (MetricsConfig)
    [fault]        timeouts, the non-finite guard, failure drills        (FaultConfig)

Every field is documented once, by the docstring under it; :mod:`moe.train.cli` turns the fields into
command-line flags and the TOML file (``--config``, ``--print-config``). Each section checks its own fields in
``__post_init__``; :class:`TrainConfig` checks the rules that span sections (experts over ep, layers over
stages, checkpoint flags). Every failure is a :class:`ConfigError`: one line naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe.command import did_you_mean
from moe.dispatch import DISPATCHERS, Launch
from moe.models.config import PRESETS, MoEConfig
from moe.parallel import ParallelConfig
from moe.train.lr import LR_SCHEDULES
from moe.train.optimizer import OPTIMIZERS, STATE_DTYPES

__all__ = [
    "DTYPES",
    "SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "FaultConfig",
    "LRScheduleConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainConfig",
    "TrainingConfig",
]

DTYPES = ("float32", "bfloat16")
"""Compute dtypes the trainer runs (``training.dtype``)."""
TOKEN_DTYPES = ("uint16", "uint32")
"""Element types of a raw ``.bin`` token file (``data.dtype``)."""


class ConfigError(ValueError):
    """A value the user set is out of range or inconsistent; the message is one line naming the field."""


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{name} = {value!r}: {rule}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The model: a preset of :data:`moe.models.config.PRESETS`, or a Hugging Face checkpoint directory (its
    config.json and weights), with any :class:`moe.models.config.MoEConfig` field set over it (in the file, the
    ``[model]`` table holds ``name`` and those fields)."""

    name: str = "tiny"
    """A preset, or a Hugging Face checkpoint directory whose weights the run starts from (``--model``;
    ``--preset`` is the old name)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """MoEConfig fields set over the preset (``vocab_size = 70000``)."""
    _built: MoEConfig | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _require(self.name in PRESETS or self.checkpoint is not None, "model.name", self.name, self._not_a_model())
        known = {f.name for f in dataclasses.fields(MoEConfig)}
        unknown = sorted(set(self.overrides) - known)
        _require(not unknown, "model", unknown, "not fields of MoEConfig")
        try:
            self._built = self._resolve()
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None

    @property
    def checkpoint(self) -> Path | None:
        """The Hugging Face checkpoint directory ``name`` points at, if it is one."""
        path = Path(self.name)
        return path if self.name not in PRESETS and (path / "config.json").is_file() else None

    def _not_a_model(self) -> str:
        """Why ``name`` is neither a preset nor a Hugging Face directory: the nearest preset for a bare word, what
        :func:`moe.train.checkpoint.model_source` finds for a path."""
        path = Path(self.name)
        if not path.exists() and "/" not in self.name and os.sep not in self.name and self.name[:1] not in ".~":
            near = did_you_mean(self.name, PRESETS)
            return f"choose one of {tuple(PRESETS)} or a Hugging Face directory{near}"
        from moe.train.checkpoint import CheckpointError, model_source

        try:
            source = model_source(path, checksums=False)
        except CheckpointError as exc:
            return str(exc)
        return (
            f"one of our checkpoints ({source.path}): resume it with --ckpt-dir and --resume, or start from it as "
            "a Hugging Face directory made by python -m moe.convert"
        )

    def build(self) -> MoEConfig:
        """The resolved, validated model configuration (resolved once, on construction: a checkpoint's
        config.json is read there, not on every call)."""
        assert self._built is not None
        return self._built

    def _resolve(self) -> MoEConfig:
        if self.checkpoint is not None:
            from moe.hf import read_hf_config  # the hf package only for checkpoint directories

            return read_hf_config(self.checkpoint).replace(**self.overrides)
        return PRESETS[self.name].replace(**self.overrides)


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The update rule (:data:`moe.optim_state.OPTIMIZERS`) and what every rule shares."""

    name: str = "adamw"
    """Update rule, a name of moe.optim_state.OPTIMIZERS (``adamw``, ``sgd``)."""
    lr: float = 3e-3
    """Peak learning rate (the schedule scales it)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates, each in [0, 1) (0.95: the DeepSeek-V3 report's)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    momentum: float = 0.9
    """SGD's momentum, in [0, 1)."""
    zero: int = 0
    """1: ZeRO-1, optimizer state sharded over the data-parallel group (experts over their replicas)."""
    clip_grad: float = 0.0
    """Clip the global gradient norm to this (0: no clipping)."""
    state_dtype: str = "float32"
    """What the optimizer moments (AdamW's exp_avg and exp_avg_sq, SGD's momentum) of the fp32 masters are
    stored in: ``float32``, or ``bfloat16`` (half the bytes, updated in fp32; the DeepSeek-V3 report's)."""
    ema: float | None = None
    """Keep an fp32 exponential moving average of the weights in host memory with this decay, in (0, 1): after
    each optimizer step ``ema = decay * ema + (1 - decay) * weights``, off the step's path, each rank holding the
    rows it holds optimizer state for (moe.train.ema; as the DeepSeek-V3 report keeps one, 3.2.3); checkpoints
    keep it. Unset: none."""

    def __post_init__(self) -> None:
        _require(self.name in OPTIMIZERS, "optimizer.name", self.name, f"choose one of {OPTIMIZERS}")
        _require(math.isfinite(self.lr) and self.lr > 0, "optimizer.lr", self.lr, "must be a positive number")
        _require(self.lr < 1, "optimizer.lr", self.lr, "must be below 1 (a learning rate, not a percentage)")
        _require(0 <= self.weight_decay < 1, "optimizer.weight_decay", self.weight_decay, "must lie in [0, 1)")
        self.betas = tuple(self.betas)  # a TOML array arrives as a list
        ok = len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)
        _require(ok, "optimizer.betas", self.betas, "must be two numbers in [0, 1)")
        _require(0 < self.eps < 1, "optimizer.eps", self.eps, "must lie in (0, 1)")
        _require(0 <= self.momentum < 1, "optimizer.momentum", self.momentum, "must lie in [0, 1)")
        _require(self.zero in (0, 1), "optimizer.zero", self.zero, "must be 0 or 1")
        ok = math.isfinite(self.clip_grad) and self.clip_grad >= 0
        _require(ok, "optimizer.clip_grad", self.clip_grad, "must be >= 0 (0: no clipping)")
        ok = self.state_dtype in STATE_DTYPES
        _require(ok, "optimizer.state_dtype", self.state_dtype, f"choose one of {', '.join(STATE_DTYPES)}")
        ok = self.ema is None or 0 < self.ema < 1  # NaN fails both comparisons
        _require(ok, "optimizer.ema", self.ema, "must lie in (0, 1), a decay such as 0.999 (leave it unset for none)")

    def hyper(self) -> dict[str, Any]:
        """The hyper-parameters the chosen rule takes (:attr:`moe.optim_state.OptimizerSpec.hyper`)."""
        return {k: getattr(self, k) for k in OPTIMIZERS[self.name].hyper}


@dataclass(kw_only=True, slots=True)
class LRScheduleConfig:
    """Learning rate over the steps: a schedule of :data:`moe.train.lr.LR_SCHEDULES`."""

    name: str = "warmup-cosine"
    """``warmup-cosine``: linear warm-up, cosine decay to ``min_ratio`` x lr at the last step; ``wsd``:
    warm-up, stable, then a linear decay over the last ``decay_fraction`` of the steps."""
    warmup: int = 10
    """Linear warm-up steps (from lr / warmup at step 1 to lr)."""
    min_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    decay_fraction: float = 0.2
    """wsd: fraction of the steps in the final decay."""

    def __post_init__(self) -> None:
        _require(self.name in LR_SCHEDULES, "lr_schedule.name", self.name, f"choose one of {LR_SCHEDULES}")
        _require(self.warmup >= 0, "lr_schedule.warmup", self.warmup, "must be >= 0 steps")
        _require(0 <= self.min_ratio <= 1, "lr_schedule.min_ratio", self.min_ratio, "must lie in [0, 1]")
        ok = 0 <= self.decay_fraction <= 1
        _require(ok, "lr_schedule.decay_fraction", self.decay_fraction, "must lie in [0, 1]")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the tokens come from (:mod:`moe.data`)."""

    path: list[str] = field(default_factory=list)
    """A token file or prefix (``.npy``, raw ``.bin``, a Megatron indexed ``PREFIX``, a directory of text), or
    a weighted blend ``0.7 PREFIX_A 0.3 PREFIX_B``; empty: the byte-level demo corpus (the Python standard
    library's sources, vocabulary 256)."""
    dtype: str | None = None
    """Element type of a raw ``.bin`` token file without a sidecar (``uint16``, ``uint32``)."""
    val_fraction: float = 0.05
    """Held out for validation: the last documents (indexed data) or the tail of the tokens."""

    def __post_init__(self) -> None:
        self.path = [str(p) for p in self.path]
        ok = self.dtype is None or self.dtype in TOKEN_DTYPES
        _require(ok, "data.dtype", self.dtype, f"choose one of {TOKEN_DTYPES}")
        _require(0 <= self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must lie in [0, 1)")


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The run: length, batch shape, precision, validation."""

    steps: int = 40
    """Optimizer steps to train (a resumed run continues up to this step)."""
    seq_len: int = 64
    """Tokens per sequence."""
    micro_batch_size: int = 4
    """Sequences per micro-batch on one data-parallel rank."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over the whole job: micro_batch_size x parallel.dp x parallel.num_chunks.
    Set, it decides parallel.num_chunks (unset: parallel.num_chunks decides it)."""
    seed: int = 0
    """Initial weights and the data order."""
    dtype: str = "float32"
    """Compute dtype; ``bfloat16`` keeps fp32 master weights, gradient accumulation and optimizer state."""
    master_weights: bool = True
    """With bfloat16: fp32 master weights and gradients (False: pure bf16)."""
    fp8: bool = False
    """FP8 GEMMs as DeepSeek-V3 trains (:mod:`kernels.fp8`): every linear of attention, the dense MLPs, the
    experts and the MTP projection quantize their operands online to E4M3 in 1x128 tiles (activations,
    gradients) and 128x128 blocks (weights) and accumulate in fp32; outputs, master weights and optimizer state
    keep their dtypes. The embedding, head, norms, router and the attention core stay in ``dtype``. Turns on
    ``fp8_dispatch``."""
    fp8_dispatch: bool | None = None
    """Dispatch tokens in FP8: the dispatch-direction all-to-alls (forward dispatch and the combine's gradient)
    carry E4M3 values and one float32 scale per 128, about half the bytes of bf16; the combine stays in
    ``dtype``. None: on exactly when ``fp8`` is."""
    fp8_activations: bool = False
    """With ``fp8``: the routed experts keep the activations they save for backward (the up-projection's input,
    the SwiGLU input) in FP8 with their scales instead of ``dtype``, as DeepSeek-V3 does: less activation
    memory, one more rounding in the SwiGLU backward and the weight gradients."""
    val_every: int = 20
    """Held-out loss every N steps (0: never)."""
    val_batches: int = 2
    """Global batches per held-out evaluation."""
    force: bool = False
    """Run even when the pre-flight memory estimate exceeds the device's memory."""
    mtp_loss_weight: float = 0.3
    """Weight (lambda) of the mean multi-token-prediction loss in the objective, for models with MTP modules
    (``model.mtp_layers``; the DeepSeek-V3 report: 0.3 for its first 10T tokens, then 0.1)."""

    def __post_init__(self) -> None:
        _require(self.mtp_loss_weight >= 0, "training.mtp_loss_weight", self.mtp_loss_weight, "must be >= 0")
        for name in ("steps", "seq_len", "micro_batch_size", "val_batches"):
            value = getattr(self, name)
            _require(value > 0, f"training.{name}", value, "must be positive")
        ok = self.global_batch_size is None or self.global_batch_size > 0
        _require(ok, "training.global_batch_size", self.global_batch_size, "must be positive")
        _require(self.dtype in DTYPES, "training.dtype", self.dtype, f"choose one of {DTYPES}")
        _require(self.val_every >= 0, "training.val_every", self.val_every, "must be >= 0 (0: never)")
        _require(self.seed >= 0, "training.seed", self.seed, "must be >= 0")
        _require(self.fp8 or not self.fp8_activations, "training.fp8_activations", True, "needs training.fp8")

    @property
    def dispatch_fp8(self) -> bool:
        """Whether the dispatch-direction all-to-alls move FP8 (``fp8_dispatch``, defaulting to ``fp8``)."""
        return self.fp8 if self.fp8_dispatch is None else self.fp8_dispatch


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Distributed checkpoints (:mod:`moe.train.checkpoint`): atomic, verified, loadable at another layout."""

    dir: str | None = None
    """Directory of the checkpoints (``--ckpt-dir``)."""
    every: int = 0
    """Save every N steps (0: never; ``--ckpt-every``)."""
    resume: bool = False
    """Continue from the newest intact checkpoint in ``dir`` (none there: start from step 0)."""
    resume_strict: bool = False
    """Like ``resume``, but a damaged newest checkpoint or an empty ``dir`` is an error (no fallback)."""
    keep_last: int = 3
    """Keep the newest N checkpoints, removing older ones once a new one is in place (0: keep all)."""
    save_hf: str | None = None
    """At the end of training, export the model here as a Hugging Face directory (config.json, safetensors
    shards in the hub layout; ``--save-hf``, moe.hf.export): a new or empty directory, a model of a published
    architecture."""
    ema_weights: bool = False
    """``save_hf`` writes the moving average of the weights (``optimizer.ema``) instead of the weights."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, "checkpoint.every", self.every, "must be >= 0 (0: never)")
        _require(self.keep_last >= 0, "checkpoint.keep_last", self.keep_last, "must be 0 (keep all) or more")
        if self.every and not self.dir:
            raise ConfigError("checkpoint.every needs checkpoint.dir (--ckpt-every needs --ckpt-dir)")
        if (self.resume or self.resume_strict) and not self.dir:
            flag = "--resume-strict" if self.resume_strict else "--resume"
            raise ConfigError(f"checkpoint.resume needs checkpoint.dir ({flag} needs --ckpt-dir)")
        self.resume = self.resume or self.resume_strict


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """What the run reports."""

    file: str | None = None
    """Append one JSON line per step here (``--metrics-file``; rank 0)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard event files here (needs the ``tensorboard`` extra)."""
    log_every: int = 5
    """Progress line every N steps."""
    trace_dir: str | None = None
    """Write a torch profiler trace of the second step per rank here."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s per rank for MFU (0: the GPU's dense bf16 peak from moe.plan's table; on CPU a matmul
    measured at start)."""
    sync_debug: bool = False
    """Count the host syncs inside each step after the run's first (the warm-up): the step runs under
    ``torch.cuda.set_sync_debug_mode("warn")``, and the record and the progress line get the number of syncs and
    their first call sites (``host_syncs``, ``host_sync_sites``; moe.train.metrics.SyncDebug). CUDA only:
    without a CUDA device it is accepted and ignored (one line says so)."""

    def __post_init__(self) -> None:
        _require(self.log_every >= 1, "metrics.log_every", self.log_every, "must be >= 1")
        _require(self.peak_tflops >= 0, "metrics.peak_tflops", self.peak_tflops, "must be >= 0 (0: automatic)")


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    """Timeouts, the non-finite guard and the failure drills."""

    timeout: float = 300.0
    """Seconds any rank waits for a peer."""
    skip_nonfinite: bool = False
    """Skip a step whose loss or gradients are NaN/inf (no optimizer step) instead of stopping."""
    kill_rank_at_step: int = 0
    """Failure drill: SIGKILL global rank 1 at this step on the first attempt (torchrun restart 0)."""
    stop_rank_at_step: int = 0
    """Failure drill: SIGSTOP global rank 1 at this step (a hung peer: the others fail within timeout)."""
    nan_at_step: int = 0
    """Failure drill: a NaN in one gradient of the last rank's first stage module at this step."""
    debug: bool = False
    """Print every rank's traceback for the one-line errors."""

    def __post_init__(self) -> None:
        _require(self.timeout > 0, "fault.timeout", self.timeout, "must be positive seconds")
        for name in ("kill_rank_at_step", "stop_rank_at_step", "nan_at_step"):
            _require(getattr(self, name) >= 0, f"fault.{name}", getattr(self, name), "must be >= 0 (0: never)")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """A whole training job. Each section validates itself; this checks the rules between sections."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        cfg, pc = self.model.build(), self.parallel
        try:
            pc.check_model(cfg)
            pc.offload_policy(cfg, self.training.fp8_activations)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if pc.ep > 1:  # the rows it would move and the group's size (its package and placement: preflight)
            dtype = getattr(torch, self.training.dtype)
            rows = Launch(
                dtype=dtype,
                hidden_size=cfg.hidden_size,
                comm_sms=pc.comm_sms,
                ep_size=pc.ep,
                fp8=self.training.dispatch_fp8,
            )
            found = DISPATCHERS.lookup(pc.dispatcher).violations(rows)
            if found:
                raise ConfigError(f"--dispatcher {pc.dispatcher}: {'; '.join(found)}")
        if self.checkpoint.save_hf:
            from moe.hf.config import HFConfigError, to_hf_config  # no hf extra needed to write a config

            try:
                to_hf_config(cfg)
            except HFConfigError as exc:
                raise ConfigError(f"checkpoint.save_hf: {exc}") from None
        if self.checkpoint.ema_weights and (self.optimizer.ema is None or not self.checkpoint.save_hf):
            need = "--save-hf DIR" if self.optimizer.ema is not None else "--ema DECAY"
            raise ConfigError(f"checkpoint.ema_weights needs {need} (--ema-weights exports the moving average)")
        tr = self.training
        if tr.global_batch_size is not None and tr.global_batch_size != self.global_batch:
            per = tr.micro_batch_size * pc.dp
            raise ConfigError(
                f"training.global_batch_size = {tr.global_batch_size}: must be micro_batch_size x parallel.dp x "
                f"parallel.num_chunks = {tr.micro_batch_size} x {pc.dp} x {pc.num_chunks} = {self.global_batch}"
                + (f"; or leave num_chunks unset and give a multiple of {per}" if tr.global_batch_size % per else "")
            )
        if self.training.val_every and not self.data.val_fraction:
            raise ConfigError(
                f"training.val_every = {self.training.val_every}: there is no validation split (data.val_fraction "
                "= 0); pass --val-every 0 or a --data.val-fraction"
            )

    @property
    def model_config(self) -> MoEConfig:
        return self.model.build()

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over the whole job."""
        return self.parallel.num_chunks * self.training.micro_batch_size * self.parallel.dp  # type: ignore[operator]


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}  # type: ignore[misc]
"""Section name -> its dataclass, in file order."""
