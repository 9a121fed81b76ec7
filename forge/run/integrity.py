"""Whether a checkpoint directory is whole: its layout, the sha256 manifest written last, verification, and
which checkpoints of a run exist, verify, or are left over from a killed save.

    {checkpoint}/COMPLETE      written last: {"format": ..., "sha256": {file: digest}, "bytes": {file: size}}
                               of every other file
    verify_checkpoint(path)    re-hash every file against COMPLETE (a checkpoint from before checksums: check
                               its weight files for a truncated safetensors layout and NaN/inf instead)
    latest_verified_checkpoint the newest numbered checkpoint that verifies
    remove_stale_temporaries   the `.tmp-<pid>` / `.old-<pid>` leftovers of saves whose process is gone (an
                               `.old-<pid>` is put back only when it verifies)
    has_forge_manifest         whether a folder is Forge's checkpoint (what --overwrite_output_dir may delete)
    check_saved_model          a folder Forge saved verifies before `forge eval` / `forge export` load it
    prune_checkpoints          keep the newest N

A checkpoint is read as someone else may have left it: its JSON (COMPLETE, the shard index, a safetensors
header) through forge/safe_json.py's limits, a link followed only when it stays inside the folder
and ends (`inside`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from forge.run.checkpoint_names import newest_last, step_of
from forge.run.optim import all_finite
from forge.safe_json import MAX_JSON_BYTES, JSONFileError, json_type, parse_json, read_json

COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE_NAME = "trainer_state.json"
CONFIG_NAME = "forge_config.json"
OPTIMIZER_NAME = "optimizer.safetensors"  # state files: forge/run/state_files.py (safetensors, no pickle)
SCHEDULER_NAME = "scheduler.safetensors"
RNG_STATE_NAME = "rng_state.safetensors"
FULL_WEIGHTS_NAME = "model.safetensors"
FULL_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
SHARDED_DIR = "sharded"  # an FSDP2 run's shards of the weights and AdamW state (forge/parallel/sharding.py)
SHARDED_LAYOUT = "sharded/layout.json"  # what of the sharded state is not a tensor, and the format: Forge's
# What an older Forge wrote with pickle (torch.save, torch.distributed.checkpoint's .metadata), and what
# replaced each: a checkpoint holding one of these without its replacement is refused, never unpickled.
PICKLED_NAMES = {
    "optimizer.pt": OPTIMIZER_NAME,
    "scheduler.pt": SCHEDULER_NAME,
    "rng_state.pt": RNG_STATE_NAME,
    "sharded/.metadata": SHARDED_LAYOUT,
}

# The temporaries of a save in progress: `{name}.tmp-{pid}` (being written), `{name}.old-{pid}` (being
# replaced).
_TEMPORARY_DIR_PATTERN = re.compile(r"^(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")
# What resuming needs besides the weights; load_checkpoint(require_training_state=True) insists on them.
TRAINING_STATE_NAMES = (OPTIMIZER_NAME, SCHEDULER_NAME, RNG_STATE_NAME)
_MANIFEST_FORMAT = "forge-checkpoint-sha256-v1"


class CheckpointError(ValueError):
    """A checkpoint is incomplete, damaged or unusable; the message names the file and what to do."""


# ---------------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checkpoint_files(directory: Path) -> list[str]:
    """Every file of a checkpoint but the marker, as sorted posix paths relative to it."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != COMPLETE_MARKER)


