"""Command line and TOML file for :class:`moe.train.config.TrainConfig`, both generated from its fields.

Every field of every section is a flag ``--section.field`` (``--optimizer.lr``); a field whose name no other
section uses also answers to its bare name (``--lr``), and :data:`FLAG_ALIASES` keeps the flags of earlier
releases (``--ckpt-dir`` for ``checkpoint.dir``). The help text of a flag is its field's docstring, its type
the field's annotation. A new option is therefore one documented field.

Precedence: field defaults < the preset (``[model] name``) < ``--config FILE.toml`` < flags.
``--print-config`` prints the resolved job as TOML that ``--config`` reads back into the same job.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import os
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from dualpipe.schedule import SCHEDULES
from moe.command import CommandParser, UsageError, did_you_mean
from moe.dispatch import DISPATCHERS
from moe.models import ATTENTIONS
from moe.models.config import PRESETS, ROUTER_SCORINGS, MoEConfig
from moe.parallel import RECOMPUTE, ParallelConfig
from moe.pipeline_layout import AUTO
from moe.plan.params import auto_layout
from moe.train.config import DTYPES, SECTIONS, TOKEN_DTYPES, ConfigError, ModelConfig, TrainConfig, TrainingConfig
from moe.train.lr import LR_SCHEDULES
from moe.train.optimizer import OPTIMIZERS, STATE_DTYPES

__all__ = ["FLAG_ALIASES", "UsageError", "build_parser", "config_from_args", "dump_toml", "load_config"]

FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "model.name": ("--model", "--preset"),
    "model.num_layers": ("--layers",),
    "parallel.modules_per_rank": ("--stages-per-rank",),
    "optimizer.name": ("--optimizer",),
    "lr_schedule.name": ("--lr-schedule",),
    "data.path": ("--data",),
    "data.dtype": ("--data-dtype",),
    "training.dtype": ("--dtype",),
    "checkpoint.dir": ("--ckpt-dir",),
    "checkpoint.every": ("--ckpt-every",),
    "metrics.file": ("--metrics-file",),
}
"""Flags of earlier releases and the short names of fields whose bare name several sections share."""

CHOICES: dict[str, object] = {
    "model.name": PRESETS,
    "model.attention": ATTENTIONS,
    "model.router_scoring": ROUTER_SCORINGS,
    "parallel.schedule": SCHEDULES,
    "parallel.dispatcher": DISPATCHERS,
    "parallel.recompute": RECOMPUTE,
    "optimizer.name": OPTIMIZERS,
    "optimizer.state_dtype": STATE_DTYPES,
    "lr_schedule.name": LR_SCHEDULES,
    "training.dtype": DTYPES,
    "data.dtype": TOKEN_DTYPES,
}
"""The registries (or tuples) a field's value comes from, for ``--help``; the sections validate against them."""

_WORLD_DEPENDENT = ("parallel.dp",)  # resolved from the world size when not given


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    section: str
    name: str
    type: Any
    default: Any
    doc: str

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


_RST = re.compile(r":[a-z]+:`~?([^`]+)`|``([^`]+)``")


def plain(doc: str) -> str:
    """A docstring as help text: whitespace collapsed, reST roles and literals as plain words."""
    return _RST.sub(lambda m: m.group(1) or m.group(2), " ".join(doc.split()))


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass, from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in itertools.pairwise(body):
        named = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        literal = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        if named and literal and isinstance(nxt.value.value, str):
            docs[stmt.target.id] = plain(nxt.value.value)
    return docs


def _dataclass_fields(section: str, cls: type, skip: tuple[str, ...] = ()) -> list[_Field]:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:  # derived state is no option
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append(_Field(section, f.name, hints[f.name], default, docs.get(f.name, "")))
    return out


