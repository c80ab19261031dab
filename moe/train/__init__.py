"""The trainer as a library: one configuration (:class:`TrainConfig`, a TOML file and flags), a :class:`Trainer`.

    from moe.train import Trainer, config_from_args

    config, _ = config_from_args(["--config", "examples/configs/tiny.toml", "--steps", "10"], world=4)
    trainer = Trainer(config)   # collective: every rank builds one
    trainer.train()
    trainer.close()

Modules: :mod:`.config` (the sections), :mod:`.cli` (flags and TOML from the fields), :mod:`.lr` (learning-rate
schedules), :mod:`.preflight` (checks before the first collective), :mod:`.metrics` (records and sinks),
:mod:`.trainer` (the loop), :mod:`.stop` (SIGINT and SIGTERM), :mod:`.launch` (the command); what the loop keeps:
:mod:`.optimizer` (fp32 masters, ZeRO-1), :mod:`.grad_sync` (gradient reduction, router balancing),
:mod:`.checkpoint` and :mod:`.manifest` (verified distributed checkpoints), :mod:`.guard` (non-finite checks),
:mod:`.memory` (the memory meter), :mod:`.ranks` (process groups and the pipeline).
"""

from moe.train.cli import UsageError, build_parser, config_from_args, dump_toml, load_config
from moe.train.config import ConfigError, TrainConfig
from moe.train.launch import cli, main
from moe.train.lr import LR_SCHEDULES, lr_at
from moe.train.trainer import Trainer, TrainingError

__all__ = [
    "LR_SCHEDULES",
    "ConfigError",
    "TrainConfig",
    "Trainer",
    "TrainingError",
    "UsageError",
    "build_parser",
    "cli",
    "config_from_args",
    "dump_toml",
    "load_config",
    "lr_at",
    "main",
]
