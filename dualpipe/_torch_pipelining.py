"""Every private part of ``torch.distributed.pipelining`` that :mod:`dualpipe.torch_bridge` touches, and the
recording of torch's pipeline messages (:func:`record_batch_p2p`, what the overlap benchmark times them with).

torch runs a registered function for each ``OVERLAP_F_B`` action of a ``_PipelineScheduleRuntime``, but
that function's arguments (``_Action``, ``_PipelineContext``) and the runtime state it has to keep up (the
receives it waits for, the stored losses, the backward counter, the stage's compute entry points) are
underscore names or undocumented contracts. This module is the only place that uses them: :func:`check_torch`
resolves every one (and checks the torch version) before the bridge registers anything, so a torch that
renamed or reshaped one fails with that name, not inside a step. :func:`record_batch_p2p` swaps two module
functions for the length of a block and checks them itself, since it runs without the bridge too.

Written against torch 2.13 (``schedules.py``: ``_PipelineScheduleRuntime._step_microbatches`` and its nested
``_perform_action``; ``stage.py``: ``_PipelineStageBase``) and compared with the same two files of every torch
in :data:`KNOWN_TORCH`, which holds what differs per version.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining import stage as _stage

__all__ = [
    "KNOWN_TORCH",
    "TESTED_TORCH",
    "Internals",
    "Pair",
    "StepInputs",
    "TorchPipeliningMismatch",
    "check_backend",
    "check_schedule",
    "check_torch",
    "count_backward",
    "intercept_compute",
    "internals",
    "local_stages",
    "pair_of",
    "record_batch_p2p",
    "record_loss",
    "register_overlap",
    "resolve",
    "runtime_class",
    "step_inputs",
    "stored_loss",
    "wait_receives",
]


class TorchPipeliningMismatch(RuntimeError):
    """This torch's pipelining internals are not the ones the bridge was written against."""


@dataclass(frozen=True, slots=True)
class Internals:
    """What differs, between torch versions, in the private names the bridge needs."""

    runtime_methods: Mapping[str, tuple[str, ...]]
    """``_PipelineScheduleRuntime`` methods the bridge calls -> their leading parameter names."""
    loss_kwargs: bool
    """``step()`` and ``_maybe_compute_loss`` take ``loss_kwargs`` (the loss function's keyword arguments)."""
    greets_own_rank: bool
    """A stage's first step sends a warm-up message to each neighbour stage, also to one on its own rank
    (``_get_init_p2p_neighbors_ops``; a V schedule always has one): gloo cannot send to its own rank, so
    torch's ScheduleDualPipeV does not start on CPU ranks there, with or without the bridge."""


# What check_torch resolves. Parameter names are checked because the bridge passes them by keyword or relies
# on their order.
_MODULE_NAMES = (
    "_PipelineScheduleRuntime",
    "_PipelineContext",
    "_Action",
    "_wait_batch_p2p",
    "OVERLAP_F_B",
    "FORWARD",
    "FULL_BACKWARD",
)
_RUNTIME_METHODS_2_13: dict[str, tuple[str, ...]] = {
    "register_custom_function": ("computation_type", "custom_function"),
    "_maybe_compute_loss": ("stage", "output", "target_mbs", "mb_index", "loss_kwargs"),
    "_maybe_get_loss": ("stage", "mb_index"),
}
# torch 2.11's loss function takes (output, target) only: no loss_kwargs in step() or _maybe_compute_loss
_RUNTIME_METHODS_2_11 = {
    **_RUNTIME_METHODS_2_13,
    "_maybe_compute_loss": ("stage", "output", "target_mbs", "mb_index"),
}
KNOWN_TORCH: dict[tuple[int, int], Internals] = {
    (2, 11): Internals(runtime_methods=_RUNTIME_METHODS_2_11, loss_kwargs=False, greets_own_rank=True),
    (2, 13): Internals(runtime_methods=_RUNTIME_METHODS_2_13, loss_kwargs=True, greets_own_rank=False),
    (2, 15): Internals(runtime_methods=_RUNTIME_METHODS_2_13, loss_kwargs=True, greets_own_rank=False),
}
"""Each torch (major, minor) the bridge was compared with and tested on -> what its internals look like there.
The names not listed here (stage methods, action and context fields, runtime state) are the same in all."""

TESTED_TORCH = tuple(KNOWN_TORCH)
"""The torch (major, minor) versions the bridge was tested with, oldest first."""