@functools.cache
def schema() -> tuple[_Field, ...]:
    """Every configurable field in file order; ``[model]`` lists ``name`` then MoEConfig's fields (defaults:
    the ``tiny`` preset's)."""
    fields: list[_Field] = []
    for section, cls in SECTIONS.items():
        if cls is ModelConfig:
            fields += _dataclass_fields(section, cls, skip=("overrides",))
            tiny = PRESETS["tiny"]
            fields += [
                dataclasses.replace(f, default=getattr(tiny, f.name)) for f in _dataclass_fields(section, MoEConfig)
            ]
        else:
            fields += _dataclass_fields(section, cls)
    return tuple(fields)


def _base(tp: Any) -> tuple[Any, bool]:
    """(the type without ``| None``, whether None is allowed)."""
    return _union(tp)[0], type(None) in typing.get_args(tp)


def _union(tp: Any) -> list[Any]:
    """The members of a union annotation but None; ``[tp]`` for any other annotation."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _flags(f: _Field, bare_names: dict[str, int]) -> list[str]:
    flags = [f"--{f.section.replace('_', '-')}.{f.name.replace('_', '-')}"]
    aliases = FLAG_ALIASES.get(f.key)
    if aliases:
        flags += aliases
    elif bare_names[f.name] == 1:
        flags.append(f"--{f.name.replace('_', '-')}")
    return flags


def _add_argument(group: argparse._ArgumentGroup, f: _Field, flags: list[str]) -> None:
    tp, optional = _base(f.type)
    choices = CHOICES.get(f.key)
    help_text = f.doc + (f" Choices: {', '.join(choices)}." if choices else "")
    shown = "unset" if f.default is None else f.default
    kwargs: dict[str, Any] = {"dest": f.key, "default": argparse.SUPPRESS}
    kwargs["help"] = f"{help_text} (default: {shown})".replace("%", "%%")
    origin = typing.get_origin(tp)
    if set(typing.get_args(f.type)) == {bool, str}:  # a switch with levels: --recompute [LEVEL], --no-recompute
        kwargs.update(action=_SwitchOrValue, metavar=f.name.upper())
    elif tp is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is list:
        kwargs.update(nargs="+", metavar="VALUE")
    elif origin is tuple:
        args = typing.get_args(tp)
        if args[-1] is Ellipsis:  # tuple[T, ...]: one comma-separated argument
            elem = args[0]
            kwargs.update(type=lambda s: tuple(elem(x.strip()) for x in s.split(",") if x.strip()), metavar="A,B,...")
        else:
            kwargs.update(nargs=len(args), type=args[0], metavar=f.name.upper())
    else:
        kwargs["type"] = _none_or(tp) if optional else tp
        kwargs["metavar"] = {int: "N", float: "X"}.get(tp, f.name.upper())
    group.add_argument(*flags, **kwargs)


class _SwitchOrValue(argparse.BooleanOptionalAction):
    """A ``bool | str`` field: ``--flag`` is True, ``--no-flag`` False, ``--flag VALUE`` the value (the field
    checks it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nargs = "?"

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        if option_string is not None and option_string.startswith("--no-"):
            setattr(namespace, self.dest, False)
        else:
            setattr(namespace, self.dest, True if values is None else values)


def _none_or(tp: type) -> Any:
    def parse(s: str) -> Any:
        return None if s.lower() in ("none", "auto") else tp(s)

    parse.__name__ = tp.__name__
    return parse


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The trainer's argument parser: ``--config``, ``--print-config`` and one flag per field (see the module
    docstring); a flag not given is absent from the namespace, so only what the user typed overrides."""
    p = CommandParser(
        description=description,
        usage="%(prog)s [--config FILE.toml] [--print-config] [--section.field VALUE | --flag VALUE ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--config", metavar="FILE.toml", help="a TOML file, one table per section (examples/configs/)")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as TOML (what --config reads) and exit",
    )
    fields = schema()
    bare: dict[str, int] = {}
    for f in fields:
        bare[f.name] = bare.get(f.name, 0) + 1
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields:
        if f.section not in groups:
            doc = plain((SECTIONS[f.section].__doc__ or "").strip().split("\n\n")[0])
            groups[f.section] = p.add_argument_group(f"[{f.section}]", doc.replace("%", "%%"))
        _add_argument(groups[f.section], f, _flags(f, bare))
    return p


def load_config(path: str | Path) -> dict[str, dict[str, Any]]:
    """A TOML file as ``{section: {field: value}}``; an unknown table or key, or a value of the wrong type for
    its field's annotation, is a one-line error naming it (and the nearest name, the type it wants)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the same parser before it joined the standard library (a dependency on Python 3.10)
        import tomli as tomllib
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise UsageError(f"error: --config {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"error: --config {path}: not valid TOML ({exc})") from None
    fields = {f.key: f for f in schema()}
    known: dict[str, list[str]] = {}
    for f in fields.values():
        known.setdefault(f.section, []).append(f.name)
    owner = {f.name: f.section for f in reversed(schema())}
    for section, table in raw.items():
        if not isinstance(table, dict):
            where = f"[{owner[section]}]" if section in owner else "its table"
            raise UsageError(f"error: --config {path}: {section} is outside any table; put it under {where}")
        if section not in known:
            near = did_you_mean(section, known)
            raise UsageError(f"error: --config {path}: unknown table [{section}]{near}; tables: {', '.join(known)}")
        for key, value in table.items():
            if key not in known[section]:
                elsewhere = f" (it is a field of [{owner[key]}])" if key in owner else ""
                near = elsewhere or did_you_mean(key, known[section])
                raise UsageError(f"error: --config {path}: [{section}] has no field {key!r}{near}")
            tp = fields[f"{section}.{key}"].type
            if not _fits(value, tp):
                raise UsageError(f"error: --config {path}: {section}.{key} = {value!r}: must be {_wanted(tp)}")
    return raw


_KINDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true/false", "booleans"),
          str: ("a string", "strings")}  # fmt: skip


