"""Fixes to the GPU cluster path that CPU runs could not see: setup warm-up, host syncs, the count exchange's group.

* deepep-v2: the trainer builds the ``ElasticBuffer`` and runs every JIT kernel once at setup, at the step's
  shapes (the FP8 dispatch option included), and the banner says how long that took; step 1 builds nothing.
* Host syncs: :class:`HostSyncDetector` now sees blocking uploads (CPU -> device), which torch runs as a copy
  followed by a stream sync, and no longer flags ``t[mask] = scalar`` (ATen runs it as ``masked_fill_``). ``meta``
  stands in for CUDA here: any device that is not the CPU is a device to the detector. The uploads it found (the
  step's inputs, the P2P shape header, deepep-v2's count upload at its build) are gone from the step.
* The row-count exchange of ``alltoall`` runs on a duplicate of the expert group (its own communicator, so on
  NCCL its own stream): in the overlapped pair it no longer waits for the other micro-batch's all-to-all.

The multi-rank checks share one 2-rank run (:func:`_ranks`); each test reads its part.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
import time
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dualpipe.host_sync import HostSyncDetector, to_device
from dualpipe.p2p import P2P, Message
from tests.distributed import run_ranks
from tests.moe.helpers import SEED, batch, tiny_config

META = torch.device("meta")
PG_TIMEOUT = 41.0
"""The default group's timeout (seconds) in the 2-rank run: every group the layout makes must wait as long."""
EMULATIONS = "tests/moe/dispatch/fake_deep_ep"  # the DeepEP emulations stand for kernels: their syncs are not counted
REFERENCE_KERNELS = "kernels/reference.py"


# ---------------------------------------------------------------------------------------------- host syncs


def test_uploads_are_flagged_and_their_sync_free_forms_are_not():
    host = torch.arange(4)
    on_device = torch.empty(4, dtype=torch.int64, device=META)
    with HostSyncDetector() as syncs:
        torch.tensor([7], device=META)  # deepep-v2's count upload at its build
        host.to(META)  # the P2P shape header, the step's inputs
        on_device.copy_(host)
        torch.as_tensor([1, 2], device=META)
        on_device.new_tensor([1, 2])
    assert [f.op for f in syncs.flagged] == ["torch.tensor", "aten._to_copy", "aten.copy_"] + ["torch.tensor"] * 2
    y = torch.arange(6.0)
    with HostSyncDetector() as clean:
        torch.full((1,), 7, device=META)  # filled on the device: nothing uploaded
        to_device(host, META)
        on_device.copy_(host, non_blocking=True)
        torch.tensor([7])  # stays on the host
        y[y > 3] = 0.0  # masked_fill_ in ATen: no nonzero()
        y.masked_fill(y > 3, 1.0)
    assert clean.flagged == [], clean.summary()
    # Where pinned memory exists, a non-blocking upload must come from it (pageable memory is staged, and the
    # driver may sync the stream): the detector's rule on a GPU machine.
    with HostSyncDetector() as pinning:
        pinning.pinning = True
        host.to(META, non_blocking=True)
    assert pinning.counts() == {"aten._to_copy": 1}


def test_the_step_inputs_upload_without_a_wait():
    from moe.train.trainer import Trainer

    loader = SimpleNamespace(batch=lambda first: (torch.zeros(2, 8, dtype=torch.int64), torch.ones(2, 8)))
    trainer = SimpleNamespace(device=META, pipe=SimpleNamespace(split_batch=lambda inputs, labels: (inputs, labels)))
    with HostSyncDetector() as syncs:
        (ids,), (labels,) = Trainer.batch(trainer, loader, 0)
    assert syncs.flagged == [], syncs.summary()
    assert ids.device == labels.device == META


