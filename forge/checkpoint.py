"""Checkpoints that are atomic, complete and resumable.

A checkpoint directory holds everything needed to continue a run exactly where it stopped:

    {output_dir}/{step}/
        model.safetensors | adapter_model.safetensors   full weights, or only the LoRA adapter
        config.json, tokenizer files                      so the directory also loads with from_pretrained
        optimizer.pt, scheduler.pt                        state_dicts
        trainer_state.json                                global step, epoch, data position, ...
        rng_state.pt                                      python / numpy / torch (and CUDA) generators
        forge_config.json                                 the run's config, to refuse an incompatible resume
        COMPLETE                                          written last: its presence means the save finished

Everything is first written to a temporary sibling `{path}.tmp-<pid>` and renamed into place, so a
crash mid-save never leaves a directory that looks like a checkpoint. Non-weight state is saved so
that `torch.load(..., weights_only=True)` can read it back: no pickled code runs on load.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE_NAME = "trainer_state.json"
CONFIG_NAME = "forge_config.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
RNG_STATE_NAME = "rng_state.pt"
FULL_WEIGHTS_NAME = "model.safetensors"
FULL_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"

# Numbered checkpoints are `{output_dir}/{step}`; `checkpoint-{step}` is accepted when reading.
_STEP_DIR_PATTERN = re.compile(r"^(?:checkpoint-)?(\d+)$")

# Config keys that must match for a resumed run to continue the same training problem. The batching
# keys and seed/shuffle also fix which dataset rows the saved (epoch, position) points at.
COMPATIBILITY_KEYS = (
    "model_name",
    "group_size",
    "prompts_per_step",
    "gradient_accumulation_steps",
    "seed",
    "shuffle",
    "use_lora",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
)


@dataclass
class CheckpointState:
    """What `load_checkpoint` reads back; model weights are loaded separately by `load_model_weights`."""

    path: Path
    trainer_state: dict[str, Any]
    config: dict[str, Any]
    rng_state: dict[str, Any] | None
    optimizer_state: dict[str, Any] | None
    scheduler_state: dict[str, Any] | None


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint for optimizer step `step` lives."""
    return Path(output_dir) / str(step)


# ---------------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------------


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def _write_complete_marker(directory: Path) -> None:
    with (directory / COMPLETE_MARKER).open("w", encoding="utf-8") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable; a no-op where directories cannot be opened (Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _quiet_transformers_progress():
    """Hide transformers' "Writing model shards" bar so it does not interleave with the training bar."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    trainer_state: dict[str, Any],
    config: dict[str, Any],
    rng_state: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint to `path` atomically; an existing checkpoint there is replaced.

    `model` may be a full HuggingFace model or a peft `PeftModel` (which saves only its adapter).
    `rng_state` (from `capture_rng_state`) defaults to the generators' state now; pass an earlier
    capture when the checkpoint describes an earlier moment (a step that finished before a failure).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if tmp_path.exists():
        shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    try:
        with _quiet_transformers_progress():
            model.save_pretrained(tmp_path, safe_serialization=True)
        tokenizer.save_pretrained(tmp_path)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp_path / OPTIMIZER_NAME)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp_path / SCHEDULER_NAME)
        _write_json(tmp_path / TRAINER_STATE_NAME, trainer_state)
        torch.save(rng_state if rng_state is not None else capture_rng_state(), tmp_path / RNG_STATE_NAME)
        _write_json(tmp_path / CONFIG_NAME, config)
        _write_complete_marker(tmp_path)
    except BaseException:
        shutil.rmtree(tmp_path, ignore_errors=True)
        raise

    # Swap into place. Between the two renames `path` is briefly absent, never half-written.
    old_path = path.with_name(f"{path.name}.old-{os.getpid()}")
    if path.exists():
        if old_path.exists():
            shutil.rmtree(old_path)
        os.replace(path, old_path)
    os.replace(tmp_path, path)
    _fsync_directory(path.parent)
    shutil.rmtree(old_path, ignore_errors=True)
    return path


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def _load_optional(path: Path) -> Any | None:
    return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None


def load_checkpoint(path: str | os.PathLike) -> CheckpointState:
    """Read a checkpoint's trainer state, config, RNG, optimizer and scheduler states (not the weights)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise ValueError(
            f"checkpoint {path} is incomplete (interrupted save?); use an earlier one "
            f"(no {COMPLETE_MARKER} marker)"
        )
    return CheckpointState(
        path=path,
        trainer_state=json.loads((path / TRAINER_STATE_NAME).read_text(encoding="utf-8")),
        config=json.loads((path / CONFIG_NAME).read_text(encoding="utf-8")),
        rng_state=_load_optional(path / RNG_STATE_NAME),
        optimizer_state=_load_optional(path / OPTIMIZER_NAME),
        scheduler_state=_load_optional(path / SCHEDULER_NAME),
    )