def _fits(value: Any, tp: Any) -> bool:
    """Whether a TOML value fits a field's annotation (an int fits a float; a TOML array is a list)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in _union(tp))
    if origin in (list, tuple):
        if not isinstance(value, list):
            return False
        if origin is tuple and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(map(_fits, value, args))
        return all(_fits(v, args[0]) for v in value)
    if isinstance(value, bool) and tp is not bool:  # a bool is an int to Python, not to TOML
        return False
    return isinstance(value, (int, float) if tp is float else tp)


def _wanted(tp: Any) -> str:
    """What a field's annotation asks of a TOML value, in words and as the annotation (None left out: TOML
    leaves an unset field out): ``an integer (int)``, ``an array of 2 numbers (tuple[float, float])``."""
    words, names = [], []
    for a in _union(tp):
        origin, args = typing.get_origin(a), typing.get_args(a)
        if origin in (list, tuple):
            count = "" if origin is list or args[-1] is Ellipsis else f"{len(args)} "
            words.append(f"an array of {count}{_KINDS[args[0]][1]}")
            names.append(repr(a))
        else:
            words.append(_KINDS[a][0])
            names.append(a.__name__)
    return f"{' or '.join(words)} ({' | '.join(names)})"


def _sections(values: dict[str, dict[str, Any]], world: int | None) -> dict[str, Any]:
    """Section objects from ``{section: {field: value}}``; ``parallel.dp`` defaults to world / pp (to ep when
    the world is not known)."""
    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        given = dict(values.get(section, {}))
        if cls is ModelConfig:
            built[section] = ModelConfig(name=given.pop("name", "tiny"), overrides=given)
            continue
        if cls is ParallelConfig:
            if "rank_order" in given:
                given["rank_order"] = tuple(given["rank_order"])
            if given.get("dp") is None and world is None:
                given["dp"] = given.get("ep", 1)
            elif given.get("dp") is None:
                pp = given.get("pp", 1)
                if world % pp:
                    raise ConfigError(
                        f"parallel.pp = {pp}: the world size {world} is not a multiple of it; launch pp x dp "
                        "processes (torchrun --nproc-per-node ...)"
                    )
                given["dp"] = world // pp
            _chunks_from_global_batch(given, values.get("training", {}))
        try:
            built[section] = cls(**given)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"[{section}] {exc}") from None
    return built


def _chunks_from_global_batch(parallel: dict[str, Any], training: dict[str, Any]) -> None:
    """``training.global_batch_size`` given and ``parallel.num_chunks`` not: the micro-batches that make it (when
    they do not divide it, num_chunks stays unset and TrainConfig's check names the numbers)."""
    global_batch = training.get("global_batch_size")
    if global_batch is None or parallel.get("num_chunks") is not None:
        return
    per = training.get("micro_batch_size", TrainingConfig().micro_batch_size) * parallel["dp"]
    if global_batch % per == 0:
        parallel["num_chunks"] = global_batch // per


def _nearest_choice(values: dict[str, dict[str, Any]], message: str) -> str:
    """The did-you-mean tail for the error ``message`` about a name outside its registry (:data:`CHOICES`); ``""``
    when the message is about something else or no name is near."""
    for key, choices in CHOICES.items():
        value = values.get(key.split(".")[0], {}).get(key.split(".")[1])
        if isinstance(value, str) and value not in choices and repr(value) in message:
            return did_you_mean(value, [str(c) for c in choices])
    return ""


def config_from_args(
    argv: list[str] | None, world: int | None, description: str | None = None
) -> tuple[TrainConfig, argparse.Namespace]:
    """Parse ``argv`` (flags over an optional ``--config`` file) into a validated job for ``world`` ranks
    (None: the world the job asks for, pp x dp, with dp defaulting to ep)."""
    ns = build_parser(description).parse_args(argv)
    values = load_config(ns.config) if ns.config else {}
    for key, value in vars(ns).items():
        if "." in key:
            section, name = key.split(".", 1)
            values.setdefault(section, {})[name] = value
    try:
        config = TrainConfig(**_sections(values, world))
    except ConfigError as exc:
        raise UsageError(f"error: {exc}{_nearest_choice(values, str(exc))}") from None
    if world is not None and config.parallel.world_size != world:
        pc = config.parallel
        raise UsageError(
            f"error: parallel.pp x parallel.dp = {pc.pp} x {pc.dp} = {pc.world_size}, but the world size is "
            f"{world}; launch pp x dp processes (torchrun --nnodes ... --nproc-per-node ...)"
        )
    return config, ns


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if not isinstance(value, float) or value == value else "nan"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(config: TrainConfig) -> str:
    """The resolved job as TOML, one table per section, every field (unset ones, TOML having no null, left
    out: they read back as unset); the model table lists the full resolved MoEConfig."""
    lines: list[str] = []
    for section in SECTIONS:
        obj = getattr(config, section)
        lines.append(f"[{section}]")
        if isinstance(obj, ModelConfig):
            items = {"name": obj.name, **dataclasses.asdict(obj.build())}
        else:
            items = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        for key, value in items.items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
            if key == "pipeline_layout" and value == AUTO:  # what auto resolves to, for this model and schedule
                pc = config.parallel
                layout = auto_layout(config.model.build(), pc.pp, pc.schedule, pc.modules_per_rank)
                lines.append(f"# auto = {layout!r}")
        lines.append("")
    return "\n".join(lines)


def world_size_from_env() -> int:
    """The launcher's world size (torchrun's ``WORLD_SIZE``; 1 for a plain ``python``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def print_once(message: str, file: typing.TextIO = sys.stdout) -> None:
    """Print on global rank 0 only (before the process group exists, from torchrun's ``RANK``)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=file, flush=True)
