"""HostSyncDetector flags the ops of its table (and only under their conditions), wherever they run."""

from __future__ import annotations

import torch

from dualpipe.host_sync import HOST_SYNC_OPS, HostSyncDetector


def test_flags_the_syncing_ops_and_not_their_sync_free_forms():
    x = torch.arange(6.0)
    idx = torch.tensor([0, 2])
    with HostSyncDetector() as syncs:
        x.tolist()
        int(x.sum())
        x[x > 2]
        x.nonzero()
        torch.bincount(idx)
        torch.masked_select(x, x > 1)
        torch.unique(idx)
        torch.repeat_interleave(idx, idx)
        y = x.clone()
        y[x > 3] = torch.tensor([7.0, 8.0])  # a scatter of several values: nonzero() first
    assert [f.op for f in syncs.flagged] == [
        "Tensor.tolist",
        "aten._local_scalar_dense",
        "aten.index.Tensor",
        "aten.nonzero",
        "aten.bincount",
        "aten.masked_select",
        "aten._unique2",
        "aten.repeat_interleave.Tensor",
        "aten.index_put_",
    ]
    assert all(f.why == HOST_SYNC_OPS[f.op] and __file__ in f.where for f in syncs.flagged), syncs.summary()
    with HostSyncDetector() as clean:
        x[idx]  # an integer index has a known length
        torch.zeros(3).index_add_(0, idx, torch.ones(2))
        torch.repeat_interleave(idx, idx, output_size=2)
        torch.sort(x, stable=True)
        x.to("cpu")
        y[x > 3] = 0.0  # one mask, a host scalar: ATen runs masked_fill_, no nonzero()
        x.masked_fill(x > 3, 0.0)
    assert clean.flagged == [], clean.summary()


def test_flags_inside_autograd_backward():
    x = torch.randn(4, requires_grad=True)

    class ReadsScalar(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * float(grad.sum())

    with HostSyncDetector() as syncs:
        ReadsScalar.apply(x).sum().backward()
    assert syncs.counts() == {"aten._local_scalar_dense": 1}