@pytest.mark.gpu
def test_the_detector_agrees_with_cuda_sync_debug_mode():
    """On CUDA, torch's own check (``set_sync_debug_mode("error")`` raises at a stream sync) and the detector
    agree, case by case; the sync-free forms (pinned non-blocking upload, fill, mask assignment) pass both."""
    host = torch.arange(4)
    dev = torch.arange(4, device="cuda")
    cases = {
        "upload": (lambda: host.to("cuda"), True),
        "tensor from Python data": (lambda: torch.tensor([3], device="cuda"), True),
        "copy_ into the device": (lambda: dev.clone().copy_(host), True),
        "download": (lambda: dev.cpu(), True),
        "mask scatter of a device value": (lambda: dev.clone().__setitem__(dev > 1, dev[:1]), True),
        "to_device": (lambda: to_device(host, "cuda"), False),
        "fill": (lambda: torch.full((1,), 3, device="cuda"), False),
        "mask assignment": (lambda: dev.clone().__setitem__(dev > 1, 0), False),
    }
    for name, (run, syncs) in cases.items():
        torch.cuda.synchronize()
        with HostSyncDetector() as detector:
            torch.cuda.set_sync_debug_mode("error")
            try:
                run()
                raised = False
            except RuntimeError:
                raised = True
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert (raised, bool(detector.flagged)) == (syncs, syncs), (name, detector.summary())


# ------------------------------------------------------------------------------------- the 2-rank run


def _trainer_setup(rank: int) -> dict:
    """moe.train's main over the V2 emulation, one step: buffers and JIT builds before and during step 1."""
    from moe.train import main
    from moe.train.trainer import Trainer
    from tests.moe.dispatch import fake_deep_ep_v2

    made: list = []
    real_init, real_step = fake_deep_ep_v2.ElasticBuffer.__init__, Trainer.train_step
    seen: dict = {}

    @functools.wraps(real_init)
    def init(self, *args, **kwargs) -> None:
        real_init(self, *args, **kwargs)
        made.append(self)

    def snapshot() -> dict:
        buf = made[0] if made else None
        return {
            "buffers": len(made),
            "calls": list(buf.calls) if buf else [],
            "compiled": list(buf.compiled) if buf else [],
            "fp8": buf.use_fp8_dispatch if buf else None,
            "max_tokens": buf.num_max_tokens_per_rank if buf else None,
        }

    def train_step(self, step: int):
        seen.setdefault("before", snapshot())
        out = real_step(self, step)
        seen.setdefault("after", snapshot())
        return out

    argv = ["--preset", "tiny", "--layers", "2", "--hidden-size", "256", "--seq-len", "16"]
    argv += ["--micro-batch-size", "2", "--val-every", "0", "--log-every", "100", "--steps", "1"]
    argv += ["--pp", "1", "--ep", "2", "--dispatcher", "deepep-v2", "--dtype", "bfloat16", "--fp8-dispatch"]
    fake_deep_ep_v2.ElasticBuffer.__init__, Trainer.train_step = init, train_step
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(argv)
    finally:
        fake_deep_ep_v2.ElasticBuffer.__init__, Trainer.train_step = real_init, real_step
    seen["banner"] = [line for line in out.getvalue().splitlines() if line.startswith("MoE ")]
    return seen


def _v2_sync_free_pair(rank: int) -> dict:
    """deepep-v2 in sync-free mode, warmed up as the trainer does: one overlapped pair under the detector."""
    from moe import MoEStage, lm_loss
    from moe.dispatch import DispatchOptions, make_dispatcher

    cfg = tiny_config(hidden_size=256)
    bf16 = torch.bfloat16
    dispatcher = make_dispatcher(
        "deepep-v2",
        cfg.num_experts,
        dist.group.WORLD,
        DispatchOptions(hidden_size=256, dtype=bf16, sync_free=True, deterministic=True),
    )
    dispatcher.warm_up(2 * 16, cfg.top_k, cfg.hidden_size, dtype=bf16, device="cpu")
    buffer = dispatcher.buffer
    stage = MoEStage(cfg, range(1, 3), first=False, last=True, dispatcher=dispatcher)
    stage.reset_parameters(SEED)
    stage.to(bf16)
    gen = torch.Generator().manual_seed(rank)
    h_a, h_b = (torch.randn(2, 16, 256, generator=gen).to(bf16).requires_grad_() for _ in range(2))
    (_, labels_a), (_, labels_b) = (batch(cfg, 2, 16, seed=10 * rank + i) for i in range(2))
    loss_a = lm_loss(stage(h_a), labels_a)
    with HostSyncDetector() as syncs:
        MoEStage.overlapped_forward_backward(stage, [h_b], lm_loss, [labels_b], stage, loss_a, None, None)
    ours = [f for f in syncs.flagged if EMULATIONS not in f.where and REFERENCE_KERNELS not in f.where]
    same_buffer = dispatcher.buffer is buffer
    dispatcher.close()
    return {"flagged": [f"{f.op} at {f.where}" for f in ours], "same_buffer": same_buffer}