_STAGE_METHODS: dict[str, tuple[str, ...]] = {
    "forward_one_chunk": ("fwd_chunk_id", "args", "kwargs", "save_forward_output"),
    "backward_one_chunk": ("bwd_chunk_id", "loss", "full_backward", "last_backward"),
    "forward_maybe_with_nosync": ("args", "kwargs"),
    "backward_maybe_with_nosync": ("backward_type", "bwd_kwargs", "last_backward"),
    "set_local_fwd_input": ("prev_stage_outputs", "mb_index"),
    "set_local_bwd_input": ("next_stage_bwd_outputs", "mb_index"),
    "get_local_bwd_output": ("mb_index",),
}
_ACTION_FIELDS = ("stage_index", "computation_type", "microbatch_index", "sub_actions")
_CONTEXT_FIELDS = ("schedule_ref", "arg_mbs", "kwarg_mbs", "target_mbs")
_RUNTIME_STATE = ("_stages", "_n_microbatches", "fwd_recv_ops", "bwd_recv_ops", "backward_counter")
_STAGE_STATE = ("submod", "stage_index", "is_first", "is_last", "has_backward", "device", "group")
# the keys torch's backward_one_chunk hands to backward_maybe_with_nosync
_BACKWARD_KWARGS = ("stage_output", "output_grads", "input_values")


