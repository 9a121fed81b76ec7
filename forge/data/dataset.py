"""Load training rows from lists, HF datasets, JSONL files or built-in names, and check them early.

A row is a mapping with a ``prompt`` (a string, or chat messages ``[{"role", "content"}, ...]``)
and any other columns, typically ``reference``. Every column besides ``prompt`` is passed to the
rewards as a keyword argument (forge/core/scoring.py `reward_kwargs`), ``reference`` under the name
``references``.
Columns whose name starts with ``_`` are Forge's own bookkeeping (``_row``: the row's index in the
dataset, named in error messages) and are not passed on.

`validate_rows` turns every malformed dataset into a ValueError that names the row and says what
was expected, before any model is loaded.
"""

from __future__ import annotations

import hashlib
import json
import random
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from forge.data.arithmetic import ARITHMETIC_TASK, arithmetic_heldout
from forge.data.gsm8k import GSM8K_MOCK_TASK, GSM8K_TASK, GSM_HARD_TASK
from forge.data.hf_dataset import load_hf_rows
from forge.data.reasoning_gym_tasks import REASONING_GYM_TASK, RG_PREFIX, load_reasoning_gym_spec
from forge.data.task import Task

__all__ = [
    "BUILTIN_DATASETS",
    "CHAT_PROMPT_SOURCES",
    "ROW_FORMAT",
    "TASKS",
    "as_chat_rows",
    "builds_prompts",
    "builtin_dataset",
    "checked_rows",
    "dataset_identity",
    "is_chat",
    "iterate_steps",
    "load_jsonl",
    "load_rows",
    "pick_chat",
    "rows_per_step",
    "source_kwargs",
    "task_for",
    "training_rows",
    "validate_rows",
    "warn_if_raw_prompts",
]

ROW_FORMAT = "{'prompt': str | list[{'role': str, 'content': str}], 'reference': ...}"
_RESERVED_COLUMNS = ("prompts", "responses", "completions")


TASKS: dict[str, Task] = {task.name: task for task in (GSM8K_TASK, GSM8K_MOCK_TASK, GSM_HARD_TASK,
                                                         ARITHMETIC_TASK, REASONING_GYM_TASK)}
"""The built-in tasks by dataset name: their rows, held-out rows and grader (`forge.data.task`). reasoning-gym
is a family named ``reasoning-gym:NAME[:KEY=VALUE,...]``; `task_for` finds a task by any dataset name."""

BUILTIN_DATASETS: dict[str, Callable[..., list[dict]]] = {
    **{name: task.rows for name, task in TASKS.items() if name != REASONING_GYM_TASK.name},
    "arithmetic-heldout": arithmetic_heldout,
}
"""Dataset names `load_rows` understands; keyword arguments go to the loader."""

_PREFIXED_SOURCES = ("reasoning-gym:", "hf:")


def task_for(source: Any) -> Task | None:
    """The built-in task of a dataset name (for ``reasoning-gym:NAME...``: the family's, with that name bound
    into its loaders), or None for anything else (a JSONL file, ``hf:``, a list of rows)."""
    if not isinstance(source, str):
        return None
    if source.startswith(RG_PREFIX):
        family = REASONING_GYM_TASK
        return replace(family, name=source, rows=partial(family.rows, source),
                       heldout=partial(family.heldout, source))
    return TASKS.get(source)


def _prefixed_source(source: str, **kwargs: Any) -> list[dict]:
    """Rows of ``reasoning-gym:NAME[@heldout]`` or ``hf:ORG/NAME[:CONFIG][@SPLIT]``; keyword arguments go
    to `forge.data.reasoning_gym_tasks.load_reasoning_gym_spec` / `forge.data.hf_dataset.load_hf_rows`."""
    if source.startswith(RG_PREFIX):
        return load_reasoning_gym_spec(source, **kwargs)
    return load_hf_rows(source, **kwargs)


CHAT_PROMPT_SOURCES = ("gsm8k", "gsm8k-mock", "gsm-hard", "arithmetic", "arithmetic-heldout")
"""Built-in names whose loaders build the prompt and take ``chat=``, as do ``reasoning-gym:`` and ``hf:``."""


def builds_prompts(source: Any) -> bool:
    """Whether Forge writes the prompts of ``source`` (and so can write them as chat messages or plain
    text)."""
    return isinstance(source, str) and (source in CHAT_PROMPT_SOURCES or source.startswith(_PREFIXED_SOURCES))