def _p2p_header(rank: int) -> dict:
    """An inferred-shape message to a device (``meta`` for CUDA): its header goes up without a wait."""
    p2p = P2P(dist.group.WORLD, [0, 1], META, num_paths=1)
    with HostSyncDetector() as syncs:
        ops = p2p.send_ops(1 - rank, Message(0, 0, False), [torch.empty(2, 3, device=META), None])
    return {"flagged": syncs.summary() if syncs.flagged else "", "header_device": str(ops[0].tensor.device)}


ROW_S = 0.25
"""Emulated seconds a row all-to-all occupies its group's stream (far more than the pair's compute between a
count exchange's start and its wait here)."""


class _StreamOrder:
    """NCCL's order over gloo, for ``all_to_all_single``: a process group runs its collectives one after another on
    one stream (ProcessGroupNCCL: one communicator and stream per group and device), a row exchange occupies it
    :data:`ROW_S` seconds, and waiting a row exchange is the stream's wait (the host goes on; gloo has delivered
    the data). The host's read of a count exchange (int64, read with ``tolist``) blocks until the group's stream
    has run it. ``ops`` records (group, kind, issued, done) in issue order, on the host's clock."""

    def __init__(self) -> None:
        self.real = dist.all_to_all_single
        self.free_at: dict[object, float] = {}
        self.ops: list[tuple[object, str, float, float]] = []

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        work = self.real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=True)
        group = group if group is not None else dist.group.WORLD
        kind = "counts" if input.dtype == torch.int64 else "rows"
        issued = time.perf_counter()
        done = max(issued, self.free_at.get(group, 0.0)) + (ROW_S if kind == "rows" else 0.0)
        self.free_at[group] = done
        self.ops.append((group, kind, issued, done))
        emulated = _EmulatedWork(work, done if kind == "counts" else None)
        if not async_op:
            emulated.wait()
            return None
        return emulated


class _EmulatedWork:
    def __init__(self, work: dist.Work, host_read_at: float | None) -> None:
        self.work, self.host_read_at = work, host_read_at

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        if self.host_read_at is not None:
            time.sleep(max(0.0, self.host_read_at - time.perf_counter()))
        return True


def _counts_timeline(rank: int) -> dict:
    """alltoall at ep=2: the layout's groups, then one overlapped pair recorded under NCCL's stream order."""
    from dualpipe.events import EventRecorder
    from moe import lm_loss
    from moe.groups import group_timeout
    from moe.parallel import ParallelConfig, build_stages, init_layout

    layout = init_layout(ParallelConfig(pp=1, ep=2, schedule="1f1b", dispatcher="alltoall"))
    counts = layout.counts_group
    got: dict = {"distinct": counts is not None and counts is not layout.ep_group}
    if counts is not None:
        got["ranks"] = dist.get_process_group_ranks(counts) == dist.get_process_group_ranks(layout.ep_group)
        got["timeout"] = group_timeout(counts).total_seconds()
    cfg = tiny_config()
    (stage,) = build_stages(cfg, layout, seed=SEED)
    got["wired"] = counts is not None and stage.dispatcher.counts_group is counts
    (ids_a, labels_a), (ids_b, labels_b) = (batch(cfg, 2, 16, seed=10 * rank + i) for i in range(2))
    loss_a = lm_loss(stage(ids_a), labels_a)
    order = _StreamOrder()
    stage.recorder = EventRecorder()
    dist.all_to_all_single = order
    try:
        type(stage).overlapped_forward_backward(stage, [ids_b], lm_loss, [labels_b], stage, loss_a, None, None)
    finally:
        dist.all_to_all_single = order.real
    events = stage.recorder.events
    spans = []
    for layer in sorted({e.layer for e in events if e.name == "counts"}):
        start, wait = (
            next(e.stamp for e in events if (e.name, e.layer, e.edge) == ("counts", layer, edge))
            for edge in ("start", "wait")
        )
        in_flight = [
            done for g, kind, t, done in order.ops if g is layout.ep_group and kind == "rows" and t < start < done
        ]
        spans.append((layer, wait, in_flight))
    got["spans"] = spans
    return got


