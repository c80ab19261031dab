"""bench.gpu_overlap_trace: the answer it prints is computed right from a profiler trace, and on CPU the
emulated link gives the overlapped pair transfers to hide (the one-rank all-to-all gives none)."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch

from bench.gpu_overlap_trace import HostDeviceRecorder, comm_under_compute, main
from moe.dispatch.emulated import LINK_KERNEL


def _kernel(name: str, ts: float, dur: float, stream: int) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_comm_under_compute_counts_only_the_overlapped_part():
    trace = {
        "traceEvents": [
            _kernel("gemm_a", 0, 10, 7),
            _kernel("gemm_b", 5, 10, 7),  # compute busy [0, 15)
            _kernel("ncclDevKernel_SendRecv", 12, 8, 20),  # 3 us under compute, 5 us exposed
            _kernel("ncclDevKernel_SendRecv", 30, 4, 20),  # fully exposed
            {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # host ops are not kernels
        ]
    }
    got = comm_under_compute(trace)
    assert got["comm_us"] == 12 and got["hidden_us"] == 3 and got["compute_us"] == 15
    assert got["comm_streams"] == [20] and got["compute_streams"] == [7] and got["comm_kernels"] == 2


def _copy(ts: float, dur: float, stream: int) -> dict:
    return {
        "cat": "gpu_memcpy",
        "name": "Memcpy DtoD (Device -> Device)",
        "ts": ts,
        "dur": dur,
        "args": {"stream": stream},
    }


def test_the_emulated_links_stream_is_communication():
    trace = {
        "traceEvents": [
            _kernel("gemm_a", 0, 10, 7),
            _copy(10, 2, 7),  # a copy on the compute stream is neither communication nor compute
            _copy(4, 2, 30),  # the link's rows: a copy on its stream, under compute
            _kernel(f"void at::cuda::(anonymous namespace)::{LINK_KERNEL}(long)", 6, 8, 30),  # 4 us exposed
        ]
    }
    got = comm_under_compute(trace)
    assert got["comm_us"] == 10 and got["hidden_us"] == 6 and got["compute_us"] == 10
    assert got["comm_streams"] == [30] and got["compute_streams"] == [7] and got["comm_kernels"] == 2


def test_no_comm_kernels_is_reported_as_none():
    got = comm_under_compute({"traceEvents": [_kernel("gemm", 0, 1, 7)]})
    assert got["comm_kernels"] == 0 and got["hidden_us"] == 0


def test_host_recorder_pairs_begin_and_end_on_cpu():
    rec = HostDeviceRecorder(torch.device("cpu"))
    rec.record("attn", "fwd", 0, "begin")
    rec.record("dispatch", "fwd", 0, "start")  # communication edges are not compute spans
    rec.record("attn", "fwd", 0, "end")
    rec.record("dispatch", "fwd", 0, "wait")
    (span,) = rec.spans()
    assert span[0] == "attn" and span[1] >= 0 and span[2] != span[2]  # no GPU time off CUDA: NaN


def test_host_recorder_feeds_the_one_hidden_metric():
    rec = HostDeviceRecorder(torch.device("cpu"))
    rec.record("combine", "bwd", 1, "start")
    rec.record("attn", "fwd", 0, "begin")
    sum(range(10_000))  # some host time under the transfer
    rec.record("attn", "fwd", 0, "end")
    rec.record("combine", "bwd", 1, "wait")
    rec.record("dispatch", "fwd", 0, "start")
    rec.record("mlp.dw", "bwd", 1, "begin")
    rec.record("mlp.dw", "bwd", 1, "empty")  # a dW with nothing to run hides nothing
    rec.record("dispatch", "fwd", 0, "wait")
    h = rec.hidden()
    assert (h.count, h.covered) == (2, 1) and 0 < h.fraction < 1
    assert h.kinds["combine.bwd"].covered == 1 and h.kinds["dispatch.fwd"].hidden_s == 0
    assert rec.hidden(slice(4, None)).kinds.keys() == {"dispatch.fwd"}  # a window of the events


SMOKE = ["--device", "cpu", "--preset", "tiny", "--reps", "1", "--micro-batch", "1", "--seq-len", "64"]


@pytest.mark.parametrize("gbps", [None, 0.05])
def test_cpu_smoke(tmp_path, gbps):
    """The CPU smoke run, with the one-rank all-to-all (no transfer: no answer) and with the emulated link (a
    hidden fraction of the recorded transfers, and the link time charged for each kind)."""
    link = [] if gbps is None else ["--emulated-gbps", str(gbps)]
    assert main([*SMOKE, *link, "--out", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[1].endswith(".json.gz")  # the summary and the trace
    summary = json.loads((tmp_path / files[0]).read_text())
    with gzip.open(tmp_path / files[1], "rt") as f:
        assert json.load(f)["traceEvents"]
    hidden = summary["hidden"]
    if gbps is None:
        assert hidden["count"] == 0 and math.isnan(hidden["fraction"]) and summary["link"] is None
        return
    kinds = {"dispatch.fwd", "combine.fwd", "dispatch.bwd", "combine.bwd"}
    assert hidden["count"] > 0 and 0 <= hidden["fraction"] <= 1 and kinds <= hidden["kinds"].keys()
    assert all(0 <= hidden["kinds"][k]["fraction"] <= 1 for k in kinds)
    assert summary["link"]["ms_per_pair"].keys() == kinds and all(
        v > 0 for v in summary["link"]["ms_per_pair"].values()
    )
    assert any("F.dispatch" in line and "=" in line for line in summary["timeline"])


def test_a_bad_bandwidth_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: the emulated link needs a bandwidth > 0 GB/s, got 0.0$"):
        main([*SMOKE, "--emulated-gbps", "0", "--out", str(tmp_path)])
