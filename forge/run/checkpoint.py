"""Checkpoints that are atomic, complete and resumable.

A checkpoint directory holds everything needed to continue a run exactly where it stopped (its name,
`checkpoint-{step}` as transformers names it: forge/run/checkpoint_names.py):

    {output_dir}/checkpoint-{step}/
        model.safetensors | adapter_model.safetensors   full weights, or only the LoRA adapter
        config.json, tokenizer files                      so the directory also loads with from_pretrained
        optimizer.safetensors, scheduler.safetensors      state_dicts (forge/run/state_files.py: no pickle)
        trainer_state.json                                global step, epoch, data position, ...
        rng_state.safetensors                             python / numpy / torch (and CUDA) generators
        forge_config.json                                 the run's config, to refuse an incompatible resume
        COMPLETE                                          written last: the sha256 of every other file

`{output_dir}/final/` is the trained model, not a point to resume from: the weights (or adapter), config.json,
the tokenizer, trainer_state.json, forge_config.json and COMPLETE, without the optimizer, scheduler and RNG
state (`training_state=False`); a run resumes from its numbered checkpoints.

An FSDP2 run (fsdp=True) saves `sharded/` instead of the weight files and the optimizer state: every rank's
shards of both as safetensors, written and read by torch.distributed.checkpoint's Hugging Face storage
(`save_sharded_checkpoint`, called on every rank), and `sharded/layout.json`, the rest of the state (AdamW's
settings) as JSON; its final/ holds the whole gathered weights instead, so final/ loads with from_pretrained.

Everything is first written to a temporary sibling `{path}.tmp-<pid>` and renamed into place, so a crash
mid-save never leaves a directory that looks like a checkpoint, and a save that fails (a full disk) leaves the
checkpoints already there as they were. Loading a checkpoint never unpickles: every file is safetensors or
JSON (a checkpoint of an older Forge that holds pickled state is refused, `integrity.refuse_pickled`).

What a checkpoint guarantees, and where it is checked (the manifest and verification: forge/run/integrity.py):
- `save_checkpoint` refuses weights that hold NaN/inf, so a checkpoint never stores non-finite weights.
- `load_checkpoint` re-hashes every file against `COMPLETE` and raises a `CheckpointError` that names the
  file, the checkpoint and the newest older checkpoint that still verifies. A checkpoint from before
  checksums (`COMPLETE` holds just "ok") still loads, with a warning; its weight files are then checked
  for a truncated safetensors layout and for NaN/inf instead.
- `remove_stale_temporaries` deletes the `.tmp-<pid>` leftovers of saves whose process is gone.
- A save that cannot write (a full disk, a read-only folder) raises a CheckpointError in one line that names
  the folder and what to do; nothing of the checkpoints already saved is touched.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from forge.parallel import sharding
from forge.run import state_files
from forge.run.checkpoint_fields import check_tensors
from forge.run.integrity import (
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    FULL_WEIGHTS_INDEX_NAME,
    FULL_WEIGHTS_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SCHEDULER_NAME,
    SHARDED_DIR,
    SHARDED_LAYOUT,
    TRAINER_STATE_NAME,
    CheckpointError,
    Damaged,
    has_forge_manifest,
    latest_checkpoint,
    nonfinite_tensors,
    offer_previous,
    safetensors_problem,
    verify_checkpoint,
    weight_files,
    write_manifest,
)
from forge.run.optim import all_finite
from forge.run.rng import capture_rng_state
from forge.safe_json import JSONFileError, read_json


@dataclass
class CheckpointState:
    """What `load_checkpoint` reads back; model weights are loaded separately by `load_model_weights`."""

    path: Path
    trainer_state: dict[str, Any]
    config: dict[str, Any]
    rng_state: dict[str, Any] | None
    optimizer_state: dict[str, Any] | None
    scheduler_state: dict[str, Any] | None
    verified: bool = True  # False for a checkpoint from before checksums (loaded with a warning)

    @property
    def step(self) -> int:
        """The optimizer step the checkpoint was taken after."""
        return int(self.trainer_state.get("global_step", 0))

    def describe(self) -> str:
        """'step 3 from out/checkpoint-3 (sha256 verified)': what a resumed run says it loaded."""
        how = "sha256 verified" if self.verified else "no checksums: saved by an older Forge"
        return f"step {self.step} from {self.path} ({how})"


# ---------------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------------


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


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
    training_state: bool = True,
) -> Path:
    """Write a complete checkpoint to `path` atomically; an existing checkpoint there is replaced.

    `model` may be a full HuggingFace model or a peft `PeftModel` (which saves only its adapter).
    `rng_state` (from `capture_rng_state`) defaults to the generators' state now; pass an earlier
    capture when the checkpoint describes an earlier moment (a step that finished before a failure).
    `training_state=False` leaves out what only resuming needs (optimizer, scheduler, RNG): final/.
    Raises a CheckpointError, writing nothing, when any weight is NaN/inf: such a checkpoint is never written.
    """
    path = Path(path)
    bad = nonfinite_tensors(model.state_dict())
    if bad:
        raise CheckpointError(
            f"refusing to write checkpoint {path}: {len(bad)} weight tensors hold NaN/inf (e.g. {bad[:3]}). "
            "The weights are garbage, so there is nothing worth saving; resume from an earlier checkpoint "
            "with a lower learning_rate (or float32 / bfloat16 instead of float16)."
        )
    tmp_path = _temporary(path, os.getpid())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _fresh_temporary(path, os.getpid())
        with _quiet_transformers_progress():
            model.save_pretrained(tmp_path, safe_serialization=True, **_own_adapter(model))
        if optimizer is not None and training_state:
            state_files.save_state(tmp_path / OPTIMIZER_NAME, optimizer.state_dict())
        _write_run_files(tmp_path, tokenizer, scheduler, trainer_state, config, rng_state, training_state)
        _swap_into_place(tmp_path, path)
    except BaseException as error:
        shutil.rmtree(tmp_path, ignore_errors=True)
        failed = _write_failed(path, error)
        if failed is not None:
            raise failed from error
        raise
    return path


def _disk_full(error: BaseException | None, depth: int = 0) -> bool:
    """Whether `error`, or an error it wraps, says the disk is full: an OSError ENOSPC/EDQUOT, safetensors'
    "os error 28"."""
    if error is None or depth > 8:
        return False
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(words in str(error) for words in ("No space left on device", "os error 28", "StorageFull")):
        return True
    return any(_disk_full(e, depth + 1) for e in (error.__cause__, error.__context__))


def _write_failed(path: Path, error: BaseException) -> CheckpointError | None:
    """A save that could not write, said in one line that names the folder and what to do; None for any other
    failure (raised as it is)."""
    if isinstance(error, CheckpointError) or not (_disk_full(error) or isinstance(error, OSError)):
        return None
    newest = latest_checkpoint(path.parent)
    kept = (
        f"the checkpoints already there are untouched (the newest is {newest}: continue from it with the "
        f"same command plus --resume)"
        if newest is not None
        else "nothing already there was touched"
    )
    if _disk_full(error):
        return CheckpointError(
            f"cannot write checkpoint {path}: the disk holding {path.parent} is full (no space "
            f"left on device). Free space there, or choose an output_dir on another disk; {kept}."
        )
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return CheckpointError(f"cannot write checkpoint {path}: {reason} ({type(error).__name__}). Make "
                           f"{path.parent} writable, or choose another output_dir; {kept}.")


def _temporary(path: Path, pid: int) -> Path:
    """Where process `pid` writes the checkpoint `path` before renaming it into place."""
    return path.with_name(f"{path.name}.tmp-{pid}")


def _fresh_temporary(path: Path, pid: int) -> Path:
    """An empty `{path}.tmp-{pid}` to write a checkpoint into."""
    tmp_path = _temporary(path, pid)
    if tmp_path.exists():
        shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    return tmp_path


def _write_run_files(tmp_path: Path, tokenizer, scheduler, trainer_state: dict, config: dict,
                     rng_state: dict | None, training_state: bool = True) -> None:
    """Everything of a checkpoint but the weights and the optimizer, then COMPLETE (written last); without
    `training_state`, no scheduler and RNG state."""
    tokenizer.save_pretrained(tmp_path)
    if scheduler is not None and training_state:
        state_files.save_state(tmp_path / SCHEDULER_NAME, scheduler.state_dict())
    _write_json(tmp_path / TRAINER_STATE_NAME, trainer_state)
    if training_state:
        state_files.save_state(tmp_path / RNG_STATE_NAME,
                               rng_state if rng_state is not None else capture_rng_state())
    _write_json(tmp_path / CONFIG_NAME, config)
    write_manifest(tmp_path)


def _swap_into_place(tmp_path: Path, path: Path) -> None:
    """Replace `path` by the finished `tmp_path`; between the two renames `path` is briefly absent, never
    half-written. A folder at `path` that is not a Forge checkpoint is never replaced (a CheckpointError)."""
    old_path = path.with_name(f"{path.name}.old-{os.getpid()}")
    if path.exists() and not has_forge_manifest(path):
        raise CheckpointError(
            f"cannot write checkpoint {path}: a folder that is not a Forge checkpoint (it holds no "
            f"Forge COMPLETE) is in the way; move it out of {path.parent}, or choose another "
            f"output_dir"
        )
    if path.exists():
        if old_path.exists():
            shutil.rmtree(old_path)
        os.replace(path, old_path)
    os.replace(tmp_path, path)
    _fsync_directory(path.parent)
    shutil.rmtree(old_path, ignore_errors=True)


def save_sharded_checkpoint(
    path: str | os.PathLike,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    trainer_state: dict[str, Any],
    config: dict[str, Any],
    rng_state: dict[str, Any] | None,
    ranks: Any,
    full_weights: bool = False,
    training_state: bool = True,
) -> Path:
    """The checkpoint of an FSDP2 run (forge/parallel/sharding.py); every rank calls it, rank 0 writes all but
    the shards.

    `{path}/sharded/` holds every rank's shards of the weights and AdamW state (safetensors, through
    torch.distributed.checkpoint's Hugging Face storage) and layout.json (the rest of that state, as JSON);
    the other files are those of `save_checkpoint`, and COMPLETE hashes the shards too. `full_weights` also
    gathers the whole weights into model.safetensors / adapter_model.safetensors (a folder that
    from_pretrained loads); `training_state=False` (final/: with full_weights) leaves out the shards, the
    scheduler and the RNG.
    `ranks`: is_main, main_pid, barrier() and any(flag) of the run's processes.
    Atomic like save_checkpoint: the ranks write into rank 0's `{path}.tmp-<pid>`, which rank 0 renames."""
    path = Path(path)
    if ranks.any(not all(all_finite(sharding.local(p.detach())) for p in model.parameters()
                         if p.is_floating_point())):
        raise CheckpointError(
            f"refusing to write checkpoint {path}: some weight shards hold NaN/inf. The weights are garbage, "
            "so there is nothing worth saving; resume from an earlier checkpoint with a lower learning_rate."
        )
    tmp_path = _temporary(path, ranks.main_pid)  # rank 0's: every rank writes its shards there
    try:
        if ranks.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            _fresh_temporary(path, ranks.main_pid)
        ranks.barrier()
        if training_state:
            _save_shards(tmp_path, model, optimizer, ranks.is_main)
        whole = sharding.full_state_dict(model) if full_weights else None
        if ranks.is_main:
            if whole is not None:
                with _quiet_transformers_progress():
                    model.save_pretrained(tmp_path, state_dict=whole, safe_serialization=True)
                sharding.fix_architectures(tmp_path, model)
            _write_run_files(tmp_path, tokenizer, scheduler, trainer_state, config, rng_state, training_state)
            _swap_into_place(tmp_path, path)
    except BaseException as error:
        if ranks.is_main:
            shutil.rmtree(tmp_path, ignore_errors=True)
        failed = _write_failed(path, error)
        if failed is not None:
            raise failed from error
        raise
    ranks.barrier()
    return path


