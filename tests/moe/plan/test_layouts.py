"""The planner under pipeline layouts (moe.pipeline_layout): per-rank parameters equal to the stages
build_stages builds under the same layout, ``auto`` as the cost balance (checked against every split), mistakes
in one line, the pre-flight estimate following the trainer's layout."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from types import SimpleNamespace

import pytest

from moe.models.config import PRESETS
from moe.parallel import ParallelConfig, ParallelLayout, build_stages
from moe.pipeline_layout import Costs, balance, expand, fold, shift_to_last
from moe.plan.cli import main
from moe.plan.costs import Parallelism, Workload
from moe.plan.footprint import footprint
from moe.plan.layouts import memory_descent, shifts
from moe.plan.params import auto_layout, rank_params, rank_stages, stage_plans
from moe.plan.search import Candidate
from moe.train import config_from_args
from moe.train.preflight import memory_estimate

V3 = PRESETS["deepseek-v3-tiny"].replace(mtp_layers=1)  # 4 layers (1 dense), one MTP module
SMALL = ["--preset", "tiny", "--gpus", "8", "--gpus-per-node", "4", "--gpu", "h100", "--seq-len", "64"]
SMALL += ["--global-batch-size", "64", "--micro-batch-size", "2", "--top", "2"]


def _built(schedule: str, pp: int, pp_rank: int, layout: str) -> list[tuple[str, int]]:
    """The parameters build_stages gives one pipeline rank at ep = 1 (no process group is touched)."""
    config = ParallelConfig(pp=pp, dp=1, ep=1, schedule=schedule, pipeline_layout=layout)
    place = ParallelLayout(
        config=config, pp_rank=pp_rank, edp_rank=0, ep_rank=0, pp_group=None, dp_group=None, edp_group=None,
        ep_group=None, mirror_group=None, mesh=None,
    )  # fmt: skip
    stages = build_stages(V3, place)
    seen = {id(p): (n, p.numel()) for s in stages for n, p in s.named_parameters()}  # a tied embedding once
    return sorted(seen.values())


@pytest.mark.parametrize(
    ("schedule", "pp", "layout"),
    [
        ("dualpipev", 2, "Ett|t|t|mL"),
        ("dualpipev", 2, "Et|ttt|m|L"),
        ("dualpipe", 2, "Et|tttmL"),
        ("1f1b", 2, "Et|tttmL"),
    ],
)
def test_parameter_lists_follow_the_layout(schedule: str, pp: int, layout: str) -> None:
    """Name by name, every rank, as build_stages builds it; and the layout moves something off ``auto``'s split."""
    moved = False
    for r in range(pp):
        planned = rank_params(V3, pp, 1, schedule, r, pipeline_layout=layout)
        assert sorted((p.name, p.numel) for p in planned) == _built(schedule, pp, r, layout), (schedule, r)
        moved |= rank_stages(V3, pp, schedule, r, pipeline_layout=layout) != rank_stages(V3, pp, schedule, r)
    assert moved


@pytest.mark.parametrize(("schedule", "pp", "spelled"), [("dualpipev", 2, "Et|t|tt|mL"), ("1f1b", 2, "Ettt|tmL")])
def test_auto_is_the_cost_balance(schedule: str, pp: int, spelled: str) -> None:
    """``auto``'s stages are the layout balance spells for the model's costs (here the head and the MTP module
    weigh more than a layer, so the last stage holds fewer layers), in the trainer's plans, the planner's and
    the footprint alike."""
    assert auto_layout(V3, pp, schedule) == spelled
    trainer = ParallelConfig(pp=pp, schedule=schedule)
    assert trainer.stage_plans(V3) == ParallelConfig(pp=pp, schedule=schedule, pipeline_layout=spelled).stage_plans(V3)
    for r in range(pp):
        assert rank_stages(V3, pp, schedule, r) == rank_stages(V3, pp, schedule, r, pipeline_layout=spelled)
    work = Workload(seq_len=16, micro_batch=1)
    par = Parallelism(pp=pp, dp=2, ep=2, schedule=schedule)
    laid = Parallelism(pp=pp, dp=2, ep=2, schedule=schedule, pipeline_layout=spelled)
    assert footprint(V3, par, work, num_chunks=8) == footprint(V3, laid, work, num_chunks=8)


