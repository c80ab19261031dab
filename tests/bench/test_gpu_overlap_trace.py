"""bench.gpu_overlap_trace: the answer it prints is computed right from a profiler trace."""

from __future__ import annotations

import torch

from bench.gpu_overlap_trace import HostDeviceRecorder, comm_under_compute


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