_SHARDED_FORMAT = "forge-sharded-v1"


def _save_shards(checkpoint: Path, model, optimizer, is_main: bool) -> None:
    """Every rank writes its shards of the weights and AdamW state into {checkpoint}/sharded/ as safetensors;
    rank 0 writes sharded/layout.json: where each tensor sits in the state, and every value that is not
    one."""
    tensors, layout = state_files.encode(sharding.state_dicts(model, optimizer))
    sharding.save_tensors(checkpoint / SHARDED_DIR, tensors)  # collective
    if is_main:
        _write_json(checkpoint / SHARDED_LAYOUT, {"format": _SHARDED_FORMAT, "layout": layout})


def check_shard_files(path: Path) -> None:
    """Each shard file of a sharded checkpoint is a whole safetensors file (only its header is read), so a
    damaged one is named before torch.distributed.checkpoint reads them: COMPLETE may match it (rewritten)."""
    for shard in sorted((path / SHARDED_DIR).glob("*.safetensors")):
        problem = safetensors_problem(shard)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is damaged: {SHARDED_DIR}/{shard.name} {problem}. "
                                  f"{offer_previous(path)}")


def load_sharded_state(path: str | os.PathLike, model, optimizer) -> None:
    """Load the shards of a verified sharded checkpoint into the sharded model and optimizer (collective; any
    number of ranks: the shards are redistributed). Reads safetensors headers, tensor bytes and JSON only."""
    path = Path(path)
    check_shard_files(path)
    try:
        saved = read_json(path / SHARDED_LAYOUT)
        if not isinstance(saved, dict) or saved.get("format") != _SHARDED_FORMAT:
            raise ValueError(f"its format is not {_SHARDED_FORMAT}")
        tensors, _ = state_files.encode(sharding.state_dicts(model, optimizer))  # this run's shards, to fill
        # a tensor it names that this run lacks: ValueError
        state = state_files.decode(saved["layout"], tensors)
        sharding.load_tensors(path / SHARDED_DIR, tensors)  # in place, into `state` too
    except Exception as error:  # noqa: BLE001 - a wrong layout or shard, said with the checkpoint named
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded: {SHARDED_DIR}/ is damaged or was saved from another "
            f"model or LoRA setup ({reason}). {offer_previous(path)}"
        ) from None
    sharding.set_state(model, optimizer, state)


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def _read_state_file(path: Path, name: str, reader) -> Any:
    try:
        return reader(path / name)
    except JSONFileError as error:  # too big, nested too deep, no JSON, not an object
        raise CheckpointError(f"checkpoint {path} is damaged: {name} {error.problem}. "
                              f"{offer_previous(path)}") from None
    except Exception as error:  # noqa: BLE001 - any failure to parse is a damaged file, named
        raise CheckpointError(f"checkpoint {path} is damaged: {name} cannot be read "
                              f"({type(error).__name__}: {error}). {offer_previous(path)}") from None