def nonfinite_tensors(state_dict: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors that hold a NaN or inf (`all_finite`: the sum first, 0.07 s instead
    of 1.3 s for SmolLM2-135M on one CPU thread)."""
    return [name for name, tensor in state_dict.items()
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not all_finite(tensor)]


def write_manifest(directory: Path) -> None:
    """Write COMPLETE last: the sha256 of every other file, so a load can tell a damaged file."""
    names = _checkpoint_files(directory)
    manifest = {"format": _MANIFEST_FORMAT, "sha256": {name: _sha256(directory / name) for name in names},
                "bytes": {name: (directory / name).stat().st_size for name in names}}
    with (directory / COMPLETE_MARKER).open("w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------------
# Verifying
# ---------------------------------------------------------------------------------------------------


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether a checkpoint was saved by an FSDP2 run (its weights and optimizer state are in sharded/)."""
    return (Path(path) / SHARDED_DIR).is_dir()


def has_forge_manifest(path: str | os.PathLike) -> bool:
    """Whether `path` holds a COMPLETE that Forge wrote (its sha256 manifest, or the "ok" of a Forge from
    before checksums): how Forge tells its own checkpoint folders from anything else with a step's name."""
    marker = Path(path) / COMPLETE_MARKER
    try:
        if not marker.is_file():
            return False
        return _is_old_marker(marker) or read_json(marker).get("format") == _MANIFEST_FORMAT
    except (OSError, ValueError):  # ValueError: JSONFileError, not Forge's JSON
        return False


def _is_old_marker(marker: Path) -> bool:
    """Whether COMPLETE holds the "ok" of a Forge from before checksums."""
    return marker.stat().st_size < 16 and marker.read_bytes().strip() == b"ok"


def pickled_file(path: Path) -> str | None:
    """The first file of a checkpoint in an older Forge's pickle format whose replacement is
    absent, or None."""
    for name, replacement in PICKLED_NAMES.items():
        if (path / name).is_file() and not (path / replacement).is_file():
            return name
    return None


def refuse_pickled(path: Path, name: str) -> CheckpointError:
    """The error for a checkpoint whose state needs unpickling (see PICKLED_NAMES): what it
    is, and what to do."""
    if name.startswith(SHARDED_DIR):
        way_out = (
            f"start a new run from the whole weights of that run's final/ (--model {path.parent / 'final'}), "
            f"if it finished"
        )
    else:
        way_out = f"start a new run from its weights, which are safetensors (--model {path})"
    return CheckpointError(
        f"checkpoint {path} cannot be loaded: {name} is in torch's pickle format, written by an older "
        "Forge, and Forge never unpickles a checkpoint (unpickling runs whatever code the file names). To "
        f"go on, {way_out}; or resume it with the Forge version that wrote it, if you trust where the "
        "checkpoint came from."
    )


def _has_whole_weights(path: Path) -> bool:
    return any((path / name).exists() for name in (ADAPTER_WEIGHTS_NAME, FULL_WEIGHTS_NAME,
                                                   FULL_WEIGHTS_INDEX_NAME))


class Damaged(Exception):
    """One file of a checkpoint is missing or wrong; turned into a CheckpointError with advice."""

    def __init__(self, name: str, reason: str, verdict: str = "is damaged"):
        super().__init__(f"{name} {reason}")
        self.name, self.reason, self.verdict = name, reason, verdict


def _read_manifest(path: Path) -> tuple[dict[str, str], dict[str, int]] | None:
    """({file: sha256}, {file: size in bytes}) as COMPLETE records them (no sizes in a COMPLETE of a Forge
    before them); None for a checkpoint from before checksums ("ok")."""
    marker = path / COMPLETE_MARKER
    if _is_old_marker(marker):
        return None
    try:
        manifest = read_json(marker)
    except JSONFileError as error:
        raise Damaged(COMPLETE_MARKER, error.problem) from None
    hashes = manifest.get("sha256")
    if manifest.get("format") != _MANIFEST_FORMAT or not isinstance(hashes, dict):
        raise Damaged(COMPLETE_MARKER, "is unreadable (damaged, or written by a newer Forge)")
    sizes = manifest.get("bytes", {})
    if not isinstance(sizes, dict):
        raise Damaged(COMPLETE_MARKER, f'has a "bytes" that is {json_type(sizes)}, not an object of sizes')
    return hashes, sizes


def weight_files(path: Path) -> list[str]:
    """The safetensors files that hold the checkpoint's weights (adapter, single file or shards), each inside
    the checkpoint folder (Damaged for one that is not: `inside`)."""
    if (path / ADAPTER_WEIGHTS_NAME).is_file():
        return [inside(path, ADAPTER_WEIGHTS_NAME)]
    if (path / FULL_WEIGHTS_NAME).exists():
        return [inside(path, FULL_WEIGHTS_NAME)]
    if (path / FULL_WEIGHTS_INDEX_NAME).is_file():
        try:
            index = read_json(path / FULL_WEIGHTS_INDEX_NAME)
        except JSONFileError as error:
            raise Damaged(FULL_WEIGHTS_INDEX_NAME, error.problem) from None
        problem = index_problem(index)
        if problem is not None:
            raise Damaged(FULL_WEIGHTS_INDEX_NAME, problem)
        shards = sorted(set(index["weight_map"].values()))
        return [inside(path, name, named_by=FULL_WEIGHTS_INDEX_NAME) for name in shards]
    raise Damaged(FULL_WEIGHTS_NAME, f"is missing (and there is no {ADAPTER_WEIGHTS_NAME} either)")


def index_problem(index: dict) -> str | None:
    """Why a model.safetensors.index.json is not one transformers can read (its weight_map an object of tensor
    name -> shard file), or None."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        holds = f" (it holds {json_type(weight_map)})" if "weight_map" in index else ""
        return f'has no "weight_map" object of tensor name -> shard file{holds}'
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            return f'has a "weight_map" that gives {tensor!r:.100} the shard {file!r:.100}, not a file name'
    return None


def inside(path: Path, name: Any, named_by: str | None = None) -> str:
    """`name`, a file of the checkpoint `path`: a relative path without `..` that, links followed, stays
    inside the folder; Damaged otherwise (a checkpoint's files are read from the checkpoint only), and for a
    link that loops (following it never ends)."""
    if isinstance(name, str) and name and link_loops(path / name):
        raise Damaged(name,
                      "is a symlink loop (a link that leads back to itself, never to a file); remove it")
    outside = (not isinstance(name, str) or not name or os.path.isabs(name) or ".." in Path(name).parts
               or not Path(os.path.realpath(path / name)).is_relative_to(os.path.realpath(path)))
    if not outside:
        return name
    if named_by is not None:
        raise Damaged(
            named_by,
            f"names {name!r:.200}, outside the checkpoint; a checkpoint's files are read only from inside it",
        )
    raise Damaged(
        name,
        f"is a link to {os.path.realpath(path / name)}, outside the checkpoint; a checkpoint's "
        f"files are read only from inside it",
    )


def link_loops(file: Path) -> bool:
    """Whether following the links of `file` never ends (a link to itself, or links in a circle), where
    Path.resolve raises RuntimeError("Symlink loop")."""
    try:
        os.stat(file)
    except OSError as error:
        return error.errno == errno.ELOOP
    return False


def _links_out(path: Path) -> None:
    """Damaged for the first link anywhere in the checkpoint that leads outside it."""
    for folder, directories, files in os.walk(path):
        for entry in directories + files:
            if os.path.islink(os.path.join(folder, entry)):
                inside(path, os.path.relpath(os.path.join(folder, entry), path))


def safetensors_problem(file: Path) -> str | None:
    """Why `file` is not a whole safetensors file (empty, truncated, bad header), or None;
    reads only the header.

    Layout: an 8-byte little-endian header length n, n bytes of JSON header, then the tensor bytes, whose
    extent the header's data_offsets give."""
    size = file.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    with file.open("rb") as f:
        head = f.read(8)
        header_size = int.from_bytes(head, "little") if len(head) == 8 else size
        if 8 + header_size > size:
            return f"is truncated ({size} bytes; its header alone needs {8 + header_size})"
        if header_size > MAX_JSON_BYTES:  # safetensors' own limit
            return (f"has a header of {header_size:,} bytes, more than the {MAX_JSON_BYTES:,} "
                    "safetensors reads")
        try:
            header = parse_json(f.read(header_size), file.name)
        except JSONFileError as error:
            return f"has a header that {error.problem}"
    problem = header_problem(header)
    if problem is not None:
        return problem
    data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                   default=0)
    if 8 + header_size + data_end > size:
        return f"is truncated ({size} bytes of the {8 + header_size + data_end} its header describes)"
    return None


def read_header(file: Path) -> dict:
    """The JSON header of a safetensors file that `safetensors_problem` passed."""
    with file.open("rb") as f:
        return parse_json(f.read(int.from_bytes(f.read(8), "little")), file.name)


def header_problem(header: dict) -> str | None:
    """Why a safetensors header is not one (each entry a tensor's dtype, shape and data_offsets; __metadata__
    an object of strings), or None."""
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(value, str) for value in entry.values()):
                return "has a header whose __metadata__ is not an object of strings (not a safetensors file)"
            continue
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("dtype"), str)
            and _counts(entry.get("shape"))
            and _counts(entry.get("data_offsets"))
            and len(entry["data_offsets"]) == 2
        ):
            return f"has a header entry for {name!r:.100} that is not a tensor's ({str(entry)[:200]})"
    return None


