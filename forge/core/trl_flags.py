"""TRL's names as flags of transformers' HfArgumentParser, which TRL's TrlParser extends: TRL's scripts
(trl/scripts/grpo.py, examples/scripts/gspo.py) parse their GRPOConfig with it, next to TRL's ModelConfig,
from TRL's flags (`--num_generations 8 --per_device_train_batch_size 8 --bf16 --log_completions`) or from a
YAML file of TRL's names (`--config`).

HfArgumentParser makes a flag of each init field that dataclasses.fields(cls) shows, and builds the dataclass
from the parsed values of all of them, defaults included. Read by HfArgumentParser (and by it only: InitFields
in trl_attributes.py asks `asked_by_argument_parser`), GRPOConfig's fields are `parser_fields(cls)`:

    each Forge init field    its own type and flag, its default UNSET, so that only what the command line or
                             the YAML file gives reaches GRPOConfig (a default passed on would count as
                             given: --num_generations 4 next to group_size=8 would be two values of one
                             field); log_completions also alone, as TRL's switch
    each TRL name of the table that is no Forge field (trl_names.py)    a flag taking TRL's value: one (a
                             number, true/false, None, a JSON object or list, or text), several (a list:
                             `--report_to wandb tensorboard`) or none (true: `--bf16`); default UNSET

A switch that is on by default, Forge's (shuffle, share_prompt_prefix, ...) or TRL's (TRL_SWITCHES_ON), also
takes `--no_<name>` (and `--no-<name>`), as HfArgumentParser gives a bool field defaulting to True: false. Its
default, UNSET, would hide that from HfArgumentParser, so the form is an alias of the switch's own flag, which
reads the option it was given as (`SwitchFlag`, `TrlFlag`).

GRPOConfig's __init__ drops UNSET values (trl_attributes.py). dtype, lora_r, lora_alpha, lora_dropout and
lora_target_modules stay init=False, so TRL's ModelConfig keeps those flags. `--help` shows each TRL name's
meaning in Forge.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import sys
from typing import Any

from forge.core.trl_names import TRL_CONVERTED, TRL_IGNORED, TRL_NAMES, TRL_REFUSED, classify
from forge.core.trl_values import WHOLE_COUNTS


class _Unset:
    """What a flag holds when neither the command line nor the YAML file gives it."""

    def __repr__(self) -> str:
        return "unset"


UNSET = _Unset()

TRL_FLAG_NAMES = sorted({*TRL_NAMES, *TRL_CONVERTED, *TRL_IGNORED, *TRL_REFUSED})
"""TRL's names the parser takes as flags (those that are no Forge field)."""

TRL_SWITCHES_ON = {
    "average_tokens_across_devices", "dataloader_in_order", "dataloader_pin_memory",
    "ds3_gather_for_generation", "eval_do_concat_batches", "gradient_checkpointing", "log_multimodal",
    "log_on_each_node", "logging_nan_inf_filter", "shuffle_dataset", "skip_memory_metrics",
    "use_bias_correction_kl", "vllm_importance_sampling_correction",
}
"""The bool fields of TRL 1.16.0's GRPOConfig (with transformers' TrainingArguments) that default to True: a
TRL command line may turn each off with `--no_<name>` (tests/units/test_trl_surface.py compares this with
TRL's own)."""

BARE_FLAGS = {"log_completions"}
"""Forge fields TRL declares bool: a flag alone means true (log_completions=True, trl_values.py)."""

PARSER_MODULES = {"transformers.hf_argparser", "trl.scripts._hf_argparser"}
"""transformers' HfArgumentParser, and TRL's copy of it that TRL's TrlParser extends."""


def flag_value(text: str) -> Any:
    """A TRL flag's value from its text: true/false, None, a JSON object or list, a number, else the text."""
    word = text.strip()
    if word.lower() in ("true", "false"):
        return word.lower() == "true"
    if word.lower() in ("none", "null"):
        return None
    if word[:1] in ("{", "["):
        try:
            return json.loads(word)
        except json.JSONDecodeError:
            return text
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            continue
    return text


def takes_negation(name: str, is_bool: bool, default: Any) -> bool:
    """Whether a flag also takes `--no_<name>`: a bool switch on by default, Forge's or TRL's
    (TRL_SWITCHES_ON), as HfArgumentParser gives a bool field defaulting to True."""
    return is_bool and (default is True or name in TRL_SWITCHES_ON)