def _minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _dotted(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def _nearest_known(version: tuple[int, int] | None) -> tuple[int, int]:
    """The newest known version not after ``version`` (the oldest known one for an older or unreadable one)."""
    older = [v for v in KNOWN_TORCH if version is not None and v <= version]
    return max(older) if older else min(KNOWN_TORCH)


def resolve(version: str, allow_untested: bool = False) -> tuple[tuple[int, int], Internals]:
    """(the known torch whose internals apply, those internals) for torch ``version`` (``"2.11.0+cu130"``).

    An unknown version raises :class:`TorchPipeliningMismatch` in one line naming it and the known ones, unless
    ``allow_untested``: then the nearest older known version's internals apply (every name is still checked).
    """
    minor = _minor(version)
    if minor in KNOWN_TORCH:
        return minor, KNOWN_TORCH[minor]
    if not allow_untested:
        known = ", ".join(_dotted(v) for v in KNOWN_TORCH)
        raise TorchPipeliningMismatch(
            f"dualpipe's torch bridge knows the torch.distributed.pipelining internals of torch {known} and was "
            f"tested there only; this is torch {version}. Use one of those, or pass allow_untested_torch=True to "
            f"try with torch {_dotted(_nearest_known(minor))}'s (every private name it needs is still checked)."
        )
    near = _nearest_known(minor)
    return near, KNOWN_TORCH[near]


@functools.cache
def _resolved(version: str) -> tuple[tuple[int, int], Internals]:
    return resolve(version, allow_untested=True)


def internals() -> Internals:
    """The internals of the running torch (an unknown version: the nearest older known one's)."""
    return _resolved(str(torch.__version__))[1]


def _mismatch(
    what: str, user: str = "dualpipe's torch bridge", instead: str = "run the schedule without the bridge"
) -> TorchPipeliningMismatch:
    near = _dotted(_resolved(str(torch.__version__))[0])
    return TorchPipeliningMismatch(
        f"{user} needs {what}, a torch.distributed.pipelining internal as of torch {near}; "
        f"torch {torch.__version__} lacks it or changed it. Use a torch in "
        f"dualpipe._torch_pipelining.KNOWN_TORCH, or {instead}."
    )


def _check_params(owner: str, fn: Any, names: Sequence[str], **refusal: str) -> None:
    try:
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
    except (TypeError, ValueError):  # not introspectable: trust the name
        return
    if list(params[: len(names)]) != list(names):
        raise _mismatch(f"{owner}({', '.join(names)}, ...), found ({', '.join(params)})", **refusal)


def check_torch(allow_untested: bool = False) -> None:
    """Raise :class:`TorchPipeliningMismatch` naming the first missing or reshaped private name, or the torch
    version when it is not in :data:`KNOWN_TORCH` (unless ``allow_untested``)."""
    _, needs = resolve(str(torch.__version__), allow_untested)
    where = "torch.distributed.pipelining.schedules"
    for name in _MODULE_NAMES:
        if not hasattr(_schedules, name):
            raise _mismatch(f"{where}.{name}")
    runtime = _schedules._PipelineScheduleRuntime
    for name, params in needs.runtime_methods.items():
        if not callable(getattr(runtime, name, None)):
            raise _mismatch(f"{where}._PipelineScheduleRuntime.{name}")
        _check_params(f"{where}._PipelineScheduleRuntime.{name}", getattr(runtime, name), params)
    stage_base = getattr(_stage, "_PipelineStageBase", None)
    if stage_base is None:
        raise _mismatch("torch.distributed.pipelining.stage._PipelineStageBase")
    for name, params in _STAGE_METHODS.items():
        if not callable(getattr(stage_base, name, None)):
            raise _mismatch(f"torch.distributed.pipelining.stage._PipelineStageBase.{name}")
        _check_params(f"_PipelineStageBase.{name}", getattr(stage_base, name), params)
    action_fields = getattr(_schedules._Action, "_fields", ())
    for name in _ACTION_FIELDS:
        if name not in action_fields:
            raise _mismatch(f"{where}._Action.{name}")
    context = _schedules._PipelineContext
    context_fields = {f.name for f in fields(context)} if is_dataclass(context) else set()
    for name in _CONTEXT_FIELDS:
        if name not in context_fields:
            raise _mismatch(f"{where}._PipelineContext.{name}")


# torch's runtime posts every batch of pipeline sends and receives through _batch_p2p (directly or through
# _sorted_batch_p2p) and waits for them through _wait_batch_p2p, looking both up in the module per call
_POST, _WAIT = "_batch_p2p", "_wait_batch_p2p"
_POST_PARAMS = ("p2p_ops", "desc")  # torch passes desc by keyword; the wrapper does too


@contextlib.contextmanager
def record_batch_p2p(span: Callable[[str, str | None], contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    """While open, each batch of pipeline messages torch posts runs inside ``span("post", desc)`` (``desc``:
    torch's label such as ``"fwd_send"``, or None) and each wait for posted messages inside ``span("wait",
    None)``; the module's own functions are back on exit, also on an error. A post that torch splits into
    several posts (per process group, torch 2.15) is one span.

    The swap is module-wide (every schedule of the process, while open); it refuses in one line
    (:class:`TorchPipeliningMismatch`) when this torch lacks either function or posts with other parameters.
    """
    refusal = {
        "user": "recording torch's pipeline messages",
        "instead": "run the schedule without recording its messages",
    }
    where = "torch.distributed.pipelining.schedules"
    for name in (_POST, _WAIT):
        if not callable(getattr(_schedules, name, None)):
            raise _mismatch(f"{where}.{name}", **refusal)
    post, wait = getattr(_schedules, _POST), getattr(_schedules, _WAIT)
    _check_params(f"{where}.{_POST}", post, _POST_PARAMS, **refusal)
    posting = False  # inside a recorded post: torch's nested posts are parts of it

    def recorded_post(p2p_ops, desc=None):
        nonlocal posting
        if posting:
            return post(p2p_ops, desc=desc)
        posting = True
        try:
            with span("post", desc):
                return post(p2p_ops, desc=desc)
        finally:
            posting = False

    def recorded_wait(work):
        with span("wait", None):
            return wait(work)

    setattr(_schedules, _POST, recorded_post)
    setattr(_schedules, _WAIT, recorded_wait)
    try:
        yield
    finally:
        setattr(_schedules, _POST, post)
        setattr(_schedules, _WAIT, wait)


def runtime_class() -> type:
    """torch's ``_PipelineScheduleRuntime``: the schedules that run ``OVERLAP_F_B`` actions."""
    return _schedules._PipelineScheduleRuntime


def check_schedule(schedule: Any) -> None:
    """The runtime state the bridge reads and updates, on this schedule and its local stages."""
    for name in _RUNTIME_STATE:
        if not hasattr(schedule, name):
            raise _mismatch(f"the schedule's {name} attribute")
    for stage in schedule._stages:
        for name in _STAGE_STATE:
            if not hasattr(stage, name):
                raise _mismatch(f"the pipeline stage's {name} attribute")


def check_backend(schedule: Any) -> None:
    """Refuse, in one line, a schedule this torch cannot start: stages on CPU ranks over gloo where the first
    step greets the stage on the same rank (:attr:`Internals.greets_own_rank`)."""
    if not internals().greets_own_rank:
        return
    for stage in schedule._stages:
        if torch.device(stage.device).type == "cpu" and "gloo" in str(dist.get_backend(stage.group)):
            raise TorchPipeliningMismatch(
                f"torch {torch.__version__}'s ScheduleDualPipeV cannot start on CPU ranks over gloo: its first step "
                "sends a warm-up message to the stage on the same rank, which gloo cannot deliver (torch 2.13's "
                "does not); use NCCL, or torch 2.13 or later on CPU"
            )


def local_stages(schedule: Any) -> dict[int, Any]:
    """This rank's pipeline stages by stage index."""
    return {s.stage_index: s for s in schedule._stages}


def pair_count(schedule: Any) -> int:
    """The ``OVERLAP_F_B`` actions of this rank's order (``pipeline_order``, or the order with communication a
    schedule loaded from a file holds): what the bridge would run through the hook each step."""
    order = getattr(schedule, "pipeline_order", None) or getattr(schedule, "pipeline_order_with_comms", None) or {}
    rank = schedule.rank if hasattr(schedule, "rank") else next(iter(order), None)
    return sum(a is not None and a.computation_type == _schedules.OVERLAP_F_B for a in order.get(rank, ()))


def register_overlap(schedule: Any, fn: Callable[[Any, Any], None]) -> None:
    schedule.register_custom_function(_schedules.OVERLAP_F_B, fn)


@dataclass(frozen=True, slots=True)
class Pair:
    """One ``OVERLAP_F_B`` action: the forward of one local stage and the full backward of another."""

    forward_stage: int
    forward_chunk: int
    backward_stage: int
    backward_chunk: int


def pair_of(action: Any) -> Pair:
    sub = action.sub_actions
    kinds = tuple(a.computation_type for a in sub or ())
    if kinds != (_schedules.FORWARD, _schedules.FULL_BACKWARD):
        raise _mismatch(f"OVERLAP_F_B actions made of a forward and a full backward, got {action}")
    f, b = sub
    return Pair(f.stage_index, f.microbatch_index, b.stage_index, b.microbatch_index)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What the running step hands a custom function: its schedule and the micro-batches."""

    schedule: Any
    arg_mbs: Sequence[tuple]
    kwarg_mbs: Sequence[dict]
    target_mbs: Sequence[Any] | None


def step_inputs(ctx: Any) -> StepInputs:
    return StepInputs(ctx.schedule_ref, ctx.arg_mbs, ctx.kwarg_mbs, ctx.target_mbs)


def wait_receives(schedule: Any, direction: str, stage_index: int, chunk: int) -> None:
    """Wait for the activations (``"F"``) or gradients (``"B"``) torch received for ``(stage, chunk)``."""
    pending = schedule.fwd_recv_ops if direction == "F" else schedule.bwd_recv_ops
    works = pending.pop((stage_index, chunk), None)
    if works is None:
        raise RuntimeError(f"stage {stage_index} micro-batch {chunk}: no receive posted for its {direction} input")
    # looked up per call, as torch's runtime does, so a wrapper installed on the module sees these waits too
    _schedules._wait_batch_p2p(works)


def stored_loss(schedule: Any, stage: Any, chunk: int) -> torch.Tensor | None:
    """The loss torch stored for ``chunk`` when ``stage`` is the last one (else None)."""
    return schedule._maybe_get_loss(stage, chunk)


def record_loss(schedule: Any, stage: Any, output: Any, target_mbs: Any, chunk: int, loss_kwargs: Any) -> None:
    """Compute and store ``chunk``'s loss when ``stage`` is the last one, as torch's forward action does
    (on a torch whose loss takes no ``loss_kwargs``, the bridge passes None)."""
    if internals().loss_kwargs:
        schedule._maybe_compute_loss(stage, output, target_mbs, chunk, loss_kwargs)
    else:
        schedule._maybe_compute_loss(stage, output, target_mbs, chunk)


def count_backward(schedule: Any, stage_index: int) -> bool:
    """Count one more backward of the stage; True for its last one in the step (torch syncs DP grads then)."""
    schedule.backward_counter[stage_index] += 1
    return schedule.backward_counter[stage_index] == schedule._n_microbatches


@contextlib.contextmanager
def _replaced(obj: Any, name: str, fn: Callable[..., Any]) -> Iterator[None]:
    missing = object()
    previous = obj.__dict__.get(name, missing)
    setattr(obj, name, fn)
    try:
        yield
    finally:
        if previous is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, previous)


@contextlib.contextmanager
def intercept_compute(
    forward_stage: Any,
    forward: Callable[..., Any],
    backward_stage: Any,
    backward: Callable[[Any, Any, Sequence[Any]], None],
) -> Iterator[None]:
    """While open, torch's own ``forward_one_chunk`` of ``forward_stage`` computes with ``forward(*args,
    **kwargs) -> output`` instead of calling the module, and ``backward_one_chunk`` of ``backward_stage``
    with ``backward(stage_output, output_grads, input_values)``, which must leave the input gradients in
    ``.grad`` of ``input_values`` as ``torch.autograd.backward`` would. torch's bookkeeping around both
    (received inputs, caches, weight-gradient runners, local hand-over) stays torch's."""

    def backward_maybe_with_nosync(backward_type: str, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full" or any(k not in bwd_kwargs for k in _BACKWARD_KWARGS):
            raise _mismatch(f"a 'full' backward with {_BACKWARD_KWARGS}, got {backward_type!r} {sorted(bwd_kwargs)}")
        values = bwd_kwargs["input_values"]
        backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], values)
        # what torch's stage_backward returns: each input's gradient, taken off the input
        grads = []
        for v in values:
            grads.append(v.grad if isinstance(v, torch.Tensor) else None)
            if isinstance(v, torch.Tensor):
                v.grad = None
        return tuple(grads), None

    with (
        _replaced(forward_stage, "forward_maybe_with_nosync", forward),
        _replaced(backward_stage, "backward_maybe_with_nosync", backward_maybe_with_nosync),
    ):
        yield