def pick_chat(chat: bool | None, tokenizer: Any, source: Any = None, announce: bool = True) -> bool:
    """``chat`` when given; else True when the tokenizer has a chat template. With ``announce`` the
    automatic choice is printed to stderr for a source whose prompts Forge builds (`builds_prompts`)."""
    if chat is not None:
        return bool(chat)
    chosen = bool(getattr(tokenizer, "chat_template", None))
    if announce and builds_prompts(source):
        import sys

        reason = ("the tokenizer has a chat template, so its prompts are chat messages (--chat false for "
                  "plain text)" if chosen
                  else "the tokenizer has no chat template, so its prompts are plain text")
        print(f"forge: {source}: {reason}", file=sys.stderr)
    return chosen


def as_chat_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows with each string prompt as one user message, ``[{"role": "user", "content": prompt}]`` (what
    ``--chat true`` does to the prompts of any source); chat prompts stay as they are."""
    return [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]}
            if isinstance(row.get("prompt"), str) else row for row in rows]


def warn_if_raw_prompts(rows: Iterable[dict], tokenizer: Any) -> bool:
    """Warn (True) when string prompts reach a tokenizer with a chat template: the model then sees the prompt
    as raw text, without its chat format."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    count = sum(isinstance(row.get("prompt"), str) for row in rows)
    if not count:
        return False
    warnings.warn(f"{count} prompts are plain strings and the tokenizer has a chat template: they reach the "
                  f"model as raw text, without its chat format. Wrap each as one user message with --chat "
                  f"true (in Python: forge.data.dataset.as_chat_rows), or give the prompts as chat messages "
                  f"[{{'role': 'user', 'content': ...}}]",
                  stacklevel=2)
    return True


def source_kwargs(source: Any, *, chat: bool, heldout: bool = False, n: int | None = None,
                  split: str | None = None, prompt_column: str | None = None,
                  reference_column: str | None = None) -> dict[str, Any]:
    """The `load_rows` keyword arguments that fit ``source``: ``chat`` for sources that build prompts, the
    split (held-out rows for ``reasoning-gym:`` when ``heldout``), the row count and the column names for
    ``hf:``. Other sources (JSONL files) take none."""
    if not builds_prompts(source):
        return {}
    if source.startswith("hf:"):
        return {"chat": chat, "split": split or ("test" if heldout else "train"), "n": n,
                "prompt_column": prompt_column, "reference_column": reference_column}
    if source.startswith("reasoning-gym:"):
        return {"chat": chat, "split": "heldout" if heldout else "train", "n": n}
    return {"chat": chat}


def builtin_dataset(name: str, **kwargs: Any) -> list[dict]:
    """Rows of a built-in dataset, e.g. ``builtin_dataset("arithmetic", n=100, seed=1)``."""
    if name not in BUILTIN_DATASETS:
        raise ValueError(f"unknown built-in dataset '{name}'; choose from {', '.join(BUILTIN_DATASETS)}")
    return BUILTIN_DATASETS[name](**kwargs)


# The first bytes of compressed files someone may pass for a .jsonl: name -> magic number.
_COMPRESSED_MAGIC = {"gzip": b"\x1f\x8b", "zip": b"PK\x03\x04", "bzip2": b"BZh", "xz": b"\xfd7zXZ",
                     "zstd": b"\x28\xb5\x2f\xfd"}


