"""The job configuration: flags and TOML generated from the fields, validation in one place, LR schedules."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from moe.pipeline_layout import expand
from moe.plan.params import auto_layout
from moe.train import LR_SCHEDULES, TrainConfig, UsageError, build_parser, config_from_args, dump_toml, lr_at
from moe.train.cli import FLAG_ALIASES, load_config, schema
from moe.train.config import SECTIONS, LRScheduleConfig
from moe.train.optimizer import OPTIMIZERS

ROOT = Path(__file__).resolve().parents[3]

# Every flag examples/train.py took before the configuration became a library, with a value and the field it
# must still set (their names keep working).
LEGACY_FLAGS = {
    "--preset": ("small", "model.name", "small"),
    "--layers": ("4", "model.num_layers", 4),
    "--pp": ("2", "parallel.pp", 2),
    "--dp": ("2", "parallel.dp", 2),
    "--ep": ("2", "parallel.ep", 2),
    "--rank-order": ("edp,ep,pp", "parallel.rank_order", ("edp", "ep", "pp")),
    "--schedule": ("1f1b", "parallel.schedule", "1f1b"),
    "--stages-per-rank": ("3", "parallel.modules_per_rank", 3),
    "--num-chunks": ("6", "parallel.num_chunks", 6),
    "--dispatcher": ("deepep", "parallel.dispatcher", "deepep"),
    "--comm-sms": ("24", "parallel.comm_sms", 24),
    "--bias-update-rate": ("0.02", "model.bias_update_rate", 0.02),
    "--steps": ("7", "training.steps", 7),
    "--seq-len": ("128", "training.seq_len", 128),
    "--micro-batch-size": ("3", "training.micro_batch_size", 3),
    "--lr": ("1e-4", "optimizer.lr", 1e-4),
    "--warmup": ("5", "lr_schedule.warmup", 5),
    "--weight-decay": ("0.1", "optimizer.weight_decay", 0.1),
    "--seed": ("3", "training.seed", 3),
    "--dtype": ("bfloat16", "training.dtype", "bfloat16"),
    "--zero": ("1", "optimizer.zero", 1),
    "--clip-grad": ("1.0", "optimizer.clip_grad", 1.0),
    "--data": ("some/prefix", "data.path", ["some/prefix"]),
    "--val-every": ("9", "training.val_every", 9),
    "--val-batches": ("4", "training.val_batches", 4),
    "--ckpt-dir": ("/tmp/x", "checkpoint.dir", "/tmp/x"),
    "--ckpt-every": ("2", "checkpoint.every", 2),
    "--keep-last": ("5", "checkpoint.keep_last", 5),
    "--metrics-file": ("m.jsonl", "metrics.file", "m.jsonl"),
    "--trace-dir": ("t", "metrics.trace_dir", "t"),
    "--log-every": ("2", "metrics.log_every", 2),
    "--timeout": ("30", "fault.timeout", 30.0),
    "--kill-rank-at-step": ("3", "fault.kill_rank_at_step", 3),
    "--stop-rank-at-step": ("3", "fault.stop_rank_at_step", 3),
    "--nan-at-step": ("3", "fault.nan_at_step", 3),
}
LEGACY_SWITCHES = {
    "--overlap": "parallel.overlap",
    "--recompute": "parallel.recompute",
    "--sync-free": "parallel.sync_free",
    "--master-weights": "training.master_weights",
    "--resume": "checkpoint.resume",
    "--resume-strict": "checkpoint.resume_strict",
    "--skip-nonfinite": "fault.skip_nonfinite",
    "--debug": "fault.debug",
}


def _get(config: TrainConfig, key: str) -> object:
    section, name = key.split(".")
    obj = getattr(config, section)
    if section == "model" and name != "name":
        return getattr(obj.build(), name)
    return getattr(obj, name)


@pytest.mark.parametrize("flag", sorted(LEGACY_FLAGS))
def test_every_earlier_flag_still_sets_its_field(flag: str) -> None:
    value, key, expected = LEGACY_FLAGS[flag]
    ns = build_parser().parse_args([flag, value])
    assert getattr(ns, key) == expected


def test_every_earlier_switch_still_sets_its_field() -> None:
    for flag, key in LEGACY_SWITCHES.items():
        assert getattr(build_parser().parse_args([flag]), key) is True
        assert getattr(build_parser().parse_args([flag.replace("--", "--no-", 1)]), key) is False


def test_every_field_is_a_flag_with_its_docstring_as_help() -> None:
    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for f in schema():
        action = by_dest[f.key]
        dotted = f"--{f.section.replace('_', '-')}.{f.name.replace('_', '-')}"
        assert dotted in action.option_strings, f.key
        assert f.doc and f.doc.split()[0] in action.help, f.key  # the field's own words
    for key, aliases in FLAG_ALIASES.items():
        assert set(aliases) <= set(by_dest[key].option_strings), key


def test_a_new_field_is_a_new_flag_and_a_toml_key() -> None:
    """The flag and the TOML key come from the dataclass field alone (no list to extend)."""
    from moe.models.config import MoEConfig

    fields = {f.key for f in schema()}
    for section, cls in SECTIONS.items():
        if section != "model":
            assert {f"{section}.{f.name}" for f in dataclasses.fields(cls)} <= fields
    assert {f"model.{f.name}" for f in dataclasses.fields(MoEConfig)} <= fields


def test_print_config_reads_back_into_the_same_job(tmp_path: Path) -> None:
    argv = ["--pp", "2", "--ep", "2", "--layers", "4", "--vocab-size", "300", "--lr", "1e-3", "--betas", "0.8", "0.9"]
    argv += ["--data", "0.7", "a", "0.3", "b", "--lr-schedule", "wsd", "--ckpt-dir", str(tmp_path), "--zero", "1"]
    config, _ = config_from_args(argv, world=4)
    text = dump_toml(config)
    tomllib.loads(text)  # valid TOML
    # the layout auto resolves to, as a comment under the field (the vocabulary of 300 weighs the head)
    auto = auto_layout(config.model_config, 2, config.parallel.schedule)
    assert f'pipeline_layout = "auto"\n# auto = {auto!r}\n' in text and expand(auto).count("|") == 3
    path = tmp_path / "job.toml"
    path.write_text(text)
    again, _ = config_from_args(["--config", str(path)], world=4)
    assert again.model_config == config.model_config  # the file lists every field, the flags only some
    assert dataclasses.replace(again, model=config.model) == config
    assert dump_toml(again) == text
    assert again.model_config.vocab_size == 300 and again.parallel.dp == 2
    # flags override the file
    over, _ = config_from_args(["--config", str(path), "--lr", "2e-3"], world=4)
    assert over.optimizer.lr == 2e-3 and over.parallel.pp == 2


def test_a_job_printed_outside_its_launcher_asks_for_its_own_world() -> None:
    config, _ = config_from_args(["--pp", "2", "--ep", "4", "--print-config"], world=None)
    assert (config.parallel.dp, config.parallel.world_size) == (4, 8)
    config, _ = config_from_args(["--pp", "2", "--dp", "8", "--ep", "4"], world=None)
    assert config.parallel.world_size == 16


def test_print_config_on_the_command_line(tmp_path: Path) -> None:
    run = [sys.executable, str(ROOT / "examples/train.py"), "--schedule", "1f1b", "--num-experts", "4", "--pp", "2"]
    done = subprocess.run([*run, "--print-config"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    parsed = tomllib.loads(done.stdout)
    assert parsed["parallel"]["schedule"] == "1f1b" and parsed["model"]["num_experts"] == 4
    assert parsed["parallel"]["pp"] == 2 and parsed["parallel"]["dp"] == 1  # no launcher: the job's own world
    assert set(parsed) == set(SECTIONS)


def test_each_preset_has_a_config_file_that_loads() -> None:
    """Every preset's job loads; a job on a checkpoint directory (first-day.toml, whose directory the README's
    first commands make) is run by tests/e2e/test_first_day.py."""
    from moe.models.config import PRESETS

    files = sorted((ROOT / "examples/configs").glob("*.toml"))
    names = {f: tomllib.loads(f.read_text())["model"]["name"] for f in files}
    files = [f for f in files if names[f] in PRESETS]
    assert {names[f] for f in files} == set(PRESETS)
    assert set(names.values()) - set(PRESETS) == {"runs/first-day/base"}
    for f in files:
        raw = load_config(f)
        par = raw.get("parallel", {})
        world = par.get("pp", 1) * par.get("dp", par.get("ep", 1))
        config, _ = config_from_args(["--config", str(f)], world=world)
        assert config.model.name == raw["model"]["name"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "-1"], "error: optimizer.lr = -1.0: must be a positive number"),
        (["--lr", "nan"], "error: optimizer.lr = nan: must be a positive number"),
        (["--lr", "3"], "error: optimizer.lr = 3.0: must be below 1"),
        (["--weight-decay", "-0.1"], "error: optimizer.weight_decay = -0.1: must lie in [0, 1)"),
        (["--betas", "0.9", "1.0"], "error: optimizer.betas = (0.9, 1.0): must be two numbers in [0, 1)"),
        (["--eps", "0"], "error: optimizer.eps = 0.0: must lie in (0, 1)"),
        (["--warmup", "-1"], "error: lr_schedule.warmup = -1: must be >= 0 steps"),
        (["--clip-grad", "-1"], "error: optimizer.clip_grad = -1.0: must be >= 0"),
        (["--zero", "2"], "error: optimizer.zero = 2: must be 0 or 1"),
        (["--optimizer", "lion"], "error: optimizer.name = 'lion': choose one of ('adamw', 'sgd')"),
        (["--lr-schedule", "step"], "error: lr_schedule.name = 'step': choose one of ('warmup-cosine', 'wsd')"),
        (["--steps", "0"], "error: training.steps = 0: must be positive"),
        (["--dtype", "float16"], "error: training.dtype = 'float16': choose one of ('float32', 'bfloat16')"),
        (["--preset", "huge"], "error: model.name = 'huge': choose one of ('tiny', 'small', 'medium', 'v3', "),
        (["--num-experts", "6", "--top-k", "8"], "error: model: top_k=8 is larger than num_experts=6"),
        (["--data-dtype", "int8"], "error: data.dtype = 'int8': choose one of ('uint16', 'uint32')"),
        (["--ep", "2", "--num-experts", "5"], "error: parallel.ep = 2: must divide the model's 5 experts"),
        (["--ckpt-every", "2"], "error: checkpoint.every needs checkpoint.dir (--ckpt-every needs --ckpt-dir)"),
        (["--pp", "3"], "error: parallel.pp = 3: the world size 2 is not a multiple of it"),
        (["--dp", "4"], "error: parallel.pp x parallel.dp = 1 x 4 = 4, but the world size is 2"),
        (["--ema", "1"], "error: optimizer.ema = 1.0: must lie in (0, 1), a decay such as 0.999"),
        (["--ema", "0"], "error: optimizer.ema = 0.0: must lie in (0, 1)"),
        (["--ema", "nan"], "error: optimizer.ema = nan: must lie in (0, 1)"),
        (["--ema-weights"], "error: checkpoint.ema_weights needs --ema DECAY (--ema-weights exports the moving"),
        (["--ema", "0.9", "--ema-weights"], "error: checkpoint.ema_weights needs --save-hf DIR"),
        (["--ema", "0.999"], None),
        (["--rank-order", "pp,ep"], None),  # the old two-name order still reads
        (["--bogus", "1"], "error: unrecognized arguments: --bogus 1 (see --help)"),
        (["--lrr", "0.1"], "error: unrecognized arguments: --lrr 0.1 (did you mean '--lr'?)"),
    ],
)
def test_out_of_range_values_are_one_line_naming_the_field(argv: list[str], message: str | None) -> None:
    if message is None:
        config_from_args(argv, world=2)
        return
    with pytest.raises(UsageError) as info:
        config_from_args(argv, world=2)
    text = str(info.value.code)
    assert text.startswith(message) and "\n" not in text, text


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('[training]\nseq_len = "64"', "training.seq_len = '64': must be an integer (int)"),
        ("[training]\nsteps = 1.5", "training.steps = 1.5: must be an integer (int)"),
        ('[checkpoint]\nresume = "yes"', "checkpoint.resume = 'yes': must be true/false (bool)"),
        ("[data]\npath = 3", "data.path = 3: must be an array of strings (list[str])"),
        ('[data]\npath = "web"', "data.path = 'web': must be an array of strings (list[str])"),
        ("[optimizer]\nbetas = [0.9]", "optimizer.betas = [0.9]: must be an array of 2 numbers (tuple[float, float])"),
        ("[model]\nnum_experts = true", "model.num_experts = True: must be an integer (int)"),
        ("[parallel]\nrecompute = 1", "parallel.recompute = 1: must be true/false or a string (bool | str)"),
        ("[metrics]\ntensorboard_dir = 1", "metrics.tensorboard_dir = 1: must be a string (str)"),
    ],
)
def test_a_toml_value_of_the_wrong_type_names_the_field_and_its_type(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "job.toml"
    path.write_text(line + "\n")
    with pytest.raises(UsageError) as info:
        config_from_args(["--config", str(path)], world=1)
    assert str(info.value.code) == f"error: --config {path}: {message}"


def test_a_toml_value_of_the_right_type_reads(tmp_path: Path) -> None:
    """An int where a float is wanted, arrays for tuples, a string or a bool for a switch with levels."""
    path = tmp_path / "job.toml"
    path.write_text(
        "[model]\ndense_layers = [0]\n[optimizer]\nweight_decay = 0\nbetas = [0, 0.5]\n"
        '[parallel]\nrecompute = true\nrank_order = ["pp", "ep"]\n[data]\npath = ["web"]\n'
    )
    config, _ = config_from_args(["--config", str(path)], world=1)
    assert config.optimizer.weight_decay == 0 and list(config.optimizer.betas) == [0, 0.5]
    assert config.parallel.recompute == "full" and config.model.build().dense_layers == (0,)
    assert config.data.path == ["web"]


def test_config_file_mistakes_are_one_line(tmp_path: Path) -> None:
    cases = {
        "[optimiser]\nlr = 1e-3\n": "unknown table [optimiser]",
        "[optimizer]\nlearning_rate = 1e-3\n": "[optimizer] has no field 'learning_rate'",
        "[optimizer]\nlrr = 1e-3\n": "[optimizer] has no field 'lrr' (did you mean 'lr'?)",
        "[training]\nlr = 1e-3\n": "[training] has no field 'lr' (it is a field of [optimizer])",
        "[trainig]\nsteps = 3\n": "unknown table [trainig] (did you mean 'training'?); tables: model, ",
        "[optimizer]\nlr = \n": "not valid TOML",
        "lr = 1e-3\n": "lr is outside any table; put it under [optimizer]",
    }
    for text, message in cases.items():
        path = tmp_path / "bad.toml"
        path.write_text(text)
        with pytest.raises(UsageError, match=re.escape(message)):
            config_from_args(["--config", str(path)], world=1)
    with pytest.raises(UsageError, match="no such file"):
        config_from_args(["--config", str(tmp_path / "none.toml")], world=1)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_the_defaults_are_a_valid_job_at_any_world_size(world: int) -> None:
    config, _ = config_from_args([], world=world)
    assert config.parallel.world_size == world and config.parallel.pp == 1
    assert config.model_config.vocab_size >= 256  # the default data is byte-level


def test_lr_schedules() -> None:
    cos = LRScheduleConfig(name="warmup-cosine", warmup=10, min_ratio=0.1)
    assert [lr_at(cos, 1.0, s, 100) for s in (1, 5, 10)] == [0.1, 0.5, 1.0]
    assert lr_at(cos, 1.0, 55, 100) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(cos, 1.0, 100, 100) == pytest.approx(0.1)
    wsd = LRScheduleConfig(name="wsd", warmup=10, min_ratio=0.0, decay_fraction=0.2)
    assert lr_at(wsd, 2.0, 5, 100) == 1.0
    assert all(lr_at(wsd, 2.0, s, 100) == 2.0 for s in range(10, 81))  # stable until the last 20%
    assert lr_at(wsd, 2.0, 90, 100) == pytest.approx(1.0) and lr_at(wsd, 2.0, 100, 100) == 0.0
    # the stable phase does not depend on the run's length: a longer run agrees until its decay starts
    assert all(lr_at(wsd, 2.0, s, 100) == lr_at(wsd, 2.0, s, 1000) for s in range(1, 81))
    assert set(LR_SCHEDULES) == {"warmup-cosine", "wsd"}


def test_an_lr_schedule_is_one_registry_entry() -> None:
    from moe.train.lr import LRScheduleSpec, register_lr_schedule

    register_lr_schedule(LRScheduleSpec(name="constant", summary="flat", factor=lambda cfg, step, total: 1.0))
    try:
        config, _ = config_from_args(["--lr-schedule", "constant", "--lr", "0.25"], world=1)
        assert lr_at(config.lr_schedule, config.optimizer.lr, 7, 10) == 0.25
    finally:
        LR_SCHEDULES.unregister("constant")


def test_optimizer_choices_come_from_the_registry() -> None:
    for name in OPTIMIZERS:
        config, _ = config_from_args(["--optimizer", name], world=1)
        hyper = config.optimizer.hyper()
        assert set(hyper) == set(OPTIMIZERS[name].hyper) and math.isclose(hyper["lr"], 3e-3)


@pytest.mark.parametrize(
    ("ep", "extra", "problem"),
    [
        (6, [], "an ep group of 6 ranks; DeepEP runs 2, 4, 8 ranks within a node and 16, 24, 32, 48, 64, 96"),
        (40, [], "an ep group of 40 ranks; DeepEP runs"),
        (16, ["--comm-sms", "2"], "at least 4 --comm-sms across nodes (got 2)"),
        (8, [], None),
        (16, [], None),
    ],
)
def test_deepep_group_sizes_are_refused_with_the_config(ep: int, extra: list[str], problem: str | None) -> None:
    """DeepEP V1 has kernels for 2, 4, 8 ranks in a node and 16 .. 160 across nodes: --print-config says it."""
    flags = ["--dispatcher", "deepep", "--dtype", "bfloat16", "--hidden-size", "256", *extra]
    argv = [*flags, "--ep", str(ep), "--dp", str(ep), "--num-experts", str(2 * ep), "--print-config"]
    if problem is None:
        config_from_args(argv, world=ep)
        return
    with pytest.raises(UsageError) as info:
        config_from_args(argv, world=ep)
    text = str(info.value.code)
    assert text.startswith("error: --dispatcher deepep: ") and problem in text and "\n" not in text, text


def test_global_batch_size_decides_the_micro_batches_or_names_the_numbers() -> None:
    config, _ = config_from_args(["--micro-batch-size", "2", "--global-batch-size", "16"], world=2)
    assert (config.parallel.num_chunks, config.global_batch) == (4, 16)  # 2 sequences x dp 2 x 4 micro-batches
    argv = ["--micro-batch-size", "2", "--global-batch-size", "16", "--num-chunks", "2"]
    with pytest.raises(SystemExit, match=r"global_batch_size = 16: must be .* = 2 x 2 x 2 = 8$"):
        config_from_args(argv, world=2)
    with pytest.raises(SystemExit, match=r"or leave num_chunks unset and give a multiple of 4$"):
        config_from_args(["--micro-batch-size", "2", "--global-batch-size", "10"], world=2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "dualpipv"], "'dualpipv'"),
        (["--optimizer", "adamm"], "error: optimizer.name = 'adamm': choose one of ('adamw', 'sgd') (did you mean"),
        (["--recompute", "selectve"], "'selectve'"),
        (["--dispatcher", "alltoal"], "'alltoal'"),
    ],
)
def test_a_name_outside_its_registry_names_the_nearest(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv, world=2)
    assert message in str(exc.value.code)
    assert str(exc.value.code).endswith("?)")


@pytest.mark.parametrize(
    ("argv", "overlap", "message"),
    [
        # Unset, overlap goes wherever the schedule pairs: 1F1B's last rank needs an extra warm-up to pair.
        (["--schedule", "1f1b", "--pp", "2"], False, None),
        (["--schedule", "1f1b", "--pp", "2", "--extra-warmup", "1"], True, None),
        (["--schedule", "interleaved-1f1b", "--pp", "2"], True, None),
        (["--schedule", "zb1p", "--pp", "2", "--overlap", "--extra-warmup", "1"], True, None),
        (["--schedule", "1f1b", "--pp", "2", "--no-overlap", "--extra-warmup", "1"], False, None),
        (
            ["--schedule", "1f1b", "--pp", "2", "--overlap"],
            None,
            "pairs no forward with a backward; pass --extra-warmup 1",
        ),
        (["--schedule", "1f1b", "--pp", "1", "--overlap", "--extra-warmup", "1"], True, None),
        (["--schedule", "1f1b", "--pp", "2", "--extra-warmup", "3"], None, "would run all 4 of its forwards"),
        (["--schedule", "dualpipev", "--pp", "2", "--extra-warmup", "1"], None, "DualPipeV takes no extra warm-up"),
    ],
)
def test_overlap_and_extra_warmup_resolve_or_fail_in_one_line(
    argv: list[str], overlap: bool | None, message: str | None
) -> None:
    world = int(argv[argv.index("--pp") + 1])
    if message is None:
        config, _ = config_from_args(argv, world=world)
        assert config.parallel.overlap is overlap
        return
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv, world=world)
    text = str(exc.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text, text