def _ranks(rank: int, world: int) -> dict:
    """Every part on both ranks; a part that raises gives its traceback (its test fails with it), the rest run."""
    sys.modules["deep_ep"] = __import__("tests.moe.dispatch.fake_deep_ep_v2", fromlist=["ElasticBuffer"])
    parts = {"trainer": _trainer_setup, "v2_pair": _v2_sync_free_pair, "p2p": _p2p_header, "counts": _counts_timeline}
    results = {}
    for name, part in parts.items():
        try:
            results[name] = part(rank)
        except Exception:  # both ranks fail alike here (the same code on the same shapes)
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_ranks, world_size=2, timeout=240, pg_timeout=PG_TIMEOUT)


def _part(ranks: list[dict], name: str) -> list[dict]:
    for got in ranks:
        assert "error" not in got[name], got[name].get("error")
    return [got[name] for got in ranks]


def test_deepep_v2_is_built_and_warmed_at_setup(ranks: list[dict]) -> None:
    trainer = _part(ranks, "trainer")
    for rank, got in enumerate(trainer):
        before, after = got["before"], got["after"]
        # Built once, before step 1, for the step's tokens (2 x 16) and FP8 dispatch; every transfer ran once:
        # dispatch, combine, the gradient of dispatch (a combine with weights), of combine (a cached dispatch).
        assert before["buffers"] == 1 and before["max_tokens"] == 32 and before["fp8"] is True
        assert before["calls"] == ["dispatch", "combine", "combine", "dispatch(cached)"]
        # Step 1 ran transfers, but built no buffer and compiled no kernel the warm-up had not.
        assert after["buffers"] == 1 and len(after["calls"]) > len(before["calls"])
        assert after["compiled"] == before["compiled"], (rank, after["compiled"][len(before["compiled"]) :])
    (banner,) = trainer[0]["banner"]
    assert " overlap=True deepep-v2 (ready in " in banner, banner


def test_deepep_v2_sync_free_pair_issues_no_host_sync(ranks: list[dict]) -> None:
    # Before the warm-up existed, the pair built the buffer: an all-reduce of the token count read on the host.
    for got in _part(ranks, "v2_pair"):
        assert got == {"flagged": [], "same_buffer": True}


def test_p2p_shape_header_uploads_without_a_wait(ranks: list[dict]) -> None:
    for got in _part(ranks, "p2p"):
        assert got == {"flagged": "", "header_device": "meta"}


def test_counts_exchange_has_its_own_group(ranks: list[dict]) -> None:
    for got in _part(ranks, "counts"):
        assert got["distinct"] and got["ranks"] and got["wired"]
        assert got["timeout"] == PG_TIMEOUT


def test_counts_wait_does_not_sit_behind_the_other_micro_batch(ranks: list[dict]) -> None:
    """In the pair, F's count exchange starts while B's all-to-alls are in flight on the expert group; with its
    own group its wait ends before the last of them does (on the expert group it queued behind them all)."""
    for got in _part(ranks, "counts"):
        spans = got["spans"]
        assert len(spans) == 3  # the tiny model's 3 MoE layers
        assert all(in_flight for _, _, in_flight in spans), spans  # something to sit behind, in every layer
        for layer, wait, in_flight in spans:
            assert wait < max(in_flight), (layer, wait, in_flight)
