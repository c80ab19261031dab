"""A user's own MoE transformer, in plain torch, overlapped by declaring its blocks as pieces.

    torchrun --standalone --nproc-per-node 4 examples/overlap_moe.py --pp 2 --ep 2 --steps 20
    torchrun --standalone --nproc-per-node 2 examples/overlap_moe.py --timeline   # one pair, recorded

Nothing here comes from ``moe/``: LayerNorm, causal attention, a softmax top-2 router, ``E`` GELU experts
sharded over the expert-parallel ranks, a shared GELU expert every token goes through, and an all-to-all of
its own (one row per (token, slot), sorted by expert). :class:`Model` is the plain single-process model. The
overlap-specific code is the section marked below: :meth:`MoEBlock.pieces` names the block's five pieces
(three compute: attention, shared expert, routed experts) and the two communication pieces say how to start
each all-to-all and its gradient, built on
:mod:`dualpipe.collectives`. :class:`Stage` subclasses :class:`dualpipe.overlap.OverlapStage`, which turns
those pieces into the forward, the backward and ``overlapped_forward_backward``. docs/overlap.md walks
through it.

Runs on CPU ranks over gloo (CUDA + NCCL when every rank has a GPU). Rank (pp, ep) = (r // ep, r % ep);
every ep rank of a pipeline rank is a data-parallel replica with its own micro-batches. ``--timeline`` records
one overlapped pair instead (every rank one expert-parallel group) and prints rank 0's timeline as text.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dualpipe import DualPipeV
from dualpipe.collectives import AllToAll, Pending, exchange_counts
from dualpipe.events import EventRecorder, hidden_fraction, timeline_text
from dualpipe.overlap import OverlapStage
from dualpipe.pieces import Comm, Compute, Context, Pieces


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 4
    experts: int = 4
    top_k: int = 2
    ffn: int = 64


class MoEBlock(nn.Module):
    """``a = x + attn(ln1(x))``; ``out = a + sum_k w_k expert_k(z) + shared(z)``, ``z = ln2(a)``, over the
    top-2 softmax experts.

    ``group`` is the expert-parallel group; this rank holds experts ``[rank * E_local, (rank + 1) * E_local)``.
    """

    def __init__(self, cfg: Config, layer: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.cfg, self.layer, self.group = cfg, layer, group
        self.ep = dist.get_world_size(group) if group is not None else 1
        self.local = cfg.experts // self.ep
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv, self.proj = nn.Linear(cfg.dim, 3 * cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.gate = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(self.local, cfg.dim, cfg.ffn) * cfg.dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(self.local, cfg.ffn, cfg.dim) * cfg.ffn**-0.5)
        self.shared = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn, bias=False), nn.GELU(), nn.Linear(cfg.ffn, cfg.dim))

    def attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual ``a`` and the experts' input ``z = ln2(a)``."""
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.cfg.heads, d // self.cfg.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        a = x + self.proj(o.transpose(1, 2).reshape(b, s, d))
        return a, self.ln2(a)

    def route(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts per token ``[T, K]`` and their renormalised softmax weights ``[T, K]``."""
        probs = self.gate(z.flatten(0, 1)).softmax(-1)
        w, idx = probs.topk(self.cfg.top_k, dim=-1)
        return idx, w / w.sum(-1, keepdim=True)

    def experts(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Row ``i`` through local expert ``expert[i]`` (rows sorted by expert)."""
        counts = torch.bincount(expert, minlength=self.local).tolist()
        outs = [F.gelu(xe @ self.w1[e]) @ self.w2[e] for e, xe in enumerate(x.split(counts))]
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The plain block, every expert local (the single-process model)."""
        assert self.ep == 1, "the plain forward holds every expert; use Stage for expert parallelism"
        a, z = self.attention(x)
        idx, w = self.route(z)
        order = idx.flatten().argsort(stable=True)
        rows = z.flatten(0, 1)[order // self.cfg.top_k]
        y = self.experts(rows, idx.flatten()[order]) * w.flatten()[order, None]
        return a + to_tokens(y, order, idx.shape).view_as(a) + self.shared(z)

    # ---- overlap: the block as pieces (everything overlap-specific is in this section) ---------------------
    def pieces(self) -> Pieces:
        attn = Compute("attn", self._attn, "x", ("a", "z", "w"))
        dispatch = Comm("dispatch", self._dispatch, self._dispatch_grad, ("z", "w"), ("x_r", "w_r"), prepare=self._plan)
        shared = Compute("shared", lambda ctx, z: self.shared(z), "z", "s")  # beside the routed path
        mlp = Compute("mlp", self._mlp, ("x_r", "w_r"), "y_r")
        combine = Comm("combine", self._combine, self._combine_grad, "y_r", "y")
        return Pieces([attn, dispatch, shared, mlp, combine], input="x", output=("a", "y", "s"), layer=self.layer)

    def _attn(self, ctx: Context, x: torch.Tensor):
        a, z = self.attention(x)
        ctx.idx, w = self.route(z)  # the token ids of each slot's expert: what the pieces below route by
        ctx.shape = z.shape
        return a, z, w

    def _plan(self, ctx: Context, z: torch.Tensor, w: torch.Tensor) -> Pending:
        # Slots sorted by expert (so by rank); the row counts per (rank, local expert) go out first.
        ctx.order = ctx.idx.flatten().argsort(stable=True)
        ctx.send = torch.bincount(ctx.idx.flatten(), minlength=self.cfg.experts).view(self.ep, self.local)
        ctx.recv = exchange_counts(ctx.send, self.group)
        return ctx.recv

    def _dispatch(self, ctx: Context, z: torch.Tensor, w: torch.Tensor) -> Pending:
        recv = ctx.recv.wait()
        ctx.a2a = AllToAll(ctx.send.sum(1).tolist(), recv.sum(1).tolist(), self.group)
        ctx.expert = torch.arange(self.local).repeat(self.ep).repeat_interleave(recv.flatten())
        x_r = ctx.a2a.forward(z.flatten(0, 1)[ctx.order // self.cfg.top_k])
        w_r = ctx.a2a.forward(w.flatten()[ctx.order, None])
        return Pending(lambda: (x_r.wait(), w_r.wait()))

    def _dispatch_grad(self, ctx: Context, grad_x_r: torch.Tensor, grad_w_r: torch.Tensor) -> Pending:
        gx, gw = ctx.a2a.backward(grad_x_r), ctx.a2a.backward(grad_w_r)

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            grad_w = gw.wait().new_zeros(ctx.order.numel()).index_copy(0, ctx.order, gw.wait()[:, 0])
            return to_tokens(gx.wait(), ctx.order, ctx.idx.shape).view(ctx.shape), grad_w.view_as(ctx.idx)

        return Pending(finish)

    def _mlp(self, ctx: Context, x_r: torch.Tensor, w_r: torch.Tensor) -> torch.Tensor:
        # Rows arrive grouped by source rank, each source's rows by expert: group them by expert for the GEMMs.
        by_expert = ctx.expert.argsort(stable=True)
        y = self.experts(x_r[by_expert], ctx.expert[by_expert]) * w_r[by_expert]
        return torch.empty_like(y).index_copy(0, by_expert, y)

    def _combine(self, ctx: Context, y_r: torch.Tensor) -> Pending:
        y_s = ctx.a2a.backward(y_r)  # the combine is the dispatch's exchange run backwards
        return Pending(lambda: to_tokens(y_s.wait(), ctx.order, ctx.idx.shape).view(ctx.shape))

    def _combine_grad(self, ctx: Context, grad_y: torch.Tensor) -> Pending:
        return ctx.a2a.forward(grad_y.flatten(0, 1)[ctx.order // self.cfg.top_k])

    # ---- end of the overlap-specific section ---------------------------------------------------------------


def to_tokens(rows: torch.Tensor, order: torch.Tensor, idx_shape: torch.Size) -> torch.Tensor:
    """Sum the rows of slots ``order`` (slot ``s`` belongs to token ``s // K``) into ``[T, D]``."""
    tokens, k = idx_shape
    return rows.new_zeros(tokens, rows.shape[1]).index_add(0, order // k, rows)


class Stage(OverlapStage):
    """Consecutive blocks of the model, with the embedding (first stage) and the head (last stage)."""

    def __init__(self, cfg: Config, layers: list[int], first: bool, last: bool, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim) if first else None
        self.blocks = nn.ModuleList(MoEBlock(cfg, i, group) for i in layers)
        self.norm, self.head = (nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, cfg.vocab)) if last else (None, None)

    def pieces(self) -> list[Pieces]:
        blocks = [block.pieces() for block in self.blocks]
        if self.embed is not None:
            blocks.insert(
                0, Pieces([Compute("embed", lambda ctx, ids: self.embed(ids), "ids", "h")], "ids", "h", paired=False)
            )
        if self.head is not None:
            head = Compute("head", lambda ctx, h: self.head(self.norm(h)), "h", "logits")
            blocks.append(Pieces([head], "h", "logits", paired=False))
        return blocks


class Model(nn.Module):
    """The single-process model: every layer, every expert."""

    def __init__(self, cfg: Config, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(MoEBlock(cfg, i) for i in range(cfg.layers))
        self.norm, self.head = nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def stage_state(
        self, names: list[str], layers: list[int], ep: int, ep_rank: int, full: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """``full`` (default: this model's weights) under a stage's parameter ``names``, for a stage holding
        ``layers``, the experts sliced to ``ep_rank``'s (tests pass gradients to compare a stage's)."""
        full = self.state_dict() if full is None else full
        state = {}
        for name in names:
            kind, *rest = name.split(".")
            src = f"blocks.{layers[int(rest[0])]}.{'.'.join(rest[1:])}" if kind == "blocks" else name
            t = full[src]
            if name.endswith((".w1", ".w2")):
                local = t.shape[0] // ep
                t = t[ep_rank * local : (ep_rank + 1) * local]
            state[name] = t.clone()
        return state


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def dualpipev_layers(cfg: Config, pp: int, pp_rank: int) -> list[list[int]]:
    """DualPipeV's V: pipeline rank r holds stages r and 2*pp-1-r of 2*pp, one slice of layers each."""
    per = cfg.layers // (2 * pp)
    return [list(range(s * per, (s + 1) * per)) for s in (pp_rank, 2 * pp - 1 - pp_rank)]


def build(cfg: Config, pp: int, ep: int, seed: int = 0):
    """``(stages, pp_group, ep_group, pp_rank, ep_rank)`` for this rank of a (pp, ep) grid."""
    rank = dist.get_rank()
    pp_rank, ep_rank = divmod(rank, ep)
    pp_groups = [dist.new_group([p * ep + e for p in range(pp)]) for e in range(ep)]
    ep_groups = [dist.new_group([p * ep + e for e in range(ep)]) for p in range(pp)]
    pp_group, ep_group = pp_groups[ep_rank], ep_groups[pp_rank]
    model = Model(cfg, seed)
    stages = []
    for i, layers in enumerate(dualpipev_layers(cfg, pp, pp_rank)):
        first, last = i == 0 and pp_rank == 0, i == 1 and pp_rank == 0
        stage = Stage(cfg, layers, first, last, ep_group)
        stage.load_state_dict(model.stage_state(list(stage.state_dict()), layers, ep, ep_rank))
        stages.append(stage)
    return stages, pp_group, ep_group, pp_rank, ep_rank


def average_replicas(stages: list[Stage], ep_group: dist.ProcessGroup) -> None:
    """The ep ranks are data-parallel replicas: average the replicated gradients, scale the experts'."""
    ep = dist.get_world_size(ep_group)
    for p in (p for s in stages for p in s.parameters() if p.grad is not None):
        if p.dim() != 3:  # the experts' w1 / w2 are [E_local, ., .]; the rest is replicated
            dist.all_reduce(p.grad, group=ep_group)
        p.grad.div_(ep)


def pair_timeline(cfg: Config, seq: int = 64, pairs: int = 3) -> str:
    """One overlapped pair on this rank, recorded: a stage of every layer (the world is one expert-parallel
    group) runs micro-batch A's forward, then the hook runs B's forward beside A's backward (the first pairs
    warm up). Returns the first pair of blocks (forward block 0 beside the last backward block) as text, and
    the pair's hidden fraction per kind."""
    stage = Stage(cfg, list(range(cfg.layers)), True, True, dist.group.WORLD)
    stage.recorder = recorder = EventRecorder()
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(pairs):
        ids = torch.randint(cfg.vocab, (2, 4, seq), generator=gen)
        loss1 = loss_fn(stage(ids[0]), ids[0].roll(1, 1))
        recorder.clear()
        Stage.overlapped_forward_backward(stage, [ids[1]], loss_fn, [ids[1].roll(1, 1)], stage, loss1, None, None)
    at = {row[:4]: row[4] / 1e3 for row in recorder.timeline()}
    window = (at["attn", "fwd", 0, "begin"], at["attn", "fwd", 1, "begin"])
    hidden = hidden_fraction(recorder).kinds
    kinds = ", ".join(f"{k} {h.fraction:.2f}" for k, h in hidden.items())
    return f"{timeline_text(recorder, window=window)}\n\nhidden in this pair, by kind: {kinds}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per step and replica")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--timeline", action="store_true", help="record one overlapped pair and print it (no training)")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and "LOCAL_RANK" in os.environ
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    if args.timeline:
        text = pair_timeline(Config(dim=128, ffn=256))
        if dist.get_rank() == 0:
            print(text, flush=True)
        dist.destroy_process_group()
        return
    if dist.get_world_size() != args.pp * args.ep:
        raise SystemExit(f"launch pp * ep = {args.pp * args.ep} ranks, not {dist.get_world_size()}")
    cfg = Config()
    stages, pp_group, ep_group, pp_rank, ep_rank = build(cfg, args.pp, args.ep)
    pipe = DualPipeV(stages, batch_dim=0, process_group=pp_group)
    opt = torch.optim.AdamW([q for s in stages for q in s.parameters()], lr=args.lr)
    gen = torch.Generator().manual_seed(100 + ep_rank)
    for step in range(args.steps):
        ids = torch.randint(cfg.vocab, (2 * args.chunks, 16), generator=gen)
        labels = ids.roll(1, dims=1)  # learn to copy the previous token
        feeds = pp_rank == 0
        opt.zero_grad()
        loss, _ = pipe.step(
            *((ids,) if feeds else ()), num_chunks=args.chunks, criterion=loss_fn, labels=(labels,) if feeds else ()
        )
        average_replicas(stages, ep_group)
        opt.step()
        if feeds and ep_rank == 0:
            print(f"step {step:3d}  loss {loss.mean().item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