def saved_config(path: Path) -> dict[str, Any]:
    """The run config a checkpoint was saved with (forge_config.json), read alone."""
    return _read_state_file(path, CONFIG_NAME, read_json)


def _load_optional(path: Path) -> Any | None:
    return state_files.load_state(path) if path.is_file() else None


def load_checkpoint(path: str | os.PathLike, *, require_training_state: bool = True) -> CheckpointState:
    """Read a checkpoint's trainer state, config, RNG, optimizer and scheduler states (not the weights).

    Every file is first checked against the sha256 recorded in COMPLETE (`verify_checkpoint`); a missing,
    changed, empty or truncated file raises a CheckpointError that names it and the newest older
    checkpoint that verifies. A checkpoint without checksums loads with a warning. With
    `require_training_state` (what resuming needs) optimizer.pt and scheduler.pt must be there too.
    `.step` and `.describe()` of the result say what was loaded.
    """
    path = Path(path)
    verified = verify_checkpoint(path, require_training_state=require_training_state)
    if not verified:
        warnings.warn(
            f"checkpoint {path} has no checksums (saved by an older Forge): loading it without "
            f"verifying its files; its weights were checked for truncation and NaN/inf",
            stacklevel=2,
        )
    return CheckpointState(
        path=path,
        trainer_state=_read_state_file(path, TRAINER_STATE_NAME, read_json),
        config=_read_state_file(path, CONFIG_NAME, read_json),
        rng_state=_read_state_file(path, RNG_STATE_NAME, _load_optional),
        optimizer_state=_read_state_file(path, OPTIMIZER_NAME, _load_optional),
        scheduler_state=_read_state_file(path, SCHEDULER_NAME, _load_optional),
        verified=verified,
    )


