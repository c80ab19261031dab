"""The measured-costs file: round trip, validation, scaling to another shape and cluster."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moe.plan.costs import Parallelism, Workload, layer_ops, phase_work, substage_costs
from moe.plan.hardware import GPUS, Cluster, with_overrides
from moe.plan.measured import FORMAT, VERSION, MeasuredCosts, device_of, load_costs, save_costs, scale_field
from tests.moe.helpers import tiny_config

CFG = tiny_config()
MOE = {"attn_F": 1e-3, "attn_dX": 1.5e-3, "attn_dW": 0.8e-3, "mlp_F": 2e-3, "mlp_dX": 2e-3, "mlp_dW": 1.9e-3}


def _measured(**changes) -> MeasuredCosts:
    base = dict(
        config=CFG, seq_len=32, tokens=64, moe={**MOE, "dispatch": 4e-3, "combine": 4e-3},
        dense={"attn_F": 1e-3, "mlp_F": 1e-3}, device="cpu", source="test", ep=4, gpus_per_node=2,
        nvlink_bytes_per_s=1e9, internode_bytes_per_s=5e7,
    )  # fmt: skip
    base.update(changes)
    return MeasuredCosts(**base)


def test_round_trip(tmp_path) -> None:
    m = _measured()
    path = tmp_path / "costs.json"
    save_costs(path, m)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION and data["config"]["num_experts"] == 8
    assert load_costs(path) == m


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d.update(format="other"), "not a planner costs file"),
        (lambda d: d.pop("tokens"), "missing keys"),
        (lambda d: d.update(extra=1), "unknown keys"),
        (lambda d: d["moe"].update(attn_G=1.0), "unknown fields"),
        (lambda d: d["moe"].update(attn_F=-1.0), "seconds >= 0"),
        (lambda d: d["dense"].update(dispatch=1.0), "no dispatch"),
        (lambda d: d.update(nvlink_bytes_per_s=None), "link rates"),
        (lambda d: d["config"].update(top_k=99), "bad config"),
        (lambda d: d.update(tokens=48), "multiple of seq_len"),
    ],
)
def test_validation_names_the_problem(tmp_path, edit, message) -> None:
    data = _measured().to_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_costs(path)


def test_not_json(tmp_path) -> None:
    path = tmp_path / "x.json"
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_costs(path)
    with pytest.raises(ValueError, match=r"missing\.json: cannot read it: No such file"):  # one line, no traceback
        load_costs(tmp_path / "missing.json")


def test_scaling() -> None:
    m = _measured()
    cluster = Cluster(with_overrides(GPUS["h800"], nvlink_bytes_per_s=1e9, internode_bytes_per_s=5e7), 4, 2)
    par = Parallelism(pp=1, dp=4, ep=4, schedule="1f1b")
    same = Workload(seq_len=32, micro_batch=2)
    # the measured shape maps to itself
    for name in (*MOE, "dispatch", "combine"):
        assert scale_field(m, name, CFG, cluster, par, same, moe=True) == pytest.approx(m.moe[name])
    # twice the sequences: the MLP's FLOPs double, attention's too (same S); the all-to-all's bytes double
    double = Workload(seq_len=32, micro_batch=4)
    assert scale_field(m, "mlp_F", CFG, cluster, par, double, moe=True) == pytest.approx(4e-3)
    assert scale_field(m, "attn_dW", CFG, cluster, par, double, moe=True) == pytest.approx(1.6e-3)
    assert scale_field(m, "dispatch", CFG, cluster, par, double, moe=True) == pytest.approx(8e-3)
    # twice the sequence length: attention scales by its FLOP ratio (the S^2 part grows 4x)
    longer = Workload(seq_len=64, micro_batch=2)
    ratio = phase_work(CFG, 128, 64, ep=4)["attn_F"][0] / phase_work(CFG, 64, 32, ep=4)["attn_F"][0]
    assert 2 < ratio < 4
    assert scale_field(m, "attn_F", CFG, cluster, par, longer, moe=True) == pytest.approx(1e-3 * ratio)
    # links twice as fast: the all-to-all halves (both parts scale)
    fast = Cluster(with_overrides(cluster.gpu, nvlink_bytes_per_s=2e9, internode_bytes_per_s=1e8), 4, 2)
    assert scale_field(m, "combine", CFG, fast, par, same, moe=True) == pytest.approx(2e-3)
    # recompute adds the (scaled) forward to dX; a file measured with recompute has it taken out first
    rc = dataclasses.replace(same, recompute=True)
    assert scale_field(m, "mlp_dX", CFG, cluster, par, rc, moe=True) == pytest.approx(4e-3)
    m_rc = _measured(recompute=True)
    assert scale_field(m_rc, "mlp_dX", CFG, cluster, par, same, moe=True) == pytest.approx(0.0)
    with pytest.raises(KeyError):
        scale_field(m, "head_F", CFG, cluster, par, same, moe=True)


def test_substage_costs_take_measured_fields_and_keep_the_rest() -> None:
    m = _measured()
    cluster = Cluster(with_overrides(GPUS["h800"], nvlink_bytes_per_s=1e9, internode_bytes_per_s=5e7), 4, 2)
    par = Parallelism(pp=1, dp=4, ep=4, schedule="1f1b")
    work = Workload(seq_len=32, micro_batch=2)
    analytic = substage_costs(CFG, cluster, par, work)
    used = substage_costs(CFG, cluster, par, work, measured=m)
    assert used.mlp_F == pytest.approx(2e-3) and used.dispatch == pytest.approx(4e-3)
    assert used.head_F == analytic.head_F and used.p2p == analytic.p2p  # not in the file: analytic
    dense = substage_costs(CFG, cluster, par, work, moe=False, measured=m)
    assert (
        dense.attn_F == pytest.approx(1e-3)
        and dense.attn_dX == substage_costs(CFG, cluster, par, work, moe=False).attn_dX
    )


def test_one_ep_rank_per_node_needs_no_intra_node_rate() -> None:
    m = _measured(gpus_per_node=1, nvlink_bytes_per_s=None)  # every all-to-all byte crosses nodes
    cluster = Cluster(with_overrides(GPUS["h800"], internode_bytes_per_s=5e7), 4, 1)
    par, work = Parallelism(pp=1, dp=4, ep=4), Workload(seq_len=32, micro_batch=2)
    assert scale_field(m, "dispatch", CFG, cluster, par, work, moe=True) == pytest.approx(4e-3)
    with pytest.raises(ValueError, match="link rates"):
        _measured(nvlink_bytes_per_s=None)  # two ep ranks per node: their NVLink bytes need a rate
    with pytest.raises(ValueError, match="positive"):
        _measured(internode_bytes_per_s=0.0)


def test_device_of_gives_the_measured_fields_back() -> None:
    m = _measured(gpus_per_node=1, nvlink_bytes_per_s=None, dense={})
    gpu = device_of(m, memory_bytes=16e9)
    work = phase_work(CFG, m.tokens, m.seq_len, ep=m.ep, act_bytes=m.act_bytes)
    for ph in ("F", "dX", "dW"):  # the file's mlp_* measured the shared experts with the routed ones
        work[f"mlp_{ph}"] = tuple(a + b for a, b in zip(work[f"mlp_{ph}"], work[f"shared_{ph}"]))
    flop = sum(work[k][0] for k in MOE)
    assert gpu.gemm_flops == pytest.approx(flop / sum(MOE.values()))
    assert gpu.hbm_bytes_per_s == pytest.approx(sum(work[k][1] for k in MOE) / sum(MOE.values()))
    assert (gpu.hbm_bytes, gpu.sms, gpu.internode_bytes_per_s, gpu.nvlink_bytes_per_s) == (16e9, 1, 5e7, 5e7)
    # the planner at the measured shape on this device: the measured fields, the analytic rest at its rates
    cluster = Cluster(gpu, 4, 1)
    par = Parallelism(pp=1, dp=4, ep=4)
    work_ = Workload(seq_len=32, micro_batch=2, comm_sms=0, act_bytes=2)
    c = substage_costs(CFG, cluster, par, work_, measured=m)
    assert (c.attn_F, c.mlp_dW, c.dispatch) == pytest.approx((1e-3, 1.9e-3, 4e-3))
    assert c.head_F > 0
    with pytest.raises(ValueError, match="no measured compute"):
        device_of(_measured(moe={"dispatch": 1e-3}, dense={}), memory_bytes=1e9)


# ------------------------------------------------------------------------- single measured ops


def _ops_file(**changes) -> MeasuredCosts:
    """A file of single ops only (as bench.kernels writes), at CFG, 64 tokens of 32, ep 4."""
    base = dict(
        config=CFG, seq_len=32, tokens=64, moe={}, device="cpu", source="test", ep=4,
        ops={"experts_gate_up.fwd": 0.125, "permute.fwd": 0.5, "router_topk.fwd": 0.25},
    )  # fmt: skip
    base.update(changes)
    return MeasuredCosts(**base)


_CLUSTER = Cluster(with_overrides(GPUS["h800"], nvlink_bytes_per_s=1e9, internode_bytes_per_s=5e7), 4, 2)
_PAR = Parallelism(pp=1, dp=4, ep=4, schedule="1f1b")


def test_ops_round_trip_and_files_without_ops_are_unchanged(tmp_path) -> None:
    m = _ops_file()
    path = tmp_path / "ops.json"
    save_costs(path, m)
    assert json.loads(path.read_text())["ops"]["permute.fwd"] == 0.5
    assert load_costs(path) == m
    save_costs(path, _measured())
    assert "ops" not in json.loads(path.read_text())  # version 1 as it was: older readers still take it
    assert load_costs(path).ops == {}


def test_a_measured_op_replaces_its_roofline_time_in_the_sum() -> None:
    m = _ops_file()
    work = Workload(seq_len=32, micro_batch=2, comm_sms=0)  # the file's shape and SMs: no scaling
    analytic = substage_costs(CFG, _CLUSTER, _PAR, work)
    used = substage_costs(CFG, _CLUSTER, _PAR, work, measured=m)
    subs = layer_ops(CFG, 64, 32, ep=4)

    def expected(sub: str, phase: str) -> float:  # the sum in the planner's order, measured ops swapped in
        return sum(m.ops.get(f"{op.name}.{phase}", analytic.detail[f"{op.name}.{phase}"]) for op in subs[sub])

    assert used.mlp_F == expected("mlp", "fwd") and used.mlp_F != analytic.mlp_F
    assert used.attn_F == expected("attn", "fwd") and used.attn_F != analytic.attn_F  # the router's top-k
    assert (used.mlp_dX, used.mlp_dW, used.attn_dX) == (analytic.mlp_dX, analytic.mlp_dW, analytic.attn_dX)
    assert used.detail["permute.fwd"] == 0.5 and used.detail["permute.dx"] == analytic.detail["permute.dx"]
    assert (used.head_F, used.dispatch) == (analytic.head_F, analytic.dispatch)
    # recompute adds the forward with its measured ops to dX
    rc = substage_costs(CFG, _CLUSTER, _PAR, dataclasses.replace(work, recompute=True), measured=m)
    assert rc.mlp_dX == analytic.mlp_dX + used.mlp_F
    # a whole measured sub-stage wins over its ops; the other sub-stages keep theirs
    both = substage_costs(CFG, _CLUSTER, _PAR, work, measured=_ops_file(moe={"mlp_F": 3.0}))
    assert both.mlp_F == 3.0 and both.attn_F == used.attn_F
    # a dense layer has no experts or router: its sums stay analytic
    dense = substage_costs(CFG, _CLUSTER, _PAR, work, moe=False, measured=m)
    assert dense == substage_costs(CFG, _CLUSTER, _PAR, work, moe=False)
    with pytest.raises(ValueError, match=r"moe\.plan --gpu"):  # no whole machine in single ops
        device_of(m, memory_bytes=1e9)


def test_measured_ops_scale_by_their_own_work_and_sms() -> None:
    m = _ops_file()
    base = {op.name: op for ops in layer_ops(CFG, 64, 32, ep=4).values() for op in ops}
    target = {op.name: op for ops in layer_ops(CFG, 192, 32, ep=4).values() for op in ops}
    work = Workload(seq_len=32, micro_batch=6, comm_sms=0)  # three times the tokens
    c = substage_costs(CFG, _CLUSTER, _PAR, work, measured=m)
    gemm = target["experts_gate_up"].fwd_flops / base["experts_gate_up"].fwd_flops  # FLOP ratio
    assert gemm == pytest.approx(3.0)
    assert c.detail["experts_gate_up.fwd"] == pytest.approx(0.125 * gemm)
    moved = target["permute"].fwd_bytes / base["permute"].fwd_bytes  # no FLOPs: the byte ratio
    assert c.detail["permute.fwd"] == pytest.approx(0.5 * moved)
    # the plan holds 20 of the h800's SMs for communication, the measurement held none: experts slow down
    sms = _CLUSTER.gpu.sms
    held = substage_costs(CFG, _CLUSTER, _PAR, dataclasses.replace(work, comm_sms=20), measured=m)
    assert held.detail["experts_gate_up.fwd"] == pytest.approx(0.125 * gemm * sms / (sms - 20))
    assert held.detail["permute.fwd"] == pytest.approx(c.detail["permute.fwd"])


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ({"experts_gate.fwd": 1.0}, "unknown op 'experts_gate.fwd'"),
        ({"permute.bwd": 1.0}, "unknown op"),
        ({"permute": 1.0}, "unknown op"),
        ({"shared_down.fwd": 1.0}, "unknown op"),  # the measured model has no shared expert
        ({"permute.dw": 1.0}, "no work in its dw phase"),
        ({"permute.fwd": -1.0}, "seconds >= 0"),
        ({"permute.fwd": "1"}, "seconds >= 0"),
    ],
)
def test_ops_validation_names_the_problem(tmp_path, ops, message) -> None:
    data = _ops_file(config=dataclasses.replace(CFG, num_shared_experts=0)).to_json()
    data["ops"] = ops
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_costs(path)
