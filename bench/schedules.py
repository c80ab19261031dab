"""Compare every registered schedule with the simulator: bubble, activations, parameter copies.

    python -m bench.schedules                      # PP 4, 8, 16; table + JSON + timelines at PP 8
    python -m bench.schedules --pp 4 8 --F 1 --B 2 --W 1 --overlap 0.7 --out bench/results

Every schedule of :data:`dualpipe.schedule.SCHEDULES` runs the same model on ``PP`` pipeline ranks with the
same number of micro-batches. Costs are those of one full 1F1B stage (``F`` forward, ``B`` full backward,
``W`` its weight-gradient part); a schedule's chunk costs are scaled by the share of a full stage one of its
modules holds (ranks / stages): DualPipe holds two full stages per rank (the model twice), DualPipeV
``2 x PP`` half stages, interleaved 1F1B ``v x PP`` stages of ``1/v``. An overlapped forward/backward pair
costs ``overlap x (F + B)`` (``--overlap 1``: no compute gained by pairing; the published formulas call the
pair's cost ``F&B``). ``--comm`` adds the all-to-all a lone chunk waits for and a pair hides. The figures
are simulated, not measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dualpipe.schedule import SCHEDULES, Schedule, build_schedule
from dualpipe.simulate import Costs, SimResult, render_png, simulate, stage_share

__all__ = ["Row", "compare"]


@dataclass(frozen=True, slots=True)
class Row:
    schedule: str
    pp: int
    chunks: int
    makespan: float
    bubble: float  # the largest idle time of any rank, in the unit of the costs
    bubble_fraction: float
    peak_activations: float  # in 1F1B stages x micro-batches, worst rank
    parameter_copies: int


def _costs(schedule: Schedule, f: float, b: float, w: float, overlap: float, comm: float) -> Costs:
    """Per-chunk costs; ``comm`` is the exposed all-to-all time of a lone F or B as a fraction of it.

    A lone forward or backward waits for its own dispatch and combine; an overlapped pair hides them
    behind the other micro-batch's compute (DeepSeek-V3's premise), so only ``overlap x (F + B)`` remains.
    The weight-gradient part (``W``) has no all-to-all.
    """
    scale = stage_share(schedule)
    f_, b_, w_ = f * scale, b * scale, w * scale
    return Costs(F=f_ * (1 + comm), B=w_ + (b_ - w_) * (1 + comm), W=w_, FB=overlap * (f_ + b_))


def compare(
    pp: int, chunks: int, f: float, b: float, w: float, overlap: float, comm: float = 0.0
) -> list[tuple[Row, SimResult]]:
    out = []
    for name in SCHEDULES:
        schedule = build_schedule(name, pp, chunks)
        result = simulate(schedule, _costs(schedule, f, b, w, overlap, comm))
        row = Row(
            schedule=name,
            pp=pp,
            chunks=chunks,
            makespan=result.makespan,
            bubble=max(result.idle),
            bubble_fraction=result.bubble_fraction,
            peak_activations=max(result.peak_activation_stages),
            parameter_copies=result.parameter_copies,
        )
        out.append((row, result))
    return out


def _table(rows: list[Row]) -> str:
    lines = [
        "| PP | schedule | chunks | makespan | bubble (worst rank) | bubble fraction | peak activations | params |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.pp} | {r.schedule} | {r.chunks} | {r.makespan:g} | {r.bubble:g} | {r.bubble_fraction:.3f} "
            f"| {r.peak_activations:g} | {r.parameter_copies}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--chunks-per-rank", type=int, default=4, help="micro-batches = this x PP")
    p.add_argument("--F", type=float, default=1.0)
    p.add_argument("--B", type=float, default=2.0)
    p.add_argument("--W", type=float, default=1.0)
    p.add_argument("--overlap", type=float, default=1.0, help="cost of an overlapped pair / (F + B)")
    p.add_argument(
        "--comm",
        type=float,
        default=0.0,
        help="exposed all-to-all time of a lone F or input-grad B, as a fraction of its compute",
    )
    p.add_argument("--out", default="bench/results", help="directory for the JSON and timeline PNGs ('' to skip)")
    p.add_argument("--picture-pp", type=int, default=8, help="draw timelines at this PP (if it is in --pp)")
    args = p.parse_args(argv)

    rows: list[Row] = []
    pictures: dict[str, SimResult] = {}
    for pp in args.pp:
        try:
            for spec in SCHEDULES.values():
                spec.validate(pp, args.chunks_per_rank * pp)
        except ValueError as exc:
            raise SystemExit(f"error: --pp {pp} --chunks-per-rank {args.chunks_per_rank}: {exc}") from None
        for row, result in compare(pp, args.chunks_per_rank * pp, args.F, args.B, args.W, args.overlap, args.comm):
            rows.append(row)
            if pp == args.picture_pp:
                pictures[row.schedule] = result
    print(
        f"costs per full stage: F={args.F} B={args.B} W={args.W}; overlapped pair = {args.overlap} x (F+B); "
        f"exposed all-to-all of a lone chunk = {args.comm} x its compute"
    )
    print(_table(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.date.today().isoformat()
        path = out / f"schedules-simulated-{stamp}.json"
        path.write_text(json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows]}, indent=1))
        for name, result in pictures.items():
            render_png(result, str(out / f"timeline-{name}-pp{args.picture_pp}.png"))
        print(f"wrote {path} and {len(pictures)} timelines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