def _load_weights_file(path: Path, name: str) -> dict[str, torch.Tensor]:
    """One safetensors file of a checkpoint, refused with a CheckpointError when damaged or non-finite."""
    file = path / name
    problem = safetensors_problem(file) if file.is_file() else "is missing"
    if problem is None:
        try:
            state_dict = load_file(file, device="cpu")
        except Exception as error:  # noqa: BLE001 - safetensors' own error type; reported with the file named
            problem = f"cannot be read ({type(error).__name__}: {error})"
    if problem is None:
        bad = nonfinite_tensors(state_dict)
        if not bad:
            return state_dict
        problem = f"holds NaN/inf in {len(bad)} tensors (e.g. {bad[:3]})"
    raise CheckpointError(f"checkpoint {path} is damaged: {name} {problem}. {offer_previous(path)}")


def _load_full_state_dict(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """model.safetensors, or every shard listed in model.safetensors.index.json; each tensor of the `expected`
    shape and dtype."""
    try:
        names = weight_files(path)
    except Damaged as damaged:
        raise CheckpointError(f"checkpoint {path} is damaged: {damaged}. {offer_previous(path)}") from None
    state_dict: dict[str, torch.Tensor] = {}
    for name in names:
        tensors = _load_weights_file(path, name)
        check_tensors(path, name, tensors, expected)
        state_dict.update(tensors)
    return state_dict


def _raise_on_key_mismatch(path: Path, name: str, missing: list[str], unexpected: list[str]) -> None:
    """A CheckpointError (the checkpoint's fault, exit code 1) naming the file when its tensor names are not
    the model's."""
    if not missing and not unexpected:
        return
    details = []
    if missing:
        details.append(f"missing {len(missing)} keys (e.g. {missing[:3]})")
    if unexpected:
        details.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[:3]})")
    raise CheckpointError(f"checkpoint {path}: {name} does not fit the model: {'; '.join(details)}. Was the "
                          f"checkpoint saved from a different model or LoRA setup? {offer_previous(path)}")