def _load_full_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or every shard listed in model.safetensors.index.json."""
    if (path / FULL_WEIGHTS_NAME).is_file():
        return load_file(path / FULL_WEIGHTS_NAME, device="cpu")
    index = json.loads((path / FULL_WEIGHTS_INDEX_NAME).read_text(encoding="utf-8"))
    state_dict: dict[str, torch.Tensor] = {}
    for shard_name in sorted(set(index["weight_map"].values())):
        state_dict.update(load_file(path / shard_name, device="cpu"))
    return state_dict


def _raise_on_key_mismatch(path: Path, missing: list[str], unexpected: list[str]) -> None:
    if not missing and not unexpected:
        return
    details = []
    if missing:
        details.append(f"missing {len(missing)} keys (e.g. {missing[:3]})")
    if unexpected:
        details.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[:3]})")
    raise ValueError(
        f"weights in {path} do not fit the model: {'; '.join(details)}. "
        "Was the checkpoint saved from a different model or LoRA setup?"
    )


def _load_adapter_weights(model: Any, path: Path) -> None:
    if not _is_peft_model(model):
        raise ValueError(
            f"checkpoint {path} holds only a LoRA adapter, but the model is not a peft model; "
            "wrap it with the same LoRA config (use_lora=True) before loading"
        )
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    adapter_state = load_file(path / ADAPTER_WEIGHTS_NAME, device="cpu")
    expected = set(get_peft_model_state_dict(model))
    missing = sorted(expected - set(adapter_state))
    unexpected = sorted(set(adapter_state) - expected)
    _raise_on_key_mismatch(path, missing, unexpected)
    set_peft_model_state_dict(model, adapter_state)


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _load_full_weights(model: Any, path: Path) -> None:
    if _is_peft_model(model):
        raise ValueError(
            f"checkpoint {path} holds full model weights, but the model is a peft (LoRA) model; "
            "load it without LoRA (use_lora=False)"
        )
    state_dict = _load_full_state_dict(path)
    result = model.load_state_dict(state_dict, strict=False)
    # A tied weight (e.g. lm_head sharing embed_tokens) is saved once: it is not missing.
    model_tensors = model.state_dict(keep_vars=True)
    loaded_storage = {model_tensors[k].data_ptr() for k in state_dict if k in model_tensors}
    missing = [k for k in result.missing_keys if model_tensors[k].data_ptr() not in loaded_storage]
    _raise_on_key_mismatch(path, missing, list(result.unexpected_keys))


def load_model_weights(model: Any, path: str | os.PathLike) -> None:
    """Load a checkpoint's weights into `model` in place: the full weights or the LoRA adapter.

    Reads safetensors only. Raises when a key the model needs is absent or the file has extra keys.
    """
    path = Path(path)
    if (path / ADAPTER_WEIGHTS_NAME).is_file():
        _load_adapter_weights(model, path)
    elif (path / FULL_WEIGHTS_NAME).is_file() or (path / FULL_WEIGHTS_INDEX_NAME).is_file():
        _load_full_weights(model, path)
    else:
        raise FileNotFoundError(
            f"no {FULL_WEIGHTS_NAME} or {ADAPTER_WEIGHTS_NAME} in {path}; is it a Forge checkpoint?"
        )


# ---------------------------------------------------------------------------------------------------
# Finding and pruning checkpoints
# ---------------------------------------------------------------------------------------------------


def _complete_numbered_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete numbered checkpoint, oldest first. Skips final/, tmp and partial dirs."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = _STEP_DIR_PATTERN.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def numbered_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete numbered checkpoint in `output_dir`, oldest first."""
    return _complete_numbered_checkpoints(output_dir)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete numbered checkpoint with the highest step, or None."""
    checkpoints = _complete_numbered_checkpoints(output_dir)
    return checkpoints[-1][1] if checkpoints else None


def prune_checkpoints(output_dir: str | os.PathLike, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` complete numbered checkpoints (None keeps all); returns the deleted."""
    if keep is None:
        return []
    if keep < 0:
        raise ValueError(f"keep={keep}: must be >= 0 or None")
    checkpoints = _complete_numbered_checkpoints(output_dir)
    doomed = [path for _, path in checkpoints[: max(len(checkpoints) - keep, 0)]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


# ---------------------------------------------------------------------------------------------------
# Resume compatibility
# ---------------------------------------------------------------------------------------------------

_MISSING = "<not set>"


def _comparable(value: Any) -> Any:
    """Compare as JSON sees it, so a tuple in memory equals the list read back from forge_config.json."""
    return json.loads(json.dumps(value, default=str))


def check_compatible(
    saved_config: dict[str, Any],
    current_config: dict[str, Any],
    keys: tuple[str, ...] = COMPATIBILITY_KEYS,
    checkpoint_path: str | os.PathLike | None = None,
) -> None:
    """Refuse to resume when a setting that defines the training problem changed since the save.

    A key absent from both configs is skipped; absent from one side counts as a change.
    """
    mismatches = []
    for key in keys:
        if key not in saved_config and key not in current_config:
            continue
        saved = saved_config.get(key, _MISSING)
        current = current_config.get(key, _MISSING)
        if _comparable(saved) != _comparable(current):
            mismatches.append(f"  {key}: saved {saved!r}, current {current!r}")
    if mismatches:
        where = f"checkpoint {checkpoint_path}" if checkpoint_path is not None else "the checkpoint"
        raise ValueError(
            f"cannot resume from {where}: its config differs from this run's:\n"
            + "\n".join(mismatches)
            + "\nSet these back to the saved values to resume, or start a fresh run "
            "(a new output_dir, or resume_from=None)."
        )