def _decode_line(path: Path, line_number: int, raw: bytes) -> str:
    """One line of a JSONL file as text; a ValueError naming file, line and byte when it is not UTF-8."""
    try:
        return raw.decode("utf-8-sig" if line_number == 1 else "utf-8")  # a leading BOM is tolerated
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path}, line {line_number}: not UTF-8 text (byte {raw[error.start]:#04x} at column "
            f"{error.start + 1}); save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None


def load_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSON Lines file (UTF-8), one JSON object per line; blank lines are skipped.

    A compressed file or one that is not UTF-8 is a ValueError naming the file (and the line)."""
    path = Path(path)
    rows = []
    with path.open("rb") as file:
        head = file.read(8)
        for kind, magic in _COMPRESSED_MAGIC.items():
            if head.startswith(magic):
                raise ValueError(f"{path} is a {kind}-compressed file, not JSON Lines text; decompress it "
                                 f"first (e.g. `gunzip -k {path}` for gzip) and pass the .jsonl")
        file.seek(0)
        for line_number, raw in enumerate(file, start=1):
            line = _decode_line(path, line_number, raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}, line {line_number}: not valid JSON ({error.msg}); "
                    f"each line must be one JSON object like {ROW_FORMAT}"
                ) from error
            except RecursionError:
                raise ValueError(f"{path}, line {line_number}: JSON nested too deeply to read; a row is one "
                                 f"JSON object like {ROW_FORMAT}, its values a few levels deep at "
                                 f"most") from None
            if not isinstance(row, dict):
                raise ValueError(  # noqa: TRY004 - a data error in the file, reported like the others
                    f"{path}, line {line_number}: expected a JSON object like {ROW_FORMAT}, "
                    f"got a JSON {type(row).__name__}"
                )
            problem = _text_problem(row)
            if problem is not None:
                raise ValueError(f"{path}, line {line_number}: {problem}")
            rows.append(row)
    return rows


MAX_ROW_DEPTH = 100
"""How deeply a JSONL row's values may nest (lists in dicts in lists...); deeper rows are refused when
loaded."""


def _text_problem(row: dict) -> str | None:
    """Why a row read from JSON cannot be used as text, or None: a lone surrogate ('\\udcff' is valid JSON
    but no character, and a tokenizer fails on it mid-run) or values nested deeper than MAX_ROW_DEPTH."""
    stack = [("the row", row, 0)]
    while stack:  # not recursive: the row may be nested as deep as json.loads goes
        where, item, depth = stack.pop()
        if depth > MAX_ROW_DEPTH:
            return (f"{where} is nested more than {MAX_ROW_DEPTH} levels deep; a row is one JSON object like "
                    f"{ROW_FORMAT}, its values a few levels deep at most")
        texts = [item] if isinstance(item, str) else []
        if isinstance(item, dict):
            texts = list(item)
            stack += [(repr(key) if depth == 0 else where, v, depth + 1) for key, v in item.items()]
        elif isinstance(item, list):
            stack += [(where, v, depth + 1) for v in item]
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                return (f"{where} holds {text[error.start]!r}, an escape of half a UTF-16 pair that is no "
                        f"character (no tokenizer reads it); remove it or write the whole character")
    return None


def load_rows(source: Any, *, validate: bool = True, **builtin_kwargs: Any) -> list[dict]:
    """Rows from any supported source, as a new list of plain dicts.

    ``source`` may be a list of mappings, any iterable of mappings (a Hugging Face
    ``datasets.Dataset``), a path to a ``.jsonl`` file, or a built-in dataset name
    (`BUILTIN_DATASETS`; ``builtin_kwargs`` go to its loader). With ``validate`` the rows are
    checked by `validate_rows`.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if isinstance(source, str) and source in BUILTIN_DATASETS:
            rows = builtin_dataset(source, **builtin_kwargs)
        elif isinstance(source, str) and source.startswith(_PREFIXED_SOURCES):
            rows = _prefixed_source(source, **builtin_kwargs)
        elif path.is_file():
            rows = load_jsonl(path)
        else:
            raise ValueError(
                f"dataset '{source}' is neither an existing .jsonl file nor a built-in dataset "
                f"({', '.join(BUILTIN_DATASETS)}) nor 'reasoning-gym:NAME' / 'hf:ORG/NAME[:CONFIG][@SPLIT]'"
            )
    elif isinstance(source, Mapping):
        raise TypeError(
            f"got a mapping with keys {list(source)[:5]} instead of rows; for a DatasetDict pass one split, "
            "e.g. dataset['train']"
        )
    elif isinstance(source, Iterable):
        rows = [dict(row) if isinstance(row, Mapping) else row for row in source]
    else:
        raise TypeError(
            f"cannot load rows from {type(source).__name__}; pass a list of dicts, a datasets.Dataset, "
            "a .jsonl path or a built-in dataset name"
        )
    if validate:
        validate_rows(rows)
    return rows


def is_chat(prompt: Any) -> bool:
    """Whether ``prompt`` is chat messages: a non-empty list of mappings with ``role`` and ``content``."""
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(
            isinstance(message, Mapping) and "role" in message and "content" in message for message in prompt
        )
    )


def _prompt_problem(prompt: Any) -> str | None:
    """Why ``prompt`` is not usable, or None if it is."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "is an empty string"
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            return "is an empty list of messages"
        for index, message in enumerate(prompt):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                return f"message {index} is not a {{'role': ..., 'content': ...}} dict (got {message!r:.80})"
            if not isinstance(message["role"], str) or not isinstance(message["content"], str):
                return f"message {index} needs string 'role' and 'content'"
        return None
    return f"has type {type(prompt).__name__}"


def validate_rows(rows: Sequence[Any]) -> None:
    """Raise a ValueError naming the first problem in ``rows``, or return None if they are usable.

    Checks: at least one row; every row a mapping with a ``prompt`` that is a non-empty string or
    a list of ``{"role", "content"}`` messages; every row with the same columns (each column
    becomes one reward keyword argument); no column named like a reward's positional argument.
    """
    if len(rows) == 0:
        raise ValueError(f"dataset is empty; give at least one row like {ROW_FORMAT}")
    columns: set[str] | None = None
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(  # noqa: TRY004 - every dataset problem is a ValueError, raised before training
                f"dataset row {index} is a {type(row).__name__}, not a mapping; expected {ROW_FORMAT}"
            )
        if "prompt" not in row:
            raise ValueError(
                f"dataset row {index} has no 'prompt' key (keys: {sorted(row)}); expected {ROW_FORMAT}"
            )
        problem = _prompt_problem(row["prompt"])
        if problem is not None:
            raise ValueError(
                f"dataset row {index}: 'prompt' {problem}; it must be a non-empty str or a list of "
                "{'role': str, 'content': str} messages"
            )
        if columns is None:
            columns = set(row)
        elif set(row) != columns:
            raise ValueError(
                f"dataset row {index} has columns {sorted(row)} but row 0 has {sorted(columns)}; every row "
                "needs the same columns because each one is passed to the rewards as a list"
            )
    assert columns is not None
    reserved = sorted(columns & set(_RESERVED_COLUMNS))
    if reserved:
        raise ValueError(
            f"dataset columns {reserved} clash with the rewards' positional arguments; rename them"
        )
    if "reference" in columns and "references" in columns:
        raise ValueError("dataset has both 'reference' and 'references' columns; keep one ('reference')")


# --------------------------------------------------------------------------------------------------
# the order in which a run visits the rows


def rows_per_step(num_rows: int, prompts_per_step: int, wanted: int) -> int:
    """Rows one optimizer step uses: `wanted` (prompts_per_step x gradient_accumulation_steps), or every whole
    rollout batch of a dataset smaller than that (with a warning), so a small dataset still trains."""
    if num_rows >= wanted:
        return wanted
    usable = num_rows - num_rows % prompts_per_step
    if usable == 0:
        raise ValueError(f"the dataset has {num_rows} rows, fewer than prompts_per_step={prompts_per_step}; "
                         f"add rows or lower prompts_per_step")
    warnings.warn(f"the dataset has {num_rows} rows but one optimizer step asks for prompts_per_step x "
                  f"gradient_accumulation_steps = {wanted}; each step uses {usable} rows instead",
                  stacklevel=3)
    return usable


def iterate_steps(rows: Sequence[dict], per_step: int, *, seed: int, shuffle: bool, epoch: int = 0,
                  position: int = 0, num_epochs: int | None = None) -> Iterator[tuple[list[dict], int, int]]:
    """Yield (rows of one optimizer step, epoch, position after it) from (epoch, position) on: a seeded
    shuffle per epoch (seed + epoch), so a resumed run sees the same order; stops after num_epochs (None =
    never)."""
    while True:
        order = list(range(len(rows)))
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        while position + per_step <= len(rows):
            picked = [rows[i] for i in order[position:position + per_step]]
            position += per_step
            yield picked, epoch, position
        epoch, position = epoch + 1, 0
        if num_epochs is not None and epoch >= num_epochs:
            return


def checked_rows(source: Any) -> list[dict]:
    """`load_rows` then `validate_rows`: the rows of `source`, or a ValueError that names the first bad
    one."""
    rows = load_rows(source)
    validate_rows(rows)
    return rows


def dataset_identity(rows: Sequence[Mapping[str, Any]]) -> dict:
    """Size and content hash of the training rows, saved with checkpoints to catch a resume on other data."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return {"dataset_size": len(rows), "dataset_fingerprint": digest.hexdigest()[:16]}


def training_rows(source: Any) -> tuple[list[dict], dict]:
    """The checked training rows, each with its index as ``_row`` (named in reward errors, never passed to the
    rewards), and their identity (computed before ``_row`` is added)."""
    rows = checked_rows(source)
    identity = dataset_identity(rows)
    for index, row in enumerate(rows):
        row["_row"] = index
    return rows, identity