def _counts(value: Any) -> bool:
    """Whether `value` is a list of whole numbers >= 0 (JSON's true and false are not)."""
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def _verify(path: Path, require_training_state: bool) -> bool:
    """Check a complete checkpoint's files; True if checked against checksums, False if it has none.

    Raises Damaged for the first file that is missing, does not match its sha256, or (without checksums)
    is a truncated safetensors file or holds NaN/inf weights."""
    manifest, sizes = _read_manifest(path) or (None, {})
    _links_out(path)
    for name in manifest or ():
        inside(path, name, named_by=COMPLETE_MARKER)
    # an FSDP2 run's: weights and optimizer in sharded/, whole weights only in final/
    sharded = is_sharded(path)
    weights = weight_files(path) if not sharded or _has_whole_weights(path) else []
    required = [*weights, TRAINER_STATE_NAME, CONFIG_NAME]
    if sharded:
        required.append(SHARDED_LAYOUT)
    if require_training_state:  # final/ holds none of these (forge/run/checkpoint.py)
        required += ([SCHEDULER_NAME, RNG_STATE_NAME] if sharded
                     else [OPTIMIZER_NAME, SCHEDULER_NAME, RNG_STATE_NAME])
    for name in required:
        if not (path / name).is_file():
            if manifest is not None and name not in manifest:
                raise Damaged(name, "was not saved in it", verdict="cannot resume a run")
            raise Damaged(name, "is missing")
    if manifest is not None:
        for name, digest in manifest.items():
            file = path / name
            if not file.is_file():
                raise Damaged(name, "is missing (COMPLETE lists it)")
            if name in sizes and file.stat().st_size != sizes[name]:  # never hash a huge file
                recorded = f"{sizes[name]:,}" if isinstance(sizes[name], int) else f"{sizes[name]!r:.40}"
                problem = safetensors_problem(file) if name.endswith(".safetensors") else None
                raise Damaged(name, f"is {file.stat().st_size:,} bytes, not the {recorded} recorded in "
                                    f"{COMPLETE_MARKER}" + (f": it {problem}" if problem else
                                                            " (changed or damaged on disk)"))
            if _sha256(file) != digest:
                problem = safetensors_problem(file) if name.endswith(".safetensors") else None
                raise Damaged(name, f"does not match the sha256 recorded in {COMPLETE_MARKER}"
                               + (f": it {problem}" if problem else " (changed or damaged on disk)"))
        return True
    for name in weights:
        problem = safetensors_problem(path / name)
        if problem:
            raise Damaged(name, problem)
        bad = nonfinite_tensors(load_file(path / name, device="cpu"))
        if bad:
            raise Damaged(name, f"holds NaN/inf in {len(bad)} tensors (e.g. {bad[:3]})")
    return False