def _every_split(units: list[float], stages: int) -> list[tuple[float, float, tuple[int, ...]]]:
    """(costliest stage, sum of squares, stage sizes) of every way to cut ``units`` into ``stages`` runs."""
    out = []
    for cuts in itertools.combinations(range(1, len(units)), stages - 1):
        bounds = (0, *cuts, len(units))
        costs = [sum(units[a:b]) for a, b in itertools.pairwise(bounds)]
        out.append((max(costs), sum(c * c for c in costs), tuple(b - a for a, b in itertools.pairwise(bounds))))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_balance_finds_the_best_split(seed: int) -> None:
    """Against every split of random costs: the costliest stage is the least possible, and among those splits the
    sum of squares is the least; the embedding rides with the first layer, the head with the MTP module (or
    with the last layer when there is none)."""
    rng = random.Random(seed)
    layers = tuple(rng.choice([1.0, 1.0, 2.0, 3.5]) for _ in range(rng.randint(3, 8)))
    mtp = rng.choice([0, 1])
    costs = Costs(embed=0.0, layers=layers, mtp=2.5 * mtp, head=rng.choice([0.5, 1.5, 4.0]))
    units = [*layers, costs.mtp + costs.head] if mtp else [*layers[:-1], layers[-1] + costs.head]
    for stages in range(1, len(units) + 1):
        text = balance(costs, stages, mtp)
        sizes = [s.count("t") + ("m" in s) for s in expand(text).split("|")]  # units per stage
        got = [sum(units[a:b]) for a, b in itertools.pairwise(itertools.accumulate([0, *sizes]))]
        splits = _every_split(units, stages)
        least = min(s[0] for s in splits)
        assert max(got) == pytest.approx(least), (text, splits)
        assert sum(c * c for c in got) == pytest.approx(min(s[1] for s in splits if s[0] <= least + 1e-9)), text
        assert text.startswith("Et") and expand(text).endswith("mL" if mtp else "tL")
    with pytest.raises(ValueError, match="cannot fill"):
        balance(costs, len(units) + 1, mtp)


def test_shift_to_last_lightens_the_first_stage() -> None:
    assert shift_to_last("Ettttt|(tttt|)*14mL", 2) == "Ettt|(tttt|)*14ttmL"
    assert shift_to_last("Ett|t|tL", 1) == "Et|t|ttL"
    assert shift_to_last("Et|t|tL", 1) is None  # the first stage would keep no layer
    assert shift_to_last("EttL", 1) is None  # one stage


def test_memory_follows_the_layout() -> None:
    """All four layers on one stage of two: that rank holds more, the other less."""
    work, kw = Workload(seq_len=16, micro_batch=1), dict(num_chunks=4)
    even = [footprint(V3, Parallelism(pp=2, dp=1, ep=1, schedule="1f1b"), work, pp_rank=r, **kw) for r in (0, 1)]
    par = Parallelism(pp=2, dp=1, ep=1, schedule="1f1b", pipeline_layout="Etttt|mL")
    laid = [footprint(V3, par, work, pp_rank=r, **kw) for r in (0, 1)]
    assert laid[0].params > even[0].params and laid[1].params < even[1].params
    assert laid[0].activations > even[0].activations and laid[1].activations < even[1].activations


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("Et|t|x|L", "cannot read 'x' at position 5"),
        ("Et|t|t|t|t|L", "no schedule of 8 GPUs with a global batch of 64 has its 6 stages"),
        ("Ettttt|tL", "6 layers (t), the model has 4"),
    ],
)
def test_a_bad_layout_is_one_line(layout: str, message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, "--pipeline-layout", layout])
    text = str(exc.value)
    assert text.startswith("error: ") and "\n" not in text and message in text and layout in text, text


