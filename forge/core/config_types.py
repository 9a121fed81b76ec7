"""Each field of a config dataclass checked against its annotation, and every number for being finite: the
first check of GRPOConfig.validate(), so its range checks only ever see values of the right kind."""

from __future__ import annotations

import math
import numbers
import types
import typing
from dataclasses import fields


def _fits(value: object, hint: object) -> bool:
    """Whether `value` has the type the annotation `hint` names. bool is not an int, an int is a float;
    numpy scalars count as the Python number they stand for."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_fits(item, args[0]) for item in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return not isinstance(hint, type) or isinstance(value, hint)  # an annotation not covered above passes


def _type_name(hint: object) -> str:
    """'an int', 'a float or None', 'a list of float values or None': an annotation as a message says it."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) in (list, tuple):
        item = typing.get_args(hint)[0]
        return f"a list of {getattr(item, '__name__', item)} values"
    names = {
        bool: "a bool (true or false)",
        int: "an int (a whole number)",
        float: "a float",
        str: "a string",
        type(None): "None",
    }
    return names.get(hint, f"a {getattr(hint, '__name__', hint)}")


def _is_nonfinite(value: object) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_is_nonfinite(item) for item in value)
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isfinite(value)


def field_type_problems(config) -> list[str]:
    """One message per field whose value does not fit its annotation or is a NaN/inf number.

    Generic over `dataclasses.fields`, so a new field is checked without touching this."""
    hints = typing.get_type_hints(type(config))
    problems = []
    for field in fields(config):
        value = getattr(config, field.name)
        if not _fits(value, hints[field.name]):
            problems.append(f"{field.name}={value!r} ({type(value).__name__}) must be "
                            f"{_type_name(hints[field.name])}")
        elif _is_nonfinite(value):
            or_none = " (or None)" if _fits(None, hints[field.name]) else ""
            problems.append(f"{field.name}={value!r} must be a finite number{or_none}")
    return problems