def verify_checkpoint(path: str | os.PathLike, *, require_training_state: bool = True) -> bool:
    """Raise a CheckpointError unless `path` is a complete, undamaged checkpoint (see `load_checkpoint`).

    Returns True when every file matched its recorded sha256, False for an older checkpoint without
    checksums that passed the weaker checks (whole safetensors files with finite weights)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (interrupted save?); use an earlier one "
            f"(no {COMPLETE_MARKER} marker). {offer_previous(path)}"
        )
    pickled = pickled_file(path)
    if pickled is not None:
        raise refuse_pickled(path, pickled)
    try:
        return _verify(path, require_training_state)
    except Damaged as damaged:
        raise CheckpointError(f"checkpoint {path} {damaged.verdict}: {damaged}. "
                              f"{offer_previous(path)}") from None
    except OSError as error:
        raise CheckpointError(f"checkpoint {path} cannot be read: {error}. {offer_previous(path)}") from None


def offer_previous(path: Path) -> str:
    """Advice naming the newest checkpoint older than `path` that verifies, if there is one."""
    previous = latest_verified_checkpoint(path.parent, before_step=step_of(path.name))
    if previous is None:
        return f"No other checkpoint in {path.parent} verifies: start the run again in a new output_dir."
    return (f"The newest older checkpoint that verifies is {previous}: resume from it with "
            f"resume_from='{previous}' (`forge train ... --resume_from {previous}`), or move {path} "
            f"out of {path.parent} and resume with --resume.")


# ---------------------------------------------------------------------------------------------------
# A saved folder given to a command that loads it
# ---------------------------------------------------------------------------------------------------


class UnverifiedSave(ValueError):
    """A folder Forge saved, given to `forge eval` or `forge export`, does not verify: bad
    input (exit code 2)."""


def is_forge_save(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder Forge saved or was saving: it holds Forge's COMPLETE or forge_config.json (a
    name only Forge writes), or has the name of a save's temporary. A plain transformers folder or
    a hub id is not."""
    path = Path(path)
    return path.is_dir() and (has_forge_manifest(path) or (path / CONFIG_NAME).is_file()
                              or _TEMPORARY_DIR_PATTERN.match(path.name) is not None)