def test_a_layout_keeps_the_candidates_with_its_stage_count(capsys: pytest.CaptureFixture[str]) -> None:
    main([*SMALL, "--top", "200", "--pipeline-layout", "Ettt|tL", "--json", "-"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["pipeline_layout"] == "Ettt|tL" and doc["num_candidates"] == len(doc["top"])
    shapes = {(row["schedule"], row["pp"]) for row in doc["top"]}
    assert {("1f1b", 2), ("dualpipe", 2), ("dualpipev", 1)} <= shapes  # every 2-stage schedule, and only those
    assert all(ParallelConfig(pp=pp, schedule=s).num_stages == 2 for s, pp in shapes)
    assert all(row["pipeline_layout"] == "Ettt|tL" for row in doc["top"])


def test_preflight_estimate_follows_the_trainers_layout() -> None:
    argv = ["--preset", "tiny", "--pp", "2", "--schedule", "1f1b", "--seq-len", "32"]
    even, _ = config_from_args(argv, world=2)
    laid, _ = config_from_args([*argv, "--pipeline-layout", "Etttt|L"], world=2)
    assert laid.parallel.pipeline_layout == "Etttt|L"
    assert memory_estimate(laid) > memory_estimate(even)  # rank 0 holds all four layers and the embedding


class _Counted:
    """A stand-in for the planner's cost model: a rank holds one GiB per layer of its stages and fits in
    ``limit`` GiB."""

    def __init__(self, cfg, c, limit: float) -> None:
        self.cfg, self.c, self.limit = cfg, c, limit

    def memory(self, pp_rank: int | None = None):
        per_rank = [
            sum(len(sp.layers) for _, sp in rank_stages(self.cfg, self.c.pp, self.c.schedule, r, pipeline_layout=lay))
            for r in range(self.c.pp)
            for lay in [self.c.pipeline_layout]
        ]
        r = max(range(len(per_rank)), key=per_rank.__getitem__) if pp_rank is None else pp_rank
        return SimpleNamespace(total=per_rank[r] * 2**30, pp_rank=r)

    def fits(self) -> bool:
        return self.memory().total <= self.limit * 2**30


@pytest.mark.parametrize(("schedule", "limit"), [("1f1b", 3), ("dualpipe", 4)])
def test_memory_descent_moves_layers_off_the_fullest_rank(schedule: str, limit: float) -> None:
    """From a lopsided layout, layers move from the fullest rank's stages to the emptiest's until the fullest
    fits; the layout stays valid (the same layers, E first, L last). Where nothing fits, it stops where no move
    helps."""
    cfg = PRESETS["tiny"].replace(num_layers=8)
    c = Candidate(schedule, 4, 1, 1, 8, 0, "none", "Ettttt|t|t|tL")  # 1F1B: 5, 1, 1, 1; DualPipe: 6, 2, 2, 6
    got = memory_descent(cfg, c, lambda c: _Counted(cfg, c, limit))
    assert got != c and _Counted(cfg, got, limit).fits(), got.pipeline_layout
    assert stage_plans(cfg, 4, schedule, None, got.pipeline_layout)  # a layout the trainer takes
    stuck = memory_descent(cfg, c, lambda c: _Counted(cfg, c, 0))  # nothing fits: it stops at the best it found
    assert _Counted(cfg, stuck, 0).memory().total <= _Counted(cfg, got, limit).memory().total


def test_shifts_lighten_autos_first_stage() -> None:
    cfg = PRESETS["deepseek-v3"]
    c = Candidate("dualpipe", 16, 128, 64, 120, 20, "selective")
    got = [v.pipeline_layout for v in shifts(cfg, c)]
    assert auto_layout(cfg, 16, "dualpipe") == "Ettttt|(tttt|)*14mL"
    assert got == ["Etttt|(tttt|)*14tmL", "Ettt|(tttt|)*14ttmL", "Ett|(tttt|)*14tttmL"]
    assert got[1] == fold(expand("Et*3|(t*4|)*14t*2mL").split("|"))  # Megatron-Core's example at 16 stages
    assert shifts(cfg, dataclasses.replace(c, pipeline_layout=got[0])) == []  # a layout of its own is kept
