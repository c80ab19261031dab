"""The bridge's per-version table (:data:`dualpipe._torch_pipelining.KNOWN_TORCH`): which torch resolves to
which internals, and the one-line refusals for a torch it does not know or cannot start on gloo."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dualpipe import _torch_pipelining as tp


def test_a_known_version_resolves_to_its_internals():
    assert tp.resolve("2.13.0+cpu") == ((2, 13), tp.KNOWN_TORCH[(2, 13)])
    minor, old = tp.resolve("2.11.0+cu130")
    assert minor == (2, 11) and not old.loss_kwargs and old.greets_own_rank
    assert "loss_kwargs" not in old.runtime_methods["_maybe_compute_loss"]
    assert tp.KNOWN_TORCH[(2, 13)].runtime_methods["_maybe_compute_loss"][-1] == "loss_kwargs"


@pytest.mark.parametrize("version", ["2.12.1", "2.10.0", "3.0.0", "nightly"])
def test_an_unknown_version_is_one_line_naming_it(version: str):
    with pytest.raises(tp.TorchPipeliningMismatch) as refused:
        tp.resolve(version)
    msg = str(refused.value)
    assert "\n" not in msg and f"this is torch {version}." in msg
    assert "internals of torch 2.11, 2.13" in msg and "allow_untested_torch=True" in msg


def test_an_untested_version_takes_the_nearest_older_known_internals():
    assert tp.resolve("2.12.1", allow_untested=True)[0] == (2, 11)
    assert tp.resolve("2.14.0", allow_untested=True)[0] == (2, 13)
    assert tp.resolve("2.9.0", allow_untested=True)[0] == min(tp.KNOWN_TORCH)  # older than all: the oldest
    assert tp.resolve("9.0.0", allow_untested=True)[0] == max(tp.KNOWN_TORCH)


def test_the_running_torch_is_known():
    # the pin (2.13) and every compat run's torch (scripts/compat.sh) are in the table
    assert tp.resolve(torch.__version__)[1] is tp.internals()


def test_gloo_ranks_are_refused_where_the_warm_up_greets_its_own_rank(monkeypatch):
    greets = tp.Internals(runtime_methods={}, loss_kwargs=False, greets_own_rank=True)
    schedule = SimpleNamespace(_stages=[SimpleNamespace(device=torch.device("cpu"), group=None)])
    monkeypatch.setattr(tp.dist, "get_backend", lambda group: "gloo")
    monkeypatch.setattr(tp, "internals", lambda: greets)
    with pytest.raises(tp.TorchPipeliningMismatch, match=r"cannot start on CPU ranks over gloo") as refused:
        tp.check_backend(schedule)
    assert "\n" not in str(refused.value)
    monkeypatch.setattr(tp.dist, "get_backend", lambda group: "nccl")
    tp.check_backend(schedule)  # NCCL delivers to its own rank
    monkeypatch.setattr(tp, "internals", lambda: tp.KNOWN_TORCH[(2, 13)])
    monkeypatch.setattr(tp.dist, "get_backend", lambda group: "gloo")
    tp.check_backend(schedule)  # 2.13's warm-up does not greet its own rank
