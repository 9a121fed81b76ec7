"""Whether a local model or adapter folder can be loaded as it is: what its hashes cannot tell.

`check_saved_model` (run/integrity.py) holds a folder Forge saved to its sha256 manifest; a plain transformers
folder has none, and a manifest can be rewritten together with the damage. `check_model_files` reads what the
loaders will read, before they do, and refuses with one line naming the folder and the file (ValueError, exit
code 2 on the command line):

    config.json, adapter_config.json, tokenizer files, the shard index
                                     a regular file each (not a link loop, a link to nothing, a folder or a
                                     device), at most MAX_JSON_BYTES; the JSON ones a JSON object within the
                                     nesting limit of forge/safe_json.py; the index's weight_map an object of
                                     tensor name -> shard file
    every safetensors weight file    a safetensors file (not a pickle, a zip of torch.save, or a link to
                                     anything else), whole, each tensor's bytes matching its shape and dtype
                                     in the header, every float finite (`nonfinite_tensors`, as resuming does)

What only loading can tell (a config.json or adapter_config.json that does not describe the weights) is
refused by the loaders themselves (forge/model/loading.py `load_model`, forge/model/export.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from safetensors.torch import load_file

from forge.run.integrity import (
    ADAPTER_WEIGHTS_NAME,
    FULL_WEIGHTS_INDEX_NAME,
    FULL_WEIGHTS_NAME,
    index_problem,
    link_loops,
    nonfinite_tensors,
    read_header,
    safetensors_problem,
)
from forge.safe_json import MAX_JSON_BYTES, JSONFileError, read_json

# The JSON files transformers and peft read from a model or adapter folder (the others are not read by a
# load).
LOADED_JSON = (
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    FULL_WEIGHTS_INDEX_NAME,
)
# The other files of a folder a load reads whole (the tokenizer's); at most MAX_JSON_BYTES each, as JSON.
LOADED_TEXT = ("chat_template.jinja", "chat_template.json", "tokenizer.model", "spiece.model", "vocab.json",
               "vocab.txt", "merges.txt")
# Bytes per element of each safetensors dtype.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class DamagedModelFolder(ValueError):
    """A model or adapter folder holds a file that cannot be loaded as it is; the message names both."""


def check_model_files(path: str | os.PathLike, given_as: str) -> None:
    """Raise DamagedModelFolder unless every file a load reads from the local folder `path` is whole and
    finite; a hub id or a file (.gguf) is left to its loader. `given_as` is the flag it
    came with (--model)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return
    for name in (*LOADED_JSON, *LOADED_TEXT):
        if not os.path.lexists(path / name):
            continue
        problem = _read(entry_problem, path / name) or (
            _read(_json_problem, path / name) if name in LOADED_JSON else _read(_size_problem, path / name))
        if problem:
            raise DamagedModelFolder(f"{given_as} {path}: {name}{_link_note(path / name)} {problem}. "
                                     f"{_restore(path)}")
    for name in _weight_files(path, given_as):
        problem = _read(weights_problem, path / name)
        if problem:
            raise DamagedModelFolder(f"{given_as} {path}: {name}{_link_note(path / name)} {problem}. "
                                     f"{_restore(path)}")


def _read(check, file: Path) -> str | None:
    try:
        return check(file)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"


def entry_problem(file: Path) -> str | None:
    """Why `file`, present in a folder, is not a regular file a load can read (a link loop, a link to nothing,
    a folder, a device or pipe), or None."""
    if link_loops(file):
        return "is a symlink loop (a link that leads back to itself, never to a file)"
    if not file.exists():
        return "is a link that leads to nothing"
    if file.is_dir():
        return "is a folder, not a file"
    if not file.is_file():
        return "is not a regular file (a device, a pipe or a socket)"
    return None


def _size_problem(file: Path) -> str | None:
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        return f"is {size:,} bytes, more than the {MAX_JSON_BYTES:,} a load of a tokenizer file may read"
    return None


def _restore(path: Path) -> str:
    return (f"The folder is damaged: load another, or restore {path} from where it came from "
            "(or re-run its save)")


def _json_problem(file: Path) -> str | None:
    try:
        read_json(file)
    except JSONFileError as error:
        return error.problem
    return None


def _weight_files(path: Path, given_as: str) -> list[str]:
    """The safetensors files a load of `path` reads: the adapter's, the single file, the shards of the index
    (its weight_map checked as transformers reads it)."""
    names = [name for name in (ADAPTER_WEIGHTS_NAME, FULL_WEIGHTS_NAME) if os.path.lexists(path / name)]
    if (path / FULL_WEIGHTS_INDEX_NAME).is_file():  # parsed above
        index = read_json(path / FULL_WEIGHTS_INDEX_NAME)
        problem = index_problem(index)
        if problem is not None:
            raise DamagedModelFolder(f"{given_as} {path}: {FULL_WEIGHTS_INDEX_NAME} {problem}. "
                                     f"{_restore(path)}")
        names += sorted(set(index["weight_map"].values()) - set(names))
    return names


def _link_note(file: Path) -> str:
    return f" (a link to {os.path.realpath(file)})" if file.is_symlink() and not link_loops(file) else ""


def weights_problem(file: Path) -> str | None:
    """Why the safetensors file `file` cannot be loaded as weights (not safetensors, truncated, a header that
    lies about a tensor, NaN/inf), or None."""
    if link_loops(file):
        return "is a symlink loop (a link that leads back to itself, never to a file)"
    if not file.exists():
        return "is missing"
    if not file.is_file():
        return "is not a file"
    problem = safetensors_problem(file)
    if problem is not None:
        with file.open("rb") as f:
            head = f.read(4)
        if (head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5) or head == b"PK\x03\x04":
            return (
                "is not a safetensors file: it is in a pickle format (torch.save's), which Forge never loads "
                "(unpickling runs whatever code the file names)"
            )
        if "its header alone needs" in problem:  # its first 8 bytes ask for more than the file holds
            return ("is not a safetensors file, or is truncated: "
                    f"{problem.removeprefix('is truncated (')[:-1]}")
        return problem
    problem = _tensor_extent_problem(file)
    if problem is not None:
        return problem
    try:
        bad = nonfinite_tensors(load_file(file, device="cpu"))
    except Exception as error:  # noqa: BLE001 - safetensors' own error type; reported with the file named
        return f"cannot be read ({type(error).__name__}: {error})"
    return f"holds NaN/inf in {len(bad)} tensors (e.g. {bad[:3]})" if bad else None


def _tensor_extent_problem(file: Path) -> str | None:
    """A tensor whose bytes in the file are not what its shape and dtype in the header make, or None."""
    for name, entry in read_header(file).items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(offset) for offset in entry["data_offsets"])
            needed = math.prod(int(n) for n in entry["shape"]) * DTYPE_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            return f"has a header entry for {name!r} that is not a tensor's ({entry!r})"
        if end - start != needed:
            return (
                f"has a header that lies about {name!r}: shape {entry['shape']} of {entry['dtype']} is "
                f"{needed} bytes, the file gives it {end - start}"
            )
    return None
