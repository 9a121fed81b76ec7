"""GRPOConfig from the command line: every field a `forge train` flag (its help the field's docstring), TRL's
config names as flags too (forge.core.config's table), a YAML file given with --config, and flags over it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

from forge.core.config import GRPOConfig
from forge.core.config_docs import field_docs
from forge.core.trl_batch import BATCH_NAMES
from forge.core.trl_flags import TRL_SWITCHES_ON, takes_negation
from forge.core.trl_names import TRL_CONVERTED, TRL_NAMES


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _field_parser(annotation):
    """A string -> value converter for a GRPOConfig field's type (None accepted for optional fields)."""
    hints = typing.get_type_hints(GRPOConfig)
    kind = hints[annotation] if isinstance(annotation, str) else annotation
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    optional = type(None) in typing.get_args(kind)
    base = args[0] if optional and args else kind
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        convert = lambda text: [item(x) for x in text.split(",") if x]
    elif base is bool:
        convert = parse_bool
    elif set(args) == {int, str}:  # a number or a word (micro_batch_size: 8 or auto)
        convert = lambda text: int(text) if text.strip().lstrip("-").isdigit() else text
    else:
        convert = base

    def parse(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        return convert(text)

    return parse


def _trl_value(text: str):
    """The value of a TRL flag Forge converts (--report_to wandb,tensorboard, --bf16 true, ...): a number,
    true/false, a comma-separated list of values, or the text."""
    if "," in text:
        return [_trl_value(part) for part in text.split(",") if part]
    for kind in (int, float, parse_bool):
        try:
            return kind(text)
        except (ValueError, argparse.ArgumentTypeError):
            continue
    return text


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per GRPOConfig field, its docstring the help; and TRL's names for them (core/trl_names.py
    TRL_NAMES, TRL_CONVERTED; docs/from-trl.md)."""
    docs = field_docs()
    group = parser.add_argument_group("GRPOConfig fields (defaults in brackets)")
    hints = typing.get_type_hints(GRPOConfig)
    for f in dataclasses.fields(GRPOConfig):
        flag = {"nargs": "?", "const": True} if hints[f.name] is bool else {}  # `--fsdp` alone means true
        group.add_argument(
            f"--{f.name}",
            type=_field_parser(f.name),
            default=None,
            metavar=f.name.upper(),
            help=f"{docs.get(f.name, '')} [{f.default}]".replace("%", "%%"),  # argparse %-formats
            **flag,
        )
        if takes_negation(f.name, hints[f.name] is bool, f.default):
            _add_negation(group, f.name)
    trl = parser.add_argument_group("TRL's GRPOConfig names (docs/from-trl.md)")
    for name, field in TRL_NAMES.items():
        flag = {"nargs": "?", "const": True} if hints[field] is bool else {}
        trl.add_argument(f"--{name}", type=_field_parser(field), default=None, metavar=field.upper(),
                         help=f"the same as --{field}", **flag)
        if name in TRL_SWITCHES_ON:
            _add_negation(trl, name)
    for name, convert in TRL_CONVERTED.items():
        what = " ".join((convert.__doc__ or "").split()).split(". ")[0]
        trl.add_argument(
            f"--{name}",
            type=_trl_value,
            nargs="?",
            const=True,
            default=None,
            metavar="VALUE",
            help=(what or f"TRL's {name} (the Forge field it sets: docs/from-trl.md)").replace("%", "%%"),
        )
        if name in TRL_SWITCHES_ON:
            _add_negation(trl, name)


def _add_negation(group, name: str) -> None:
    """`--no_<name>`: a switch on by default turned off, as transformers' HfArgumentParser spells it."""
    group.add_argument(f"--no_{name}", dest=name, action="store_const", const=False, help=f"--{name} false")


CONFIG_FLAGS = (*(f.name for f in dataclasses.fields(GRPOConfig)), *TRL_NAMES, *TRL_CONVERTED)
"""The `forge train` flags that are config values: GRPOConfig's fields and TRL's names for them."""