def check_saved_model(path: str | os.PathLike, given_as: str) -> None:
    """Before a command loads a model or adapter folder (`forge eval --model/--adapter`, `forge export
    --adapter`): a folder Forge saved must be complete and verify as final/ does (`_verify`, no training state
    needed); anything else loads unchecked. Raises UnverifiedSave naming the folder (`given_as` is the flag),
    the file, and what to load instead."""
    path = Path(path)
    if not is_forge_save(path):
        return
    if not is_complete(path):
        problem = (
            f"is incomplete: it has no {COMPLETE_MARKER} marker (its save was interrupted, or the marker "
            f"was removed)"
        )
    else:
        try:
            _verify(path, require_training_state=False)
            return
        except Damaged as damaged:
            problem = f"does not verify: {damaged}"
        except OSError as error:
            problem = f"cannot be read: {error}"
    temporary = _TEMPORARY_DIR_PATTERN.match(path.name)
    step = step_of(temporary.group("name") if temporary else path.name)
    previous = latest_verified_checkpoint(path.parent, before_step=step)
    way_out = (f"Use {previous} instead (the newest earlier checkpoint that verifies), or re-run the save"
               if previous else f"No earlier checkpoint in {path.parent} verifies: re-run the save")
    raise UnverifiedSave(f"{given_as} {path} (a Forge checkpoint) {problem}. {way_out} (the "
                         "training that wrote it).")


# ---------------------------------------------------------------------------------------------------
# Finding and pruning checkpoints
# ---------------------------------------------------------------------------------------------------


def _complete_numbered_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every numbered checkpoint with Forge's COMPLETE (`checkpoint-{step}`, or an earlier
    Forge's `{step}`: forge/run/checkpoint_names.py), oldest first. Skips final/, temporaries, partial folders
    and folders with a step's name that Forge did not write."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [child for child in output_dir.iterdir()
             if step_of(child.name) is not None and child.is_dir() and has_forge_manifest(child)]
    return [(step_of(path.name), path) for path in sorted(found, key=lambda path: newest_last(path.name))]


