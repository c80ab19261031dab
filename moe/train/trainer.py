"""The training loop as a library: :class:`Trainer` builds a job from a :class:`TrainConfig` and trains it.

    trainer = Trainer(config)        # pre-flight, process group, mesh, stages, pipeline, optimizer, data
    trainer.train()                  # steps, validation, checkpoints; records to the callbacks on rank 0
    trainer.close()                  # then, if trainer.stopped_by (SIGINT, SIGTERM): exit 128 + its number

Each part is a method a subclass may override (``build_stages``, ``build_optimizer``, ``train_step``...).
Order of construction: every check that needs no peer (:mod:`moe.train.preflight`, the data's vocabulary)
runs before the process group exists, so a job that cannot run stops within seconds with one line.

A step is a pure function of (weights, optimizer state, ``consumed_samples``): the global batch of a step is
the data's samples ``[consumed, consumed + global_batch)``, cut per data-parallel rank, so a resumed run, or
one at another (pp, dp, ep) with the same global batch, sees exactly the same tokens.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dualpipe import Pipeline
from dualpipe.host_sync import to_device
from dualpipe.observer import ProfilerObserver
from dualpipe.offload import Offloader
from kernels.fp8 import FP8Recipe
from kernels.warmup import KernelShapes, warm_up
from moe.data import DataError, open_data
from moe.models.layers import fp8_linears
from moe.models.model import lm_loss
from moe.models.router import Router, bias_rate_at
from moe.models.stage import MoEStage
from moe.parallel import build_stages, init_layout
from moe.plan import model_flops_per_token
from moe.train import preflight
from moe.train.checkpoint import (
    CheckpointError,
    find_checkpoint,
    has_ema,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from moe.train.config import TrainConfig
from moe.train.ema import HostEMA
from moe.train.grad_sync import balance_routers, make_optimizer, reduce_gradients
from moe.train.guard import find_nonfinite, weights_are_finite
from moe.train.lr import lr_at
from moe.train.memory import MemoryMeter
from moe.train.metrics import (
    Callback,
    JsonlWriter,
    ProgressPrinter,
    SyncDebug,
    TensorBoardWriter,
    format_bytes,
    peak_flops,
)
from moe.train.offload import build_offloader
from moe.train.optimizer import DistributedOptimizer, grad_of
from moe.train.ranks import init_process_group, make_pipeline, pick_device
from moe.train.stop import StopSignals

__all__ = ["Trainer", "TrainingError"]


class TrainingError(SystemExit):
    """A failure of the run the user can act on (diverged, a checkpoint that cannot be written or read): one
    line on rank 0, the same decision on every rank."""


class Trainer:
    """One rank's share of a training job. Collective: every rank constructs one with the same config."""

    def __init__(self, config: TrainConfig, callbacks: list[Callback] | None = None) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = pick_device()
        self.hf_source = self.read_hf_source()
        """The Hugging Face directory the model started from, as checkpoints and the export keep it (None: a
        preset); read now, so a directory moved or deleted during the run does not matter."""
        self.memory_estimate = self.preflight()
        self.data = self.build_data()
        self.owns_process_group = init_process_group(self.device, config.fault.timeout, config.parallel.reserved_sms)
        self.rank = dist.get_rank()
        torch.manual_seed(config.training.seed)
        self.layout = init_layout(config.parallel, self.device.type)
        self.dispatcher_warm_up_s = 0.0
        """Seconds :meth:`build_stages` took to warm the dispatcher up (the banner says it)."""
        self.stages = self.build_stages()
        self.pipe = self.build_pipeline()
        self.optimizer = self.build_optimizer()
        self.ema = self.build_ema()
        """The moving average of the weights on the host (``optimizer.ema``), or None."""
        self.meter = MemoryMeter(list(self.pipe.module), self.optimizer)
        self.offloader = self.build_offloader()
        tr, dp = config.training, self.layout
        split = {"seq_len": tr.seq_len, "global_batch": config.global_batch, "seed": tr.seed}
        split.update(dp_rank=dp.dp_rank, dp_size=config.parallel.dp)
        self.train_loader = self.data.loader("train", **split)
        self.val_loader = self.data.loader("val", **split) if tr.val_every else None
        self.step = 0
        """Optimizer steps done (the checkpoint's after :meth:`resume`)."""
        self.first_step = 1
        self.consumed_samples = 0
        """Global samples trained on: the next step's batch starts there."""
        self.nonfinite_skips = 0
        self.grad_norm = float("nan")
        self.flops_per_token = model_flops_per_token(self.model_config, tr.seq_len)
        self.peak_flops, self.peak_source = peak_flops(self.device, config.metrics.peak_tflops)
        self.callbacks = list(callbacks or [])
        """The records' sinks: these, and from :meth:`train` on, rank 0's own first (:meth:`build_callbacks`)."""
        self.signals = StopSignals()
        """SIGINT and SIGTERM during :meth:`train`: the ranks stop together after a step (:meth:`stop`)."""
        if config.metrics.sync_debug and self.device.type != "cuda" and self.rank == 0:
            print("--sync-debug: no CUDA device, so no host syncs are counted (it needs torch.cuda)", flush=True)

    # construction

    def preflight(self) -> float:
        """Every check that needs no peer; returns the per-rank memory estimate in bytes."""
        preflight.check_dispatcher(self.config)
        preflight.check_checkpoint_dir(self.config)
        preflight.check_tensorboard(self.config)
        if self.config.checkpoint.save_hf:  # found now, not after the training it would export
            from moe.hf import HFConfigError, to_hf_config
            from moe.hf.export import HFExportError, check_target

            try:
                check_target(Path(self.config.checkpoint.save_hf))
                if self.hf_source is not None:  # the source's config.json can carry what the run changes
                    to_hf_config(self.model_config, source=self.hf_source.config)
            except (HFExportError, HFConfigError) as exc:
                raise preflight.PreflightError(f"error: --save-hf: {exc}") from None
        return preflight.check_memory(self.config, self.device)

    def build_data(self):
        """The token data, its vocabulary checked against the model's (a one-line error naming the file and the
        position of the first id out of range)."""
        d, tr = self.config.data, self.config.training
        try:
            data = open_data(d.path, dtype=d.dtype, val_fraction=d.val_fraction)
            data.check_vocab(self.model_config.vocab_size)
            for split in ("train", "val") if tr.val_every else ("train",):  # enough tokens for a window
                data.loader(split, seq_len=tr.seq_len, global_batch=self.config.global_batch, seed=tr.seed)
        except DataError as exc:
            raise preflight.PreflightError(f"error: --data: {exc}") from None
        return data

    def build_stages(self) -> tuple[MoEStage, ...]:
        """This rank's stages: from a Hugging Face checkpoint's weights when ``--model`` is one (each rank reads
        its own layers and experts), else initialised from ``training.seed``."""
        dtype = getattr(torch, self.config.training.dtype)
        tr = self.config.training
        recipe = FP8Recipe(save_fp8=tr.fp8_activations) if tr.fp8 else None
        stages = build_stages(
            self.model_config,
            self.layout,
            seed=tr.seed,
            dtype=dtype,
            device=self.device,
            fp8=recipe,
            fp8_dispatch=tr.dispatch_fp8,
        )
        if self.config.model.checkpoint is not None:
            from moe.hf import HFCheckpointError, load_hf_weights

            try:
                load_hf_weights(stages, self.config.model.checkpoint)
            except HFCheckpointError as exc:  # the same files on every rank: all stop alike
                raise TrainingError(f"error: --model {self.config.model.checkpoint}: {exc}") from None
        # Triton compiles and autotunes at the real shapes now, on every rank alike, not inside the first
        # pipe.step while all-to-alls are in flight (a no-op off CUDA).
        pc = self.config.parallel
        shapes = KernelShapes.from_config(
            self.model_config,
            tokens=tr.micro_batch_size * tr.seq_len,
            ep=pc.ep,
            dtype=dtype,
            fp8=recipe,
            fp8_linears=fp8_linears(*stages),
        )
        warm_up(shapes, self.device, comm_sms=pc.reserved_sms)
        # The dispatcher too (one for all stages): DeepEP V2 builds its buffer and JIT-compiles its kernels on first
        # use, NCCL creates communicators on first use; here, at the step's shapes, not inside step 1.
        t0 = time.monotonic()
        stages[0].dispatcher.warm_up(
            tr.micro_batch_size * tr.seq_len,
            self.model_config.top_k,
            self.model_config.hidden_size,
            dtype=dtype,
            device=self.device,
        )
        self.dispatcher_warm_up_s = time.monotonic() - t0
        for stage in stages:
            # The step averages the LM loss over micro-batches (loss_reduction="mean"); the balance loss, added
            # inside each stage per micro-batch, must be averaged the same way.
            stage.aux_loss_scale = 1.0 / pc.num_chunks  # type: ignore[operator]
            stage.mtp_loss_weight = tr.mtp_loss_weight
        return stages

    def read_hf_source(self):
        """``--model DIR``'s config.json, tokenizer and generation config (:class:`moe.hf.export.HFSource`)."""
        if self.config.model.checkpoint is None:
            return None
        from moe.hf.export import HFSource

        return HFSource.read(self.config.model.checkpoint)

    def build_pipeline(self) -> Pipeline:
        tr = self.config.training
        return make_pipeline(
            self.stages,
            self.layout,
            micro_batch=tr.micro_batch_size,
            seq_len=tr.seq_len,
            dtype=getattr(torch, tr.dtype),
            timeout_s=self.config.fault.timeout,
        )

    def build_offloader(self) -> Offloader | None:
        """The activation offloader of ``parallel.offload`` on this pipeline rank (None: nothing moves here),
        handed to the pipeline and the memory meter (which it counts for)."""
        pc = self.config.parallel
        policy = pc.offload_policy(self.model_config, self.config.training.fp8_activations)
        tracker = self.meter.tracker if self.meter.track_saved else None
        offloader = build_offloader(policy, list(self.pipe.module), self.layout.pp_rank, tracker)
        self.pipe.set_offloader(offloader)
        if policy:
            self.meter.watch_offload(offloader)
        return offloader

    def build_optimizer(self) -> DistributedOptimizer:
        opt = self.config.optimizer
        return make_optimizer(
            self.stages,
            self.layout,
            opt.name,
            zero=bool(opt.zero),
            master_weights=self.config.training.master_weights,
            state_dtype=opt.state_dtype,
            **opt.hyper(),
        )

    def build_ema(self) -> HostEMA | None:
        """``optimizer.ema``'s average (:class:`moe.train.ema.HostEMA`), starting from the weights as built."""
        decay = self.config.optimizer.ema
        return None if decay is None else HostEMA(self.optimizer, decay)

    def build_callbacks(self) -> list[Callback]:
        """Rank 0's record sinks: the progress line, ``metrics.file`` and ``metrics.tensorboard_dir``; built once
        the run knows its first step, so a resumed run first drops the records past its checkpoint."""
        m = self.config.metrics
        resumed_at = self.step if self.config.checkpoint.resume else None
        out: list[Callback] = [ProgressPrinter(self.config.training.steps, m.log_every)]
        if m.file:
            out.append(JsonlWriter(m.file, resumed_at))
        if m.tensorboard_dir:
            out.append(TensorBoardWriter(m.tensorboard_dir, resumed_at))
        return out

    # the loop

    @property
    def modules(self) -> list[MoEStage]:
        return list(self.pipe.module)

    def routers(self) -> list[tuple[int, Router]]:
        """(global layer, router) of this rank's MoE blocks."""
        return [
            (int(key), b.router)
            for stage in self.modules
            for key, b in stage.blocks.items()
            if getattr(b, "is_moe", False)
        ]

    def lr(self, step: int) -> float:
        c = self.config
        return lr_at(c.lr_schedule, c.optimizer.lr, step, c.training.steps)

    def batch(self, loader, first_sample: int) -> tuple[tuple, tuple]:
        """(inputs, labels) this pipeline rank feeds ``pipe.step``: its data-parallel slice of the global batch,
        cut by the pipeline (``Pipeline.split_batch``: DualPipe feeds half at each end)."""
        ids, labels = loader.batch(first_sample)
        # Uploaded from pinned memory without a wait: a blocking copy would sync the stream, and the host could
        # not queue this step while the last one's work runs.
        return self.pipe.split_batch((to_device(ids, self.device),), (to_device(labels, self.device),))

    def train(self) -> None:
        """Train from the current step (0, or the resumed checkpoint's) to ``training.steps``, or until a SIGINT
        or SIGTERM: then every rank stops after the same step, with a checkpoint of it (:meth:`stop`), and
        :attr:`stopped_by` names the signal. The previous signal handlers are back when it returns."""
        c = self.config
        with self.signals:
            if c.checkpoint.resume:
                self.resume()
            self.first_step = self.step + 1
            if self.rank == 0:
                self.callbacks[:0] = self.build_callbacks()
                self.print_banner()
            while self.step < c.training.steps:
                step = self.step + 1
                self._drills(step)
                t0 = time.monotonic()
                figures = self._maybe_profiled(step)
                dt = time.monotonic() - t0
                self.step = step
                self.consumed_samples += c.global_batch
                record = self.record(step, figures, dt)
                if c.training.val_every and step % c.training.val_every == 0:
                    record["val_loss"] = self.validate()
                saved = self.save() if c.checkpoint.every and step % c.checkpoint.every == 0 else None
                for cb in self.callbacks:
                    cb.on_step(record)
                if self.stopped_by is not None:  # the same on every rank: read from this step's all-reduce
                    self.stop(saved)
                    return
        if c.checkpoint.save_hf:
            self.save_hf()

    @property
    def stopped_by(self) -> signal.Signals | None:
        """The signal the run stopped on (any rank's, agreed by all), or None."""
        return self.signals.agreed

    def stop(self, saved: Path | None) -> None:
        """End the run after this step on :attr:`stopped_by`: a checkpoint of it unless ``saved`` holds one
        already (with ``checkpoint.dir`` set), and one line on rank 0 naming the step and where it went."""
        if self.config.checkpoint.dir and saved is None:
            self.require_finite_weights(self.step)
            saved = self.save()
        if self.rank == 0:
            where = f"checkpoint saved to {saved}" if saved else "no checkpoint (checkpoint.dir unset)"
            print(f"stopping at step {self.step} on {self.stopped_by.name}: {where}", flush=True)

    def record(self, step: int, figures: dict[str, Any], seconds: float) -> dict[str, Any]:
        tokens = self.config.global_batch * self.config.training.seq_len
        world = dist.get_world_size()
        return {
            "step": step,
            "loss": figures.pop("loss"),
            "lr": self.lr(step),
            "grad_norm": self.grad_norm,
            "tokens_per_s": tokens / seconds,
            "mfu": self.flops_per_token * tokens / seconds / (self.peak_flops * world),
            "step_time_s": seconds,
            "expert_imbalance": figures.pop("expert_imbalance"),
            "expert_imbalance_per_layer": figures.pop("expert_imbalance_per_layer"),
            "nonfinite_skips": self.nonfinite_skips,
            "memory_estimate_bytes": self.memory_estimate,  # the pre-flight's, beside what the step measured
            **figures,  # bytes: param, grad, optimizer_state, peak_activation (the fullest rank's); host syncs
        }

    def print_banner(self) -> None:
        c, pc, tr = self.config, self.config.parallel, self.config.training
        fp8 = ("+fp8-gemm" if tr.fp8 else "") + ("+fp8-dispatch" if tr.dispatch_fp8 else "")
        # the dispatcher's warm-up at setup (DeepEP V2: its buffer built and kernels compiled)
        dispatcher = f" {pc.dispatcher} (ready in {self.dispatcher_warm_up_s:.1f} s)" if pc.ep > 1 else ""
        print(
            f"MoE {c.model.name}: pp={pc.pp} dp={pc.dp} ep={pc.ep} {pc.schedule} overlap={pc.overlap}{dispatcher} "
            f"chunks={pc.num_chunks} tokens/step={c.global_batch * tr.seq_len} {tr.dtype}{fp8} "
            f"memory estimate {self.memory_estimate / 2**20:.0f} MiB/rank{self._ema_words()}, MFU against "
            f"{self.peak_source}; "
            f"data: {self.data.description}",
            flush=True,
        )

    def _ema_words(self) -> str:
        if self.ema is None:
            return ""
        return f" (+ EMA {self.ema.decay} on the host, {format_bytes(self.ema.host_bytes())} on rank 0)"

    def _maybe_profiled(self, step: int) -> dict[str, Any]:
        """:meth:`train_step`, under the torch profiler for the second step of this run when asked."""
        trace_dir = self.config.metrics.trace_dir
        if not trace_dir or step != self.first_step + 1:
            return self.train_step(step)
        from torch.profiler import profile

        observer = ProfilerObserver()  # schedule actions and pipeline messages as named spans in the trace
        self.pipe.add_observer(observer)
        try:
            with profile() as prof:
                figures = self.train_step(step)
        finally:
            self.pipe.remove_observer(observer)
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(trace_dir) / f"trace_rank{self.rank}.json"))
        return figures

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step; its figures: the global mean loss, the expert imbalance after the balancing step
        (max / mean tokens per expert over the global batch; the worst layer and each layer), the memory
        figures of :class:`moe.train.memory.MemoryMeter` (the fullest rank's) and, with ``metrics.sync_debug`` on CUDA
        after the run's first step, this rank's host syncs from the pipeline step to the optimizer step
        (:class:`moe.train.metrics.SyncDebug`; the meter's own synchronisations stay outside)."""
        lr = self.lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        inputs, labels = self.batch(self.train_loader, self.consumed_samples)
        # the first step of the run warms up (communicators, allocator, lazy initialisation): its syncs are not counted
        syncs = SyncDebug(self.device, enabled=self.config.metrics.sync_debug and step > self.first_step)
        self.meter.start_step()
        try:
            with syncs:
                loss = self.forward_backward_update(step, lr, inputs, labels)
        finally:
            memory = self.meter.stop_step()
        per_layer, figures = self._worst_over_ranks(memory)
        loss_mean, mtp = self._global_mean_losses(loss)
        if syncs.result is not None:
            figures.update(host_syncs=syncs.result.count, host_sync_sites=syncs.result.sites)
        return {
            "loss": loss_mean,
            **({"mtp_loss": mtp} if mtp is not None else {}),
            "expert_imbalance": max(per_layer.values(), default=1.0),
            "expert_imbalance_per_layer": per_layer,
            **figures,
        }

    def forward_backward_update(self, step: int, lr: float, inputs: tuple, labels: tuple) -> torch.Tensor | None:
        """The pipeline step over this rank's micro-batches, then (unless the guard skips it) the gradient
        reduction, clipping, the optimizer step and the routers' balancing step; this rank's micro-batch losses
        (None on a rank that computes none)."""
        loss, _ = self.pipe.step(
            *inputs, num_chunks=self.config.parallel.num_chunks, criterion=lm_loss, labels=labels, loss_reduction="mean"
        )
        self._nan_drill(step)
        if self.guard_nonfinite(step, loss):
            reduce_gradients(self.modules, self.layout)
            self.grad_norm = self.optimizer.clip_grad_norm_(self.config.optimizer.clip_grad or math.inf)
            if self.ema is not None:
                self.ema.before_step()
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()  # queued: the copy on a side stream, the average on a host thread
            # The bias moves with the learning rate: routing scores drift about as fast as the weights do.
            rate = bias_rate_at(self.model_config.bias_update_rate, lr, self.config.optimizer.lr)
            balance_routers(self.modules, self.layout, rate=rate)
            every = self.config.checkpoint.every
            if every and step % every == 0:
                self.require_finite_weights(step)
        return loss

    def require_finite_weights(self, step: int) -> None:
        """Collective: stop the run (every rank alike) rather than checkpoint a NaN or infinite weight."""
        if not weights_are_finite(self.modules):
            raise TrainingError(
                f"error: non-finite weights after step {step}; its checkpoint is not written: lower --lr"
            )

    def _worst_over_ranks(self, memory: dict[str, int]) -> tuple[dict[int, float], dict[str, int]]:
        """One MAX all-reduce over the world: each MoE layer's expert imbalance of the last balancing step (max /
        mean load, from the ranks that hold the layer; 1.0 where no update ran), and each memory figure of the
        fullest rank, the one that decides whether a layout fits."""
        cfg = self.model_config
        values = torch.ones(cfg.num_layers + len(memory), dtype=torch.float64, device=self.device)
        for layer, router in self.routers():
            values[layer] = router.imbalance()
        values[cfg.num_layers :] = torch.tensor(list(memory.values()), dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        worst = values.tolist()
        layers = {i: v for i, v in enumerate(worst[: cfg.num_layers]) if cfg.is_moe_layer(i)}
        return layers, {k: int(v) for k, v in zip(memory, worst[cfg.num_layers :])}

    def _global_mean_losses(self, loss: torch.Tensor | None) -> tuple[float, float | None]:
        """One all-reduce over the world (all ranks call this): the mean micro-batch loss over every rank that
        computed one, and the mean multi-token-prediction loss (over depths and micro-batches) of the
        micro-batches run since the last call (None for a model without MTP). The ranks' stop signals ride
        along (:meth:`StopSignals.votes`): every rank learns of any rank's at the same call."""
        votes = self.signals.votes()
        total = torch.zeros(4 + len(votes), dtype=torch.float64, device=self.device)  # loss sum, count; MTP; votes
        if loss is not None:
            total[0], total[1] = loss.double().sum(), loss.numel()
        for losses in self._pop_mtp_losses():
            total[2] += losses.mean(1).double().sum()
            total[3] += losses.shape[0]
        total[4:] = torch.tensor(votes, dtype=torch.float64)
        dist.all_reduce(total)
        loss_sum, count, mtp_sum, mtp_count, *votes = total.tolist()
        self.signals.agree(votes)
        mtp = (mtp_sum / mtp_count if mtp_count else math.nan) if self.model_config.mtp_layers else None
        return (loss_sum / count if count else math.nan), mtp

    def _pop_mtp_losses(self) -> list[torch.Tensor]:
        """This rank's MTP losses since the last call, ``[micro-batches, depths]`` per stage that ran some."""
        return [losses for stage in self.stages if (losses := stage.pop_mtp_losses()) is not None]

    def validate(self) -> float:
        """Mean loss over ``training.val_batches`` fixed global batches of the held-out split."""
        losses = []
        self.pipe.eval()  # routers count expert load only in training mode
        chunks = self.config.parallel.num_chunks
        with torch.no_grad():
            for i in range(self.config.training.val_batches):
                inputs, labels = self.batch(self.val_loader, i * self.config.global_batch)
                loss, _ = self.pipe.step(*inputs, num_chunks=chunks, criterion=lm_loss, labels=labels)
                self._pop_mtp_losses()  # held-out MTP losses: not part of the next step's figure
                losses.append(self._global_mean_losses(loss)[0])
        self.pipe.train()
        return sum(losses) / len(losses)

    def guard_nonfinite(self, step: int, loss: torch.Tensor | None) -> bool:
        """True if the step may go on to its optimizer step. A NaN/inf loss or gradient on any rank stops the run
        (same decision on every rank), or with ``fault.skip_nonfinite`` drops the step's gradients and loads."""
        found = find_nonfinite(self.modules, loss, self.layout.config.num_stages)
        if not found:
            return True
        if not self.config.fault.skip_nonfinite:
            raise TrainingError(
                f"error: {found.describe(step)}; stopped before its optimizer step (checkpoints hold earlier steps "
                "only): lower --lr, or pass --skip-nonfinite to skip such steps"
            )
        self.optimizer.zero_grad(set_to_none=True)
        for _, router in self.routers():
            router.expert_load.zero_()  # the router bias does not move on a skipped step
        self.nonfinite_skips += 1
        if self.rank == 0:
            print(f"{found.describe(step)}: step skipped ({self.nonfinite_skips} so far)", flush=True)
        return False

    # checkpoints

    def save(self) -> Path:
        """Collective: a checkpoint of this step (:func:`moe.train.checkpoint.save_checkpoint`); one line on rank 0
        with its step, directory, size and seconds. Returns the directory."""
        pc = self.config.parallel
        meta = {"consumed_samples": self.consumed_samples, "pp": pc.pp, "dp": pc.dp, "ep": pc.ep}
        meta["config"] = {"model": self.config.model.name, "schedule": pc.schedule}
        meta["model"] = dataclasses.asdict(self.model_config)  # what moe.eval rebuilds the model from
        # the Hugging Face source, for moe.convert to export as --save-hf would (its config.json in meta.json)
        files = self.hf_source.into_checkpoint(meta) if self.hf_source is not None else None
        try:
            t0 = time.monotonic()
            path = save_checkpoint(
                self.config.checkpoint.dir,
                self.step,
                self.modules,
                self.optimizer,
                meta,
                rng_state(),
                keep_last=self.config.checkpoint.keep_last,
                files=files,
                ema=self.ema,
            )
        except CheckpointError as exc:  # every rank gets it: all stop, none waits on a dead peer
            raise TrainingError(f"error: {exc}; training stopped, the previous checkpoint is untouched") from None
        if self.rank == 0:
            size = format_bytes(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
            print(f"checkpoint step {self.step} -> {path} ({size}, {time.monotonic() - t0:.2f} s)", flush=True)
        return path

    def save_hf(self) -> None:
        """Export the model as a Hugging Face directory (``checkpoint.save_hf``): each rank writes its own stages'
        tensors, in the parameters' dtype (:func:`moe.hf.export.save_hf`), with the config.json, tokenizer and
        generation config of the directory the model started from, if any (changed only where training did).
        With ``checkpoint.ema_weights`` the tensors are the moving average's (:meth:`HostEMA.applied`)."""
        from contextlib import nullcontext

        from moe.hf.export import HFExportError, save_hf

        path = self.config.checkpoint.save_hf
        average = self.ema is not None and self.config.checkpoint.ema_weights
        try:
            with self.ema.applied() if average else nullcontext():  # type: ignore[union-attr]
                save_hf(self.modules, path, self.model_config, source=self.hf_source)
        except HFExportError as exc:  # every rank gets it
            raise TrainingError(f"error: --save-hf: {exc}") from None
        if self.rank == 0:
            what = "the moving average of the weights" if average else "the model"
            print(f"exported {what} to {path} (Hugging Face layout)", flush=True)

    def resume(self) -> None:
        """Continue after the newest intact checkpoint (none: from step 0, one line says so;
        ``checkpoint.resume_strict`` makes that, and a damaged newest checkpoint, an error)."""
        ck = self.config.checkpoint
        strict = " (--resume-strict)" if ck.resume_strict else ""
        try:
            path, warnings = find_checkpoint(ck.dir, strict=ck.resume_strict)
        except CheckpointError as exc:
            raise TrainingError(f"error: {exc}{strict}") from None
        for warning in warnings if self.rank == 0 else []:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        if path is None and ck.resume_strict:
            raise TrainingError(f"error: no checkpoint in {ck.dir} to resume from{strict}")
        if path is None:
            if self.rank == 0:
                print(f"--resume: no checkpoint in {ck.dir}, starting from step 0", flush=True)
            return
        try:
            meta, rank_state = load_checkpoint(path, self.modules, self.optimizer, ema=self.ema)
        except CheckpointError as exc:
            raise TrainingError(f"error: {exc}") from None
        if self.ema is not None and self.rank == 0 and not has_ema(path):
            print(f"--ema: {path} holds no moving average; it starts from the checkpoint's weights", flush=True)
        if rank_state is not None:
            set_rng_state(rank_state)
        if self.hf_source is None and "hf_config" in meta:  # a checkpoint converted from a Hugging Face directory
            from moe.hf.export import HFSource

            self.hf_source = HFSource.from_checkpoint(path, meta)
        self.step = int(meta["step"])
        # Checkpoints from before the data position was recorded trained at this job's global batch.
        self.consumed_samples = int(meta.get("consumed_samples", self.step * self.config.global_batch))
        if self.rank == 0:
            written = f"pp={meta['pp']} dp={meta.get('dp', meta['ep'])} ep={meta['ep']}"  # no dp: dp == ep
            print(f"resumed from {path} (step {self.step}, written at {written})", flush=True)

    # failure drills (fault.*): real signals and NaNs, so the recovery paths run in tests

    def _drills(self, step: int) -> None:
        f, rank = self.config.fault, self.rank
        if f.kill_rank_at_step == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and rank == 1:
            print(f"failure drill: killing rank 1 at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if f.stop_rank_at_step == step and rank == 1:
            print(f"failure drill: stopping rank 1 at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def _nan_drill(self, step: int) -> None:
        if self.config.fault.nan_at_step != step or self.rank != dist.get_world_size() - 1:
            return
        stage = self.modules[0]
        grad = grad_of(next(p for p in stage.parameters() if p.requires_grad))  # main_grad under bf16
        grad[(0,) * grad.dim()] = float("nan")
        print(f"failure drill: a NaN in a gradient of stage {stage.stage_index} at step {step}", flush=True)

    def close(self) -> None:
        """The clean path only: flush the callbacks, release the dispatchers (DeepEP's ``destroy()`` syncs with
        its peers, so a rank leaving with an error never calls it; its peers then fail on their collective
        timeout instead) and the process group if this trainer made it."""
        for cb in self.callbacks:
            cb.close()
        if self.ema is not None:
            self.ema.close()
        dist.barrier()
        for dispatcher in {id(s.dispatcher): s.dispatcher for s in self.modules}.values():
            dispatcher.close()
        if self.owns_process_group:
            dist.destroy_process_group()
