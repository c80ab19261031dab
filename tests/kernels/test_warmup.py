"""The kernel warm-up: which shape classes it covers for a model, and that it does nothing off CUDA."""

from __future__ import annotations

import sys

import pytest
import torch

from kernels import registry, warmup
from kernels.warmup import KernelShapes, ShapeClass, int_class, shape_class, shape_classes
from moe import MoEModel, lm_loss
from moe.models.config import preset
from tests.moe.helpers import batch, tiny_config


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[ShapeClass]:
    """Every kernels.ops call that reaches the torch reference, as its shape class (the op table looks
    implementations up on their module at call time, so replacing the module attribute intercepts it)."""
    monkeypatch.setenv("DUALPIPE_KERNELS", "torch")
    calls: list[ShapeClass] = []
    for name in warmup.ops._OPS:
        fn = registry.implementation(name, "torch")

        def spy(*args, _name=name, _fn=fn, **kwargs):
            calls.append(shape_class(_name, *args, **kwargs))
            return _fn(*args, **kwargs)

        monkeypatch.setattr(sys.modules[fn.__module__], name, spy)
    return calls


def test_int_class_matches_triton_specialisation():
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    for value in (0, 1, 2, 15, 16, 17, 48, 2**31 - 1, 2**31, 2**31 + 16):
        kind, spec = native(BaseBackend, value, False, True, True)
        want = "1" if kind == "constexpr" else ("16" if spec == "D" else "n")
        want += "64" if kind == "i64" else ""
        assert int_class(value) == want, value


def test_small_preset_autotune_keys():
    # small: D=1024, F=256, 64 experts on one rank. The four GEMMs of the expert MLP (gate|up forward,
    # down forward, and their input-grads on transposed weight views) and the two weight-grads.
    shapes = KernelShapes.from_config(preset("small"), tokens=4096, ep=1)
    gemms = {c.key[:4] for c in shape_classes(shapes) if c.op == "grouped_gemm"}
    assert gemms == {
        (512, 1024, 512, 1),  # x @ w1[e]        N=2F, K=D, w1 [E, D, 2F] row-major
        (1024, 256, 1024, 1),  # a @ w2[e]       N=D, K=F
        (256, 1024, 1, 1024),  # dy @ w2[e]^T    transposed view: stride_wk=1
        (1024, 512, 1, 512),  # dh @ w1[e]^T
    }
    wgrads = {c.key[:2] for c in shape_classes(shapes) if c.op == "grouped_gemm_wgrad"}
    assert wgrads == {(1024, 256), (512, 1024)}
    # Every GEMM class is in bf16 with E=64 (a multiple of 16 for the JIT).
    assert all(c.key[-3:] == ("16", "bfloat16", "int64") for c in shape_classes(shapes) if "gemm" in c.op)


def test_ep_divides_the_local_experts_and_shared_widths_are_listed():
    cfg = preset("small")
    shapes = KernelShapes.from_config(cfg, tokens=512, ep=8)
    assert shapes.num_local_experts == 8 and shapes.num_experts == 64
    assert shapes.dense_intermediates == (cfg.dense_intermediate_size, cfg.moe_intermediate_size)
    with pytest.raises(ValueError, match="divide num_experts"):
        KernelShapes.from_config(cfg, tokens=512, ep=3)
    with pytest.raises(ValueError, match="tokens must be positive"):
        KernelShapes.from_config(cfg, tokens=0, ep=1)


def test_every_row_class_is_covered():
    # R and M change every step; the permute and SwiGLU kernels take them as arguments, so every class
    # of each (and of R*K) that the routing can produce must have been compiled.
    shapes = KernelShapes.from_config(tiny_config(), tokens=64, ep=1)
    classes = shape_classes(shapes)
    m_classes = {c.key[2] for c in classes if c.op == "swiglu" and c.key[0] == shapes.expert_intermediate}
    assert m_classes == {"1", "16", "n"}
    # the expert rows' SwiGLU carries the routing weights (its scaled variant); a dense one does not
    expert_swiglu = {c.key[3] for c in classes if c.op == "swiglu" and c.key[0] == shapes.expert_intermediate}
    assert "scaled" in expert_swiglu and any(c.op == "swiglu_scaled_backward" for c in classes)
    # (R, R*K) with K=2: R=1 gives S=2 ("1","n"); R%16 == 0 gives ("16","16"); odd R ("n","n");
    # R = 8 mod 16 gives S%16 == 0 ("n","16").
    permute = {c.key[-2:] for c in classes if c.op == "permute"}
    assert permute == {("1", "n"), ("16", "16"), ("n", "n"), ("n", "16")}
    # M=0, 1 and 2 with R=1 (the combine kernels still launch on R rows): the unweighted combine is
    # permute_backward's kernel, its backward unpermute_backward's without the weights' gradient.
    combine = {c.key[-2:] for c in classes if c.op == "permute_backward"}
    assert {("16", "1"), ("1", "1"), ("n", "1")} <= combine
    combine_bwd = {c.key[-3:] for c in classes if c.op == "unpermute_backward"}
    assert {("16", "1", "no-dweights"), ("1", "1", "no-dweights"), ("n", "1", "no-dweights")} <= combine_bwd