def _negated(option_string: str | None) -> bool:
    return bool(option_string) and option_string.startswith(("--no_", "--no-"))


def _negations(name: str) -> list[str]:
    """A switch's `--no_<name>` forms, HfArgumentParser's spelling and the hyphenated one."""
    return [f"--no_{name}", f"--no-{name.replace('_', '-')}"]


class TrlFlag(argparse.Action):
    """A TRL name's flag: no value is true (`--bf16`), one value that value, several a list; `--no_<name>` (a
    switch TRL turns on by default) is false."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        values = list(values or [])
        if _negated(option_string):
            if values:
                parser.error(f"{option_string} takes no value")
            setattr(namespace, self.dest, False)
            return
        setattr(namespace, self.dest, True if not values else values[0] if len(values) == 1 else values)


class CountFlag(argparse.Action):
    """A Forge count that transformers' TrainingArguments types float (trl_values.WHOLE_COUNTS): its text read
    as a number (`--num_train_epochs 1.0`), which GRPOConfig takes when whole (or as transformers' ratio)."""

    def __init__(self, *args, type=None, **kwargs) -> None:  # `type`: the annotation's int, replaced
        super().__init__(*args, type=flag_value, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)


class SwitchFlag(argparse.Action):
    """A Forge bool field's flag, `--name [true|false]`; for a switch on by default also `--no_<name>`:
    false."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if _negated(option_string):
            if values is not self.const:
                parser.error(f"{option_string} takes no value")
            values = False
        setattr(namespace, self.dest, values)


def asked_by_argument_parser() -> bool:
    """Whether the `__dataclass_fields__` that the descriptor calling this is reading is read by an
    HfArgumentParser (PARSER_MODULES), itself or through dataclasses.fields."""
    reader = sys._getframe(2)  # 0: here, 1: the descriptor's __get__, 2: what reads the attribute
    if reader.f_globals.get("__name__") == "dataclasses":
        reader = reader.f_back
    return reader is not None and reader.f_globals.get("__name__") in PARSER_MODULES


def _unset() -> _Unset:
    return UNSET


def _help(text: str) -> str:
    return " ".join(text.split()).replace("%", "%%")  # argparse %-formats the help


@functools.cache
def parser_fields(cls: type, own: tuple) -> dict[str, dataclasses.Field]:
    """The fields HfArgumentParser is shown (the module docstring): `own`, the class's fields, each with the
    default UNSET, then a field per TRL name that is no Forge field."""
    shown = {}
    for field in own:
        field = copy.copy(field)
        if field.init:
            factory = field.default_factory
            default = field.default if factory is dataclasses.MISSING else factory()
            extra = {"nargs": "?", "const": True} if field.name in BARE_FLAGS else {}
            if takes_negation(field.name, field.type in (bool, "bool"), default):
                extra = {"action": SwitchFlag, "aliases": _negations(field.name)}
            if field.name in WHOLE_COUNTS:
                extra = {"action": CountFlag}
            field.metadata = {**field.metadata, **extra,
                              "help": _help(f"Forge's {field.name} (docs/config.md), default {default!r}")}
            field.default, field.default_factory = UNSET, _unset
        shown[field.name] = field
    forge_names = set(shown)
    names = [name for name in TRL_FLAG_NAMES if name not in forge_names]
    flags = dataclasses.make_dataclass("TrlFlags", [
        (name, Any, dataclasses.field(default=UNSET, metadata={
            "help": _help("TRL's {}, {}: {}".format(name, *classify(name, forge_names))),
            "nargs": "*", "action": TrlFlag, "aliases": _negations(name) if name in TRL_SWITCHES_ON else []}))
        for name in names])
    shown.update({field.name: field for field in dataclasses.fields(flags)})
    return shown


FLAG_TYPES = {name: flag_value for name in TRL_FLAG_NAMES}
"""The annotations HfArgumentParser reads for the TRL names (typing.get_type_hints): the flag's value
parser."""


__all__ = ["FLAG_TYPES", "TRL_FLAG_NAMES", "TRL_SWITCHES_ON", "UNSET", "CountFlag", "SwitchFlag", "TrlFlag",
           "asked_by_argument_parser", "flag_value", "parser_fields", "takes_negation"]
