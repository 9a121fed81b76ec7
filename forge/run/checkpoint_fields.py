"""What a checkpoint's files say, checked against what the resuming run expects, before any of it is used.

COMPLETE's sha256s (forge/run/integrity.py) prove that the files are those written when the save finished: no
truncation, no bit rot, no half-written save. They do not prove who wrote them: whoever hands a checkpoint
over can change a file and rehash. Nothing in a checkpoint can run code (safetensors and JSON only); what a
changed field can do is change the run, so each one resuming uses is checked here, and a field that does not
fit is refused with one line naming the checkpoint and the file (a CheckpointError: exit code 1
on the command line):

    check_trainer_state      trainer_state.json: an object; global_step the folder's step; counters in range
    check_tensors            weights: each tensor the model's shape and dtype (never cast on the way in)
    check_optimizer_state    optimizer.safetensors: the run's parameter groups; AdamW moments of each
                             parameter's shape and dtype
    check_hyperparameters    after loading: lr and weight decay finite numbers (this run's then apply); every
                             other setting (betas, eps, maximize, amsgrad, ...) the run's own AdamW's
    check_scheduler_state    scheduler.safetensors: step counters and learning rates are numbers
    check_compatible         forge_config.json: the settings that define the training problem
                             (COMPATIBILITY_KEYS) are this run's
    loading(path, name)      anything else a load raises, as one line naming the file

Where the weights come from (inside the checkpoint folder, no absolute, `..` or linked-out path) is checked
with the hashes, in integrity.verify_checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from forge.run.checkpoint_names import step_of
from forge.run.integrity import (
    CONFIG_NAME,
    OPTIMIZER_NAME,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    CheckpointError,
    offer_previous,
)

MAX_COUNT = 10**12  # no step, epoch or row counter of a real run comes near it
_APPLIED_FROM_THE_RUN = ("lr", "initial_lr", "weight_decay")  # resuming applies this run's (optim.py)


def refused(path: Path, name: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} cannot be resumed: {name} {problem}; a checkpoint this run's setup "
        f"saved never holds that (changed after the save, or saved by another setup). "
        f"{offer_previous(path)}"
    )


@contextmanager
def loading(path: Path, name: str) -> Iterator[None]:
    """Whatever loading `name` into the run raises (a torch or Python error on a value that does not fit) as
    one line naming the checkpoint and the file."""
    try:
        yield
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError) as error:
        detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        raise refused(path, name, f"does not fit this run ({type(error).__name__}: {detail})") from None


def _is_count(value: Any, low: int = 0, high: int = MAX_COUNT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any, low: float = 0.0) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value >= low)


def check_trainer_state(path: Path, state: Any, dataset_size: int | None = None) -> dict:
    """trainer_state.json as resuming uses it; refused when it is not an object or a value is out of range."""
    if not isinstance(state, dict):
        raise refused(path, TRAINER_STATE_NAME, f"is a JSON {type(state).__name__}, not an object")
    step = state.get("global_step")
    folder_step = step_of(path.name)
    bounds = {
        "global_step": (_is_count(step), "a whole number from 0 to 10**12"),
        "epoch": (_is_count(state.get("epoch")), "a whole number from 0 to 10**12"),
        "position": (
            _is_count(state.get("position"), 0, dataset_size if dataset_size is not None else MAX_COUNT),
            f"a whole number from 0 to the dataset's {dataset_size} rows",
        ),
        "nonfinite_in_a_row": (
            _is_count(state.get("nonfinite_in_a_row", 0), 0, step if _is_count(step) else 0),
            "a whole number from 0 to global_step",
        ),
        "skipped_steps": (
            _is_count(state.get("skipped_steps", 0), 0, step if _is_count(step) else 0),
            "a whole number from 0 to global_step",
        ),
        "loss_scale": (
            _is_number(state.get("loss_scale", 1.0)) and state.get("loss_scale", 1.0) > 0,
            "a finite number > 0",
        ),
        "entropy_control": (
            isinstance(state.get("entropy_control"), (dict, type(None))),
            "an object or null",
        ),
        "micro_batch_size": (
            state.get("micro_batch_size") is None or _is_count(state.get("micro_batch_size"), 1),
            "a whole number >= 1 or null",
        ),
        "num_input_tokens_seen": (
            _is_count(state.get("num_input_tokens_seen", 0), 0),
            "a whole number from 0 to 10**12",
        ),
        "log_history": (
            isinstance(state.get("log_history", []), list)
            and all(isinstance(row, dict) for row in state.get("log_history", [])),
            "a list of objects",
        ),
    }
    for field, (fits, should_be) in bounds.items():
        if not fits:
            raise refused(path, TRAINER_STATE_NAME,
                          f"has {field}={state.get(field)!r:.60}; it must be {should_be}")
    if folder_step is not None and folder_step != step:
        raise refused(path, TRAINER_STATE_NAME, f"has global_step={step}, but the checkpoint is of step "
                                                f"{folder_step} (its folder's name)")
    return state


def check_tensors(path: Path, name: str, saved: dict[str, torch.Tensor],
                  expected: dict[str, torch.Tensor]) -> None:
    """Each tensor of the file `name` that the model has: of the model's shape and dtype (names are checked by
    the load: missing or unexpected keys)."""
    for key, tensor in saved.items():
        want = expected.get(key)
        if want is None:
            continue
        if tuple(tensor.shape) != tuple(want.shape) or tensor.dtype != want.dtype:
            raise refused(
                path,
                name,
                f"holds {key} as {_described(tensor)} where the model's is {_described(want)} "
                f"(a tensor of another shape or dtype is never cast on the way in)",
            )


def _described(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} of shape {list(tensor.shape)}"


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The run's own optimizer settings, per parameter group (what check_hyperparameters compares against)."""
    return [{key: value for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups]


def check_optimizer_state(path: Path, saved: Any, optimizer: torch.optim.Optimizer) -> None:
    """optimizer.safetensors before it is loaded: the run's groups and parameters, and each parameter's
    moments of its shape and dtype (torch would cast them silently)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict) or not all(
            isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups):
        raise refused(path, OPTIMIZER_NAME, "is not an optimizer state (param_groups and state)")
    counts = [len(group["params"]) for group in groups]
    if counts != [len(group["params"]) for group in optimizer.param_groups]:
        raise refused(
            path,
            OPTIMIZER_NAME,
            f"has parameter groups of {counts} parameters where this run's have "
            f"{[len(group['params']) for group in optimizer.param_groups]}",
        )
    parameters = {saved_id: parameter for group, own in zip(groups, optimizer.param_groups)
                  for saved_id, parameter in zip(group["params"], own["params"])}
    for saved_id, moments in saved["state"].items():
        parameter = parameters.get(saved_id)
        if parameter is None or not isinstance(moments, dict):
            raise refused(
                path,
                OPTIMIZER_NAME,
                f"has a state for parameter {saved_id!r:.40}, which its groups do not list",
            )
        for key, value in moments.items():
            if key == "step":
                fits = (_is_number(value) or isinstance(value, torch.Tensor) and value.numel() == 1
                        and bool(torch.isfinite(value).all()) and float(value) >= 0)
                if not fits:
                    raise refused(
                        path,
                        OPTIMIZER_NAME,
                        f"has state/{saved_id}/step={value!r:.60}; it must be a finite count >= 0",
                    )
            elif not isinstance(value, torch.Tensor) or value.shape != parameter.shape or (
                    value.dtype != parameter.dtype):
                got = _described(value) if isinstance(value, torch.Tensor) else f"{value!r:.60}"
                raise refused(
                    path,
                    OPTIMIZER_NAME,
                    f"has state/{saved_id}/{key} as {got} where its parameter is {_described(parameter)}",
                )


def check_hyperparameters(path: Path, name: str, optimizer: torch.optim.Optimizer,
                          expected: list[dict]) -> None:
    """After loading `name` into `optimizer` (whose settings were `expected` before): lr, initial_lr and
    weight_decay are finite numbers >= 0 (this run's values then apply, and are announced); every other
    setting is the run's own AdamW's, or the resume is refused (AdamW maximize=True would be
    gradient ascent)."""
    for index, (group, own) in enumerate(zip(optimizer.param_groups, expected)):
        for key in sorted(set(group) - {"params"} | set(own)):
            value, want = group.get(key, "<absent>"), own.get(key, "<absent>")
            where = f"param_groups/{index}/{key}"
            if key in _APPLIED_FROM_THE_RUN:
                if not _is_number(value):
                    raise refused(path, name, f"has {where}={value!r:.60}; it must be a finite number >= 0")
            elif not _same(value, want):
                why = " (a resumed run would do gradient ascent)" if key == "maximize" else ""
                raise refused(path, name,
                              f"has {where}={value!r:.60} where this run's AdamW has {want!r}{why}")


def _same(value: Any, want: Any) -> bool:
    if isinstance(want, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(value) == len(want) and all(map(_same, value, want))
    if isinstance(want, bool) or want is None or isinstance(want, str):
        return type(value) is type(want) and value == want
    if isinstance(want, (int, float)):
        return _is_number(value, -math.inf) and float(value) == float(want)
    return value == want


def check_scheduler_state(path: Path, state: Any) -> None:
    """scheduler.safetensors before it is loaded: its step counters are counts, its learning rates numbers."""
    if not isinstance(state, dict):
        raise refused(path, SCHEDULER_NAME, f"is a {type(state).__name__}, not a scheduler's state")
    for key in ("last_epoch", "_step_count"):
        if key in state and not _is_count(state[key]):
            raise refused(
                path,
                SCHEDULER_NAME,
                f"has {key}={state[key]!r:.60}; it must be a whole number from 0 to 10**12",
            )
    for key in ("base_lrs", "_last_lr"):
        if key in state and not (isinstance(state[key], list) and all(_is_number(lr) for lr in state[key])):
            raise refused(path, SCHEDULER_NAME, f"has {key}={state[key]!r:.60}; it must be a list of finite "
                                                f"numbers >= 0")


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
    """Refuse, in one line, to resume when a setting that defines the training problem changed since the save.

    A key absent from both configs is skipped. A key this run has that the saved config lacks means the file
    was changed after the save (a Forge save writes every setting): with `checkpoint_path`, a CheckpointError
    naming it and an older checkpoint, as for any damaged file.
    """
    lacking = [key for key in keys if key in current_config and key not in saved_config]
    if lacking and checkpoint_path is not None:
        path = Path(checkpoint_path)
        raise CheckpointError(f"checkpoint {path} is damaged: {CONFIG_NAME} holds no {', '.join(lacking)}, "
                              f"which every Forge save writes. {offer_previous(path)}")
    mismatches = []
    for key in keys:
        if key not in saved_config and key not in current_config:
            continue
        saved = saved_config.get(key, _MISSING)
        current = current_config.get(key, _MISSING)
        if _comparable(saved) != _comparable(current):
            mismatches.append(f"{key} (saved {_short(saved)}, current {_short(current)})")
    if mismatches:
        where = f"checkpoint {checkpoint_path}" if checkpoint_path is not None else "the checkpoint"
        raise ValueError(
            f"cannot resume from {where}: its config differs from this run's in {', '.join(mismatches)}; set "
            f"these back to the saved values to resume, or start a fresh run (a new output_dir, or "
            f"resume_from=None)."
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["COMPATIBILITY_KEYS", "check_compatible", "check_hyperparameters", "check_optimizer_state",
           "check_scheduler_state", "check_tensors", "check_trainer_state", "hyperparameters", "loading",
           "refused"]