def test_shape_classes_are_what_the_warm_up_calls(recorded):
    # shape_classes replays the warm-up on meta tensors; here the same calls run for real on the torch
    # reference, and the classes must be the same set.
    shapes = KernelShapes.from_config(tiny_config(), tokens=24, ep=2, dtype=torch.float32)
    warmup._run_all(shapes, torch.device("cpu"), comm_sms=0)
    assert set(recorded) == set(shape_classes(shapes))


def test_model_calls_are_covered(recorded):
    # The model's own forward and backward on CPU: each call's class must be one the warm-up compiles.
    cfg = tiny_config()
    ids, labels = batch(cfg, size=2, seq=16)
    model = MoEModel(cfg, seed=0)
    lm_loss(model(ids), labels).backward()
    assert recorded, "the model made no kernel call"
    ops_seen = {c.op for c in recorded}
    assert {
        "grouped_gemm", "grouped_gemm_wgrad", "permute", "permute_backward", "unpermute_backward", "swiglu",
        "swiglu_scaled_backward", "router_topk",
    } <= ops_seen  # fmt: skip
    shapes = KernelShapes.from_config(cfg, tokens=2 * 16, ep=1, dtype=torch.float32)
    missing = set(recorded) - shape_classes(shapes)
    assert not missing, f"the warm-up does not cover: {sorted(missing)}"


@pytest.mark.parametrize("kernels_env", ["auto", "torch", "triton"])
def test_warm_up_is_a_noop_off_cuda(recorded, monkeypatch, kernels_env):
    # Also with Triton forced (the interpreter runs CPU tensors): nothing to compile or tune ahead there.
    monkeypatch.setenv("DUALPIPE_KERNELS", kernels_env)
    shapes = KernelShapes.from_config(tiny_config(), tokens=32, ep=1, dtype=torch.float32)
    assert warmup.warm_up(shapes, "cpu") == ()
    assert recorded == []


def test_every_triton_op_declares_what_the_warm_up_and_aot_need():
    # The warm-up and kernels.aot keep no list of kernels: each Triton launcher declares its classes and
    # meta results, and each Triton module its AOT launches, so a module that forgets shows here.
    pytest.importorskip("triton")
    triton_ops = registry.op_names("triton")
    for name in triton_ops:
        spec = registry.specialization(name)
        assert spec.kernel is None or spec.kernel in triton_ops, name
    modules = {registry.implementation(name, "triton").__module__ for name in triton_ops}
    assert modules == {build.__module__ for build in registry.aot_spec_builders()}


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown op"):
        shape_class("matmul", torch.empty(1))


@pytest.mark.gpu
def test_no_compile_or_tuning_after_warm_up():
    # On the GPU: after warm_up, a forward and backward of the model compiles nothing and adds no
    # autotune entry (triton.knobs.runtime.jit_cache_hook is called on every compile-cache miss).
    triton = pytest.importorskip("triton")
    if not hasattr(triton, "knobs"):  # triton.knobs (and its compile hooks) came with Triton 3.4
        pytest.skip(f"Triton {triton.__version__} has no triton.knobs.runtime.jit_cache_hook")
    from kernels import triton_grouped_gemm

    cfg = tiny_config(hidden_size=64, moe_intermediate_size=32, dense_intermediate_size=96)
    dtype = torch.bfloat16
    model = MoEModel(cfg, seed=0).to("cuda", dtype)
    ids, labels = batch(cfg, size=2, seq=32)
    shapes = KernelShapes.from_config(cfg, tokens=2 * 32, ep=1, dtype=dtype)
    assert warmup.warm_up(shapes, "cuda")
    tuned = {name: dict(triton_grouped_gemm._autotuned(name).cache) for name in ("forward", "wgrad")}
    misses = []
    triton.knobs.runtime.jit_cache_hook = lambda *a, **k: misses.append(k.get("fn") or a) and False
    try:
        lm_loss(model(ids.cuda()), labels.cuda()).backward()
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert misses == [], f"{len(misses)} kernel compiles after the warm-up"
    assert {name: dict(triton_grouped_gemm._autotuned(name).cache) for name in tuned} == tuned


def test_warm_up_routing_is_like_a_real_dispatch():
    # m routed slots over R rows, spread over the rows first, distinct local experts within a row.
    shapes = KernelShapes.from_config(tiny_config(), tokens=32, ep=1)
    for r, m in [(5, 7), (32, 64), (33, 0), (1, 1)]:
        idx = warmup._routing(r, m, shapes, torch.device("cpu"))
        assert idx.shape == (r, shapes.top_k) and int((idx >= 0).sum()) == m
        assert int((idx >= 0).any(1).sum()) == min(r, m)
        for row in idx:
            picked = row[row >= 0]
            assert picked.unique().numel() == picked.numel() and (picked < shapes.num_local_experts).all()
