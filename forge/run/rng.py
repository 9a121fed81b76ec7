"""Every random generator a run draws from: seeded once at the start, captured with each finished step,
restored on resume, so a resumed run repeats the uninterrupted one bit for bit."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator a run draws from, in types `weights_only` loading accepts.

    python's state tuple becomes a list, numpy's MT19937 key array a tensor; `restore_rng_state`
    converts them back so the next draws are identical.
    """
    py_version, py_internal, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached_gauss = np.random.get_state()
    state = {
        "python": [py_version, list(py_internal), py_gauss],
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),  # uint32 values, held losslessly in int64
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put every generator back to the state `capture_rng_state` recorded."""
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_internal), py_gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:  # a different GPU count than at save time: restore the devices both runs have
            for device, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(cuda_state, device)
