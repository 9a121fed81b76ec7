"""A state dict (optimizer, learning-rate schedule, RNG) written and read without pickle.

`torch.save` pickles, and unpickling a file runs whatever code it names. A checkpoint's state files are
safetensors instead: the tensors as tensors, and everything else (numbers, strings, lists, tuples, dicts with
any plain keys) as JSON in the file's header. Reading one parses JSON (within forge/safe_json.py's limits) and
copies tensor bytes; no code in the file can run.

    encode(state)                 -> (tensors {key: tensor}, layout: JSON-able)   the split
    decode(layout, tensors)       -> state                                          the join, strict
    save_state(path, state)       one safetensors file: tensors + layout in its header
    load_state(path)              its state back, equal to what was saved (tuples stay tuples, int keys ints)

The layout is JSON in which a tensor is {"tensor": key}, a tuple {"tuple": [...]}, a dict {"dict": [[key,
value], ...]}; a list is a list, a number, string, bool or None itself. Nothing else is accepted on save or
load, so a value that JSON would quietly change (a numpy scalar, a set) is refused with its place named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from forge.safe_json import JSONFileError, parse_json

STATE_FORMAT = "forge-state-v1"
_LAYOUT_KEY = "forge_state"
_PLAIN = (bool, int, float, str, type(None))


def encode(state: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Split `state` into its tensors, each under the path to it ('state/0/exp_avg'), and the JSON layout."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if path in tensors:
                raise ValueError(f"two tensors of the state are both at {path!r}; their keys must differ")
            tensors[path] = value
            return {"tensor": path}
        if isinstance(value, dict):
            pairs = []
            for key, item in value.items():
                if not isinstance(key, _PLAIN):
                    raise TypeError(f"state key {key!r} at {path or '/'} is a {type(key).__name__}; "
                                    f"only str, int, float, bool or None keys can be saved")
                pairs.append([key, walk(item, f"{path}/{key}" if path else str(key))])
            return {"dict": pairs}
        if isinstance(value, (list, tuple)):
            items = [walk(item, f"{path}/{i}" if path else str(i)) for i, item in enumerate(value)]
            return {"tuple": items} if isinstance(value, tuple) else items
        if isinstance(value, _PLAIN):
            return value
        raise TypeError(f"state value at {path or '/'} is a {type(value).__name__}; a checkpoint holds only "
                        f"tensors, numbers, strings, None and lists, tuples and dicts of them")

    return tensors, walk(state, prefix)


def decode(layout: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state `encode` split into (tensors, layout); a ValueError for anything `encode` never writes."""
    if isinstance(layout, list):
        return [decode(item, tensors) for item in layout]
    if isinstance(layout, _PLAIN):
        return layout
    if isinstance(layout, dict) and len(layout) == 1:
        (tag, value), = layout.items()
        if tag == "tensor" and isinstance(value, str):
            if value not in tensors:
                raise ValueError(f"the layout names a tensor {value!r} that is not in the file")
            return tensors[value]
        if tag == "tuple" and isinstance(value, list):
            return tuple(decode(item, tensors) for item in value)
        if tag == "dict" and isinstance(value, list) and all(
                isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], _PLAIN) for pair in value):
            return {key: decode(item, tensors) for key, item in value}
    raise ValueError(f"unexpected entry in the state layout: {json.dumps(layout)[:80]}")


def save_state(path: str | Path, state: Any) -> None:
    """Write `state` to one safetensors file: its tensors (contiguous CPU copies) and its layout as JSON."""
    tensors, layout = encode(state)
    tensors = {key: tensor.detach().to("cpu").contiguous() for key, tensor in tensors.items()}
    # safetensors refuses tensors that share memory; state tensors never should, but a view would: copy those
    seen: set[int] = set()
    for key, tensor in tensors.items():
        if tensor.numel() and tensor.untyped_storage().data_ptr() in seen:
            tensors[key] = tensor.clone()
        seen.add(tensors[key].untyped_storage().data_ptr())
    save_file(tensors, str(path), metadata={"format": "pt", "forge_format": STATE_FORMAT,
                                            _LAYOUT_KEY: json.dumps(layout)})


def load_state(path: str | Path) -> Any:
    """The state `save_state` wrote; a ValueError when the file is not one (no pickle is ever involved)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = f.metadata() or {}
        if metadata.get("forge_format") != STATE_FORMAT or _LAYOUT_KEY not in metadata:
            raise ValueError(f"not a Forge state file (its header has no {STATE_FORMAT} layout)")
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open has no iteration
    try:
        # any JSON value: `decode` checks it
        layout = parse_json(metadata[_LAYOUT_KEY], str(path), expect=object)
    except JSONFileError as error:
        raise ValueError(f"its {_LAYOUT_KEY} layout {error.problem}") from None
    return decode(layout, tensors)


__all__ = ["STATE_FORMAT", "decode", "encode", "load_state", "save_state"]