def _fields_of(name: str, value, values: dict) -> set[str]:
    """The GRPOConfig fields a Forge or TRL name sets (a converted TRL name: those its converter gives)."""
    if name in TRL_NAMES:
        return {TRL_NAMES[name]}
    # converted together (core/trl_batch.py), gradient_accumulation_steps one of the inputs
    if name in BATCH_NAMES:
        return {"prompts_per_step", "micro_batch_size"}
    if name in TRL_CONVERTED:
        try:
            defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
            return set(TRL_CONVERTED[name](value, {**defaults, **values}))
        except (TypeError, ValueError):
            return set()  # the converter refuses the value: GRPOConfig says why
    return {name}


def build_config(args: argparse.Namespace, overrides: dict | None = None) -> GRPOConfig:
    """GRPOConfig from the --config file, then `overrides`, then the flags: a later source wins for each
    field, whether it names it with Forge's name or TRL's."""
    from_file: dict = {}
    if getattr(args, "config", None):
        loaded = _read_yaml_config(Path(args.config))
        # fields at the top level, or under `grpo:` next to top-level model / dataset / reward / eval_dataset
        nested = loaded.get("grpo")
        if nested is not None and not isinstance(nested, dict):
            raise ValueError(f"{args.config}: `grpo:` must hold a mapping of GRPOConfig fields, "
                             f"got {nested!r:.60}")
        from_file = _yaml_numbers(loaded if nested is None else
                                  {**{k: v for k, v in loaded.items() if k in _RUN_SETTINGS}, **nested})
    given = {**(overrides or {}), **{name: value for name in CONFIG_FLAGS
                                     if (value := getattr(args, name, None)) is not None}}
    overridden = set().union(*(_fields_of(k, v, {**from_file, **given}) for k, v in given.items()))
    values = {k: v for k, v in from_file.items() if not _fields_of(k, v, from_file) & overridden} | given
    allowed = {f.name for f in dataclasses.fields(GRPOConfig)}
    yaml_only = {k: values.pop(k) for k in list(values) if k not in allowed and k in _RUN_SETTINGS}
    for key, value in yaml_only.items():  # run settings may also live in the YAML file
        if getattr(args, key, None) in (None, DEFAULTS.get(key)):
            setattr(args, key, value)
    config = GRPOConfig.from_dict(values).validate()
    args.resolved_config = config  # for the error message of a run that fails (where its checkpoints are)
    return config


def _read_yaml_config(path: Path) -> dict:
    """The mapping in a --config YAML file; a ValueError naming the file (and line) when it is not one."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                         f"{error.start}); save it as UTF-8") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ValueError(f"{path}{where}: not valid YAML ({problem}); fields are written `name: value`, "
                         f"one per line") from None
    if not isinstance(loaded, dict):
        raise ValueError(  # noqa: TRY004 - bad input in a file, reported like the others
            f"{path} must hold a mapping of GRPOConfig fields (`name: value` lines), got a "
            f"{type(loaded).__name__}"
        )
    return loaded


def _yaml_numbers(values: dict) -> dict:
    """PyYAML reads `learning_rate: 1e-5` (no dot) as the string '1e-5': make numeric strings of float fields
    floats. A string in any other field stays one, and validate() names the field."""
    hints = typing.get_type_hints(GRPOConfig)

    def number(value):
        if not isinstance(value, str):
            return value
        try:
            return float(value)
        except ValueError:
            return value

    converted = dict(values)
    for key, value in values.items():
        field = TRL_NAMES.get(key, key)
        kinds = typing.get_args(hints[field]) or (hints[field],) if field in hints else ()
        if float in kinds or key in TRL_CONVERTED:
            converted[key] = number(value)
        elif list[float] in kinds and isinstance(value, list):
            converted[key] = [number(item) for item in value]
    return converted


_RUN_SETTINGS = ("model", "dataset", "reward", "eval_dataset")  # `forge train` options a YAML file may set
DEFAULTS = {"model": "default", "dataset": "arithmetic", "reward": "math_correctness:1.0,tag_format:0.1"}
