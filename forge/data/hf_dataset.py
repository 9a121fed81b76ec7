"""Any Hugging Face dataset as Forge rows: ``hf:ORG/NAME[:CONFIG][@SPLIT]`` plus the two column names.

``forge train --dataset hf:openai/gsm8k:main@train --prompt_column question --reference_column answer``
loads the split with ``datasets.load_dataset(ORG/NAME, CONFIG, split=SPLIT)`` (the hub, or the HF cache
when offline), takes the question from ``prompt_column`` and the reference answer from
``reference_column``. A local folder works in place of ``ORG/NAME``: one written by
``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` is read with ``datasets.load_from_disk``, any
other folder (parquet, JSON, CSV files) or a data file with ``datasets.load_dataset``.

Prompts: with ``chat=True`` each question becomes chat messages, `SYSTEM_PROMPT` (asking for an
``<answer>`` tag, the format the default rewards and the strict grader read) and the question as the
user message; with ``chat=False`` the column's text is the prompt as it is. A prompt column that already
holds chat messages is used unchanged either way. A reference in GSM8K's ``... #### 72`` form becomes its
final answer ``72``.

Rows whose prompt is empty or whose reference is missing are skipped; when none is left the error says
how many rows were dropped for which reason. A column that does not exist is an error naming the columns
that do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["HF_PREFIX", "SYSTEM_PROMPT", "load_hf_rows", "parse_hf_spec", "rows_from_records"]

HF_PREFIX = "hf:"

SYSTEM_PROMPT = (
    "Solve the problem. Think step by step inside <think> </think>, "
    "then give only the final answer inside <answer> </answer>."
)
"""The system message of chat prompts built from a dataset's question column."""


def parse_hf_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``"hf:ORG/NAME[:CONFIG][@SPLIT]"`` -> ``(ORG/NAME, CONFIG or None, SPLIT or None)``.

    ``"hf:openai/gsm8k:main@test"`` -> ``("openai/gsm8k", "main", "test")``; ``"hf:/data/my_set@train"``
    -> ``("/data/my_set", None, "train")``.
    """
    if not spec.startswith(HF_PREFIX):
        raise ValueError("a Hugging Face dataset name looks like "
                         f"'hf:ORG/NAME[:CONFIG][@SPLIT]', got '{spec}'")
    rest = spec[len(HF_PREFIX):]
    rest, _, split = rest.rpartition("@") if "@" in rest else (rest, "", "")
    path, _, config = rest.partition(":")
    if not path:
        raise ValueError(f"'{spec}' names no dataset; e.g. 'hf:openai/gsm8k:main@train'")
    return path, config or None, split or None


def _import_datasets():
    try:
        import datasets
    except ImportError as error:
        raise ImportError("hf: datasets need the 'datasets' package: pip install forge-rl[data]") from error
    return datasets


def _load_split(path: str, config: str | None, split: str):
    datasets = _import_datasets()
    local = Path(path).expanduser()
    if local.is_dir() and ((local / "dataset_info.json").is_file() or (local / "dataset_dict.json").is_file()
                           or (local / "state.json").is_file()):
        loaded = datasets.load_from_disk(str(local))  # written by save_to_disk
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{path} has splits {sorted(loaded)}, not '{split}'; add @SPLIT to the name")
            return loaded[split]
        return loaded
    if local.is_file():  # one data file: its extension names the builder (parquet, json, csv)
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(local.suffix)
        if builder is None:
            raise ValueError(f"{path}: a local data file must be .parquet, .json, .jsonl or .csv")
        return datasets.load_dataset(builder, data_files=str(local), split=split)
    try:
        return datasets.load_dataset(str(local) if local.is_dir() else path, config, split=split)
    except ValueError as error:
        if "split" in str(error).lower() and "unknown split" in str(error).lower():
            raise ValueError(f"{path}: {error}; add @SPLIT to the name") from error
        raise


def _not_loaded(spec: str, path: str, error: OSError) -> str:
    """The message for a dataset `datasets` could not find or fetch: the missing folder, or
    the hub's reason."""
    if path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():
        return (f"{spec}: no such folder or file {path}; pass an existing folder or data file, or a hub name "
                f"(hf:ORG/NAME[:CONFIG][@SPLIT])")
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    return (
        f"{spec}: cannot load {path} ({reason}); check the name (hf:ORG/NAME[:CONFIG][@SPLIT]); without a "
        f"network only datasets already in the Hugging Face cache load"
    )


