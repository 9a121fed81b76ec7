"""One reader for JSON that Forge did not write, or that may have changed since: limits
checked before parsing.

A file in a model folder, a checkpoint or an output_dir can hold anything. json.loads recurses once per level
of nesting, so 200,000 `[` in config.json, COMPLETE, a safetensors header or a line of training_log.jsonl end
in a RecursionError wherever they are read; a file of gigabytes is read whole; and a list where an object
belongs fails later, as an AttributeError far from the file. Every reader of such JSON goes
through here instead:

    read_json(path, expect=dict)          the value of a file: at most MAX_JSON_BYTES, MAX_JSON_DEPTH levels
                                          deep, of the type `expect` (a type or a tuple of types)
    parse_json(text, where, expect=dict)  the same for text already read (a JSONL line, a safetensors header)

Anything else is a JSONFileError (a ValueError): `where` (the file, or "file, line n") and `problem`, a phrase
that starts with "is" ("is not valid JSON (...)"), so a caller can put the file's name in front of it in its
own words. The depth is counted on the text, outside strings, before json.loads sees it. Reading the file can
still raise an OSError (missing, unreadable, a link loop); the callers say what that means for them.
"""

from __future__ import annotations

import json
import os
import re
from itertools import accumulate
from pathlib import Path
from typing import Any

# safetensors' own limit for a header; a large vocabulary's tokenizer.json is ~30 MB
MAX_JSON_BYTES = 100_000_000
MAX_JSON_DEPTH = 100  # no file Forge, transformers or peft writes nests more than a few levels

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes included
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")
_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


class JSONFileError(ValueError):
    """JSON that Forge refuses to read; the message is `where` followed by `problem`."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where} {problem}")
        self.where, self.problem = where, problem


def read_json(path: str | os.PathLike, expect: type | tuple[type, ...] = dict, *,
              max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value in the file `path`; a JSONFileError naming it when it is too big, nests too deep, is not
    JSON (or not UTF-8), or is not of the type `expect`."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise JSONFileError(str(path), f"is {size:,} bytes, more than the {max_bytes:,} Forge reads as JSON")
    with path.open("rb") as f:
        data = f.read(max_bytes + 1)  # it may have grown since stat
    return parse_json(data, str(path), expect, max_bytes=max_bytes, max_depth=max_depth)


def parse_json(text: str | bytes, where: str, expect: type | tuple[type, ...] = dict, *,
               max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of `text` (read from `where`), checked as `read_json` checks a file."""
    if len(text) > max_bytes:
        raise JSONFileError(where, f"is {len(text):,} bytes, more than the {max_bytes:,} Forge reads as JSON")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise JSONFileError(where, "is not valid JSON (not UTF-8 text)") from None
    depth = nesting_depth(text, max_depth)
    if depth > max_depth:
        raise JSONFileError(
            where,
            f"is JSON nested {depth:,} levels deep, more than the {max_depth} Forge reads "
            f"(no file Forge or transformers writes nests more than a few)",
        )
    try:
        value = json.loads(text)
    except ValueError as error:
        raise JSONFileError(where, f"is not valid JSON ({error})") from None
    if not isinstance(value, expect):
        types = expect if isinstance(expect, tuple) else (expect,)
        wanted = " or ".join(dict.fromkeys(_JSON_TYPES[t] for t in types))
        raise JSONFileError(where, f"is not a JSON {wanted} (it holds {json_type(value)})")
    return value


def json_type(value: Any) -> str:
    """'an object', 'an array', 'a string', ...: what a parsed JSON value is, in JSON's words."""
    name = _JSON_TYPES.get(type(value), type(value).__name__)
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def nesting_depth(text: str, enough: int = 0) -> int:
    """How deeply the arrays and objects of the JSON `text` nest (brackets inside strings do not count). A
    text with at most `enough` opening brackets is not counted: their number, a bound on its depth, is
    returned instead."""
    opening = text.count("[") + text.count("{")
    if opening <= enough:
        return opening
    brackets = _NOT_A_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(1 if bracket in "[{" else -1 for bracket in brackets), default=0)


__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "JSONFileError", "json_type", "nesting_depth", "parse_json",
           "read_json"]
