"""A small DualPipeV training run: residual MLP stages learning a fixed random teacher network.

    torchrun --standalone --nproc-per-node 4 examples/toy_dualpipev.py --steps 60

Runs on CPU ranks over gloo (CUDA + NCCL when every rank has a GPU). Rank 0 feeds the micro-batches and
computes the loss (DualPipeV's V turns back to rank 0) and prints progress.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dualpipe import DualPipeV
from dualpipe.utils import run_backward


class MLPStage(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, grads1):
        # Plain stages have no communication of their own to hide: forward, then the other backward.
        outputs0 = [module0(*inputs0)]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            run_backward(outputs1, grads1)
        return outputs0, loss0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--num-chunks", type=int, default=0, help="micro-batches per step (default 2 * ranks)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    cuda = torch.cuda.is_available() and "LOCAL_RANK" in os.environ
    if cuda:  # before any CUDA call: else every rank opens a context (and NCCL its communicator) on GPU 0
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    chunks = args.num_chunks or 2 * world

    torch.manual_seed(args.seed)  # same seed everywhere: every rank builds the same full model
    stages = [MLPStage(args.hidden) for _ in range(2 * world)]
    teacher = nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.Tanh(), nn.Linear(args.hidden, args.hidden))
    local = [stages[rank].to(device), stages[2 * world - 1 - rank].to(device)]
    pipe = DualPipeV(local)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    data_gen = torch.Generator().manual_seed(args.seed + 1)

    start = time.monotonic()
    for step in range(1, args.steps + 1):
        x = torch.randn(chunks * args.micro_batch_size, args.hidden, generator=data_gen)
        with torch.no_grad():
            y = teacher(x)
        inputs = (x.to(device),) if rank == 0 else ()
        labels = (y.to(device),) if rank == 0 else ()
        opt.zero_grad(set_to_none=True)
        loss, _ = pipe.step(*inputs, num_chunks=chunks, criterion=F.mse_loss, labels=labels, loss_reduction="mean")
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == 1):
            elapsed = time.monotonic() - start
            samples = step * chunks * args.micro_batch_size
            eta = elapsed / step * (args.steps - step)
            print(
                f"step {step:4d}/{args.steps}  loss {loss.mean().item():.4f}  "
                f"{samples / elapsed:8.1f} samples/s  eta {eta:5.1f}s",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