def numbered_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete numbered checkpoint in `output_dir`, oldest first."""
    return _complete_numbered_checkpoints(output_dir)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete numbered checkpoint with the highest step, or None."""
    checkpoints = _complete_numbered_checkpoints(output_dir)
    return checkpoints[-1][1] if checkpoints else None


def latest_verified_checkpoint(output_dir: str | os.PathLike, before_step: int | None = None) -> Path | None:
    """The newest complete numbered checkpoint that passes `verify_checkpoint` (and can
    resume a run), or None.

    `before_step` only considers checkpoints of earlier steps. Checks newest first and stops at the
    first that verifies, so it usually hashes one checkpoint. Unlike `latest_checkpoint` it skips a
    damaged checkpoint: use it to name where a run can safely go on from, never to resume silently from
    an older step than the user asked for."""
    for step, path in reversed(_complete_numbered_checkpoints(output_dir)):
        if before_step is not None and step >= before_step:
            continue
        if verifies(path):
            return path
    return None


def verifies(path: Path, require_training_state: bool = True) -> bool:
    """Whether `path` passes `verify_checkpoint`, without raising: every file whole, none in
    the pickle format."""
    if not is_complete(path) or pickled_file(path) is not None:
        return False
    try:
        _verify(path, require_training_state=require_training_state)
    except (Damaged, OSError):
        return False
    return True


def _process_is_alive(pid: int) -> bool:
    """Whether a process with this id exists (another user's counts). This process counts as gone: its own
    leftovers are of an earlier process that had the same id (common in containers)."""
    if pid == os.getpid():
        return False
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process on Windows: never clean there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(output_dir: str | os.PathLike) -> list[tuple[Path, str]]:
    """Clean up after saves that were killed; returns (directory, what was done: "deleted",
    "restored" or "kept").

    `{name}.tmp-{pid}` (a checkpoint being written) whose process is gone is deleted. `{name}.old-{pid}`
    (a checkpoint being replaced, killed between the two renames) is renamed back to `{name}` when nothing
    took its place and every file of it verifies against its COMPLETE; it is deleted when a Forge checkpoint
    took its place, and kept as it is otherwise (damaged, or not Forge's: the caller says so). Directories of
    a live process are left alone. Call it at the start of a run, before this process saves anything."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    cleaned = []
    for child in sorted(output_dir.iterdir()):
        match = _TEMPORARY_DIR_PATTERN.match(child.name)
        if not match or not child.is_dir() or _process_is_alive(int(match.group("pid"))):
            continue
        target = child.with_name(match.group("name"))
        if match.group("kind") == "tmp" or (target.exists() and has_forge_manifest(target)):
            shutil.rmtree(child, ignore_errors=True)
            cleaned.append((child, "deleted"))
        elif not target.exists() and restorable(child):
            os.replace(child, target)
            cleaned.append((child, "restored"))
        else:
            cleaned.append((child, "kept"))
    return cleaned


def stale_old_checkpoint(path: Path) -> Path | None:
    """For `{name}.old-{pid}` of a process that is gone: the checkpoint `{name}` it would be put
    back as; else None."""
    match = _TEMPORARY_DIR_PATTERN.match(path.name)
    if not match or match.group("kind") != "old" or _process_is_alive(int(match.group("pid"))):
        return None
    return path.with_name(match.group("name"))


def restorable(old: Path) -> bool:
    """Whether `{name}.old-{pid}` is a whole Forge checkpoint: its COMPLETE is Forge's and
    every file verifies."""
    name = _TEMPORARY_DIR_PATTERN.match(old.name).group("name")
    return has_forge_manifest(old) and verifies(old, require_training_state=name != "final")


def prune_checkpoints(output_dir: str | os.PathLike, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` complete numbered checkpoints (None keeps all);
    returns the deleted."""
    if keep is None:
        return []
    if keep < 0:
        raise ValueError(f"keep={keep}: must be >= 0 or None")
    checkpoints = _complete_numbered_checkpoints(output_dir)
    doomed = [path for _, path in checkpoints[: max(len(checkpoints) - keep, 0)]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