def _own_adapter(model: Any) -> dict:
    """save_pretrained's arguments that keep a PeftModel's checkpoint to the adapter it trains: a teacher
    adapter loaded next to it (on-policy distillation, core/teacher.py) is not saved."""
    return {"selected_adapters": [model.active_adapter]} if _is_peft_model(model) else {}


def _load_adapter_weights(model: Any, path: Path) -> None:
    if not _is_peft_model(model):
        raise ValueError(
            f"checkpoint {path} holds only a LoRA adapter, but the model is not a peft model; "
            "wrap it with the same LoRA config (use_lora=True) before loading"
        )
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    adapter_state = _load_weights_file(path, ADAPTER_WEIGHTS_NAME)
    own = get_peft_model_state_dict(model)
    check_tensors(path, ADAPTER_WEIGHTS_NAME, adapter_state, own)
    expected = set(own)
    missing = sorted(expected - set(adapter_state))
    unexpected = sorted(set(adapter_state) - expected)
    _raise_on_key_mismatch(path, ADAPTER_WEIGHTS_NAME, missing, unexpected)
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
    model_tensors = model.state_dict(keep_vars=True)
    state_dict = _load_full_state_dict(path, model_tensors)
    result = model.load_state_dict(state_dict, strict=False)
    # A tied weight (e.g. lm_head sharing embed_tokens) is saved once: it is not missing.
    loaded_storage = {model_tensors[k].data_ptr() for k in state_dict if k in model_tensors}
    missing = [k for k in result.missing_keys if model_tensors[k].data_ptr() not in loaded_storage]
    name = FULL_WEIGHTS_NAME if (path / FULL_WEIGHTS_NAME).exists() else FULL_WEIGHTS_INDEX_NAME
    _raise_on_key_mismatch(path, name, missing, list(result.unexpected_keys))


def load_model_weights(model: Any, path: str | os.PathLike) -> None:
    """Load a checkpoint's weights into `model` in place: the full weights or the LoRA adapter.

    Reads Forge's safetensors files only. Raises when a key the model needs is absent or the file has
    extra keys, and a CheckpointError when a weight file is empty, truncated, unreadable or holds NaN/inf.
    """
    path = Path(path)
    if (path / ADAPTER_WEIGHTS_NAME).is_file():
        _load_adapter_weights(model, path)
    elif (path / FULL_WEIGHTS_NAME).exists() or (path / FULL_WEIGHTS_INDEX_NAME).is_file():
        _load_full_weights(model, path)
    else:
        raise FileNotFoundError(
            f"no {FULL_WEIGHTS_NAME} or {ADAPTER_WEIGHTS_NAME} in {path}; is it a Forge checkpoint?"
        )