def _final_answer(reference: Any) -> Any:
    if isinstance(reference, str) and "####" in reference:
        return reference.rsplit("####", 1)[1].strip().replace(",", "")
    return reference


def _is_messages(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value))


def rows_from_records(records: Sequence[Mapping[str, Any]] | Any, prompt_column: str, reference_column: str,
                      *, chat: bool = False, system_prompt: str | None = None, max_samples: int | None = None,
                      name: str = "dataset") -> list[dict]:
    """Forge rows ``{"prompt", "reference", "question"}`` from records (a ``datasets.Dataset`` or any
    sequence of mappings). ``system_prompt`` replaces `SYSTEM_PROMPT` in chat prompts (``""``: none)."""
    columns = list(getattr(records, "column_names", None) or (list(records[0]) if len(records) else []))
    missing = [column for column in (prompt_column, reference_column) if column not in columns]
    if missing and len(records):
        raise ValueError(
            f"{name} has no column {', '.join(repr(c) for c in missing)}; its columns are "
            f"{columns}. Pass --prompt_column / --reference_column (prompt_column=, reference_column=)"
        )
    system = SYSTEM_PROMPT if system_prompt is None else system_prompt
    rows: list[dict] = []
    empty_prompt = no_reference = 0
    for record in records:
        if max_samples is not None and len(rows) >= max_samples:
            break
        text, reference = record[prompt_column], _final_answer(record[reference_column])
        if reference is None or not str(reference).strip():
            no_reference += 1
            continue
        if _is_messages(text):
            prompt: Any = [dict(message) for message in text]
            question = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"),
                            prompt[-1]["content"])
        elif isinstance(text, str) and text.strip():
            question = text
            prompt = (
                ([{"role": "system", "content": system}] if system else [])
                + [{"role": "user", "content": text}]
                if chat
                else text
            )
        else:
            empty_prompt += 1
            continue
        rows.append({"prompt": prompt, "reference": str(reference).strip(), "question": str(question)})
    if not rows:
        total = len(records)
        why = (
            "it has no rows"
            if total == 0
            else f"of its {total} rows, {empty_prompt} have an empty or non-text '{prompt_column}' and "
            f"{no_reference} have no '{reference_column}'"
        )
        raise ValueError(f"{name} gives zero usable rows: {why}")
    return rows


def load_hf_rows(spec: str, *, prompt_column: str | None = None, reference_column: str | None = None,
                 split: str | None = None, chat: bool = False, system_prompt: str | None = None,
                 n: int | None = None, max_samples: int | None = None) -> list[dict]:
    """Rows of a Hugging Face dataset named ``hf:ORG/NAME[:CONFIG][@SPLIT]`` (or a local folder / file in
    place of ORG/NAME). The split comes from the name, else ``split``, else ``train``. ``prompt_column``
    defaults to ``question`` and ``reference_column`` to ``answer``. ``n`` / ``max_samples`` keep the
    first rows."""
    path, config, named_split = parse_hf_spec(spec)
    split = named_split or split or "train"
    local = Path(path).expanduser()
    scripts = sorted(p.name for p in local.glob("*.py")) if local.is_dir() else []
    if scripts:
        raise ValueError(
            f"{spec}: the folder holds a loading script ({', '.join(scripts[:3])}); Forge loads data "
            f"files only (parquet, JSON, JSONL, CSV, or a save_to_disk folder) and never runs a "
            f"dataset's code: write the rows to one of those where you trust the script, and pass that"
        )
    try:
        records = _load_split(path, config, split)
    except OSError as error:  # no such folder, not on the hub (datasets' DatasetNotFoundError), no network
        raise ValueError(_not_loaded(spec, path, error)) from None
    except RuntimeError as error:  # a hub dataset that is a loading script: `datasets` refuses to run it
        if "script" not in str(error).lower():
            raise
        raise ValueError(
            f"{spec}: {str(error).splitlines()[0]}; Forge loads data files only (parquet, JSON, "
            f"JSONL, CSV) and never runs a dataset's code: pick a release of it in data files"
        ) from None
    limit = n if n is not None else max_samples
    return rows_from_records(records, prompt_column or "question", reference_column or "answer", chat=chat,
                             system_prompt=system_prompt, max_samples=limit, name=f"{spec} (split {split})")
