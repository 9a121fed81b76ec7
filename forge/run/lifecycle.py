"""A run's lifecycle around the GRPO steps: the output directory, checkpoints of finished steps,
resume.

A run is never lost. After every optimizer step the trainer hands a `FinishedStep` to `RunLifecycle`: the
step number, where the data order stands, the counters a resumed run must continue, and every RNG state as
the next step will find it. Whatever stops the run later (a signal: forge/run/signals.py, a failing reward, a
non-finite abort), that step can still be saved, and a resumed run repeats the uninterrupted one bit for bit.

    RunLifecycle(output_dir, parts)       what is saved: model, tokenizer, optimizer, schedule, config
      .finished(FinishedStep)             the trainer reports each finished step
      .save(finished[, name])             {output_dir}/checkpoint-{step}/ (or final/: weights only), atomic,
                                          pruned
      .where_to_resume()                  saves the last finished step if needed; says where it is, how to
                                          resume
      .resume(where) -> FinishedStep      loads weights, optimizer, schedule and RNG; checks config and data
    check_output_dir_is_free / claim_output_dir    refuse another run's directory; hold it for this run

This module never reads the trainer: everything comes in through `CheckpointParts` and `FinishedStep`.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from forge.run import checkpoint as ckpt
from forge.run import checkpoint_fields as fields
from forge.run import integrity
from forge.run.checkpoint_names import checkpoint_dir, step_of
from forge.run.optim import apply_new_hyperparameters
from forge.run.rng import restore_rng_state


@dataclass
class FinishedStep:
    """Where the last finished optimizer step left the run: what a checkpoint of it must hold."""

    step: int
    epoch: int
    position: int  # rows of this epoch's shuffled order already used
    rng_state: dict  # every generator, as the next step will find it
    nonfinite_in_a_row: int = 0  # optimizer steps skipped for a NaN/inf in a row, up to this one
    skipped_steps: int = 0  # optimizer steps skipped for a NaN/inf in the whole run
    loss_scale: float = 1.0  # fp16's dynamic loss scale (1 in fp32 / bf16)
    entropy_control: dict | None = None  # adaptive entropy control's coefficient and last entropy
    # (None: fixed)
    micro_batch_size: int | None = None  # the loss-pass micro-batch micro_batch_size='auto' chose
    # (None: fixed)
    num_input_tokens_seen: int = 0  # prompt and completion tokens of every step so far (TRL's num_tokens)


@dataclass
class CheckpointParts:
    """What a checkpoint saves besides the FinishedStep: the objects of the run, and who they are."""

    model: Any
    tokenizer: Any
    optimizer: Any
    scheduler: Any
    run_config: dict  # GRPOConfig as a dict plus the model's name: compared on resume
    is_lora: bool
    dataset_identity: dict = field(default_factory=dict)  # size and fingerprint of the training rows
    sharded_by: Any = None  # FSDP2: the run's processes (is_main, main_pid, barrier, any), which all save;
    # None: the whole model is on rank 0, which saves alone
    # transformers' TrainerState.log_history, kept up to date by the run: trainer_state.json holds it as
    # transformers writes it, and resuming puts it back
    log_history: list = field(default_factory=list)


def resume_hint(path: Path) -> str:
    return (f"Resume with the same command plus --resume (`forge train ... --resume`), or in Python with "
            f"GRPOConfig(..., resume_from={str(path)!r}).")


def check_output_dir(output_dir: Path, is_main: bool) -> None:
    """Refuse an output_dir that is a file or cannot be written, before any model work."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"output_dir={str(output_dir)!r} is a file; choose a directory path")
    if is_main:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=output_dir) as probe:  # unnamed: two runs may probe at once
                probe.write(b"ok")
        except OSError as error:
            raise ValueError(f"output_dir={str(output_dir)!r} is not writable "
                             f"({error}); choose another") from None


LOG_ARTIFACTS = ("training_log.jsonl", "samples.jsonl", "tensorboard")
"""The logs a run writes into output_dir (forge/logging/logger.py)."""
LOCK_NAME = ".forge.lock"


class OutputDirInUse(ValueError):
    """output_dir holds another run, or a live run is writing to it."""


@dataclass
class RunLeft:
    """What is in an output_dir, sorted by who wrote it (names relative to it)."""

    checkpoints: list[str]  # numbered folders (`checkpoint-{step}`, an earlier Forge's `{step}`) and final/
    # that hold Forge's COMPLETE, and `.old-<pid>` leftovers that would be put back (`integrity.restorable`)
    logs: list[str]  # training_log.jsonl, samples.jsonl, tensorboard/
    foreign: list[str]  # folders with a step's name (or final/) that hold no Forge COMPLETE: not Forge's


def what_is_left(output_dir: Path) -> RunLeft:
    """Forge's own files in output_dir, and the folders it would save over that are not its own."""
    left = RunLeft([], [], [])
    if not output_dir.is_dir():
        return left
    for child in sorted(output_dir.iterdir(), key=lambda p: p.name):
        leftover = integrity.stale_old_checkpoint(child)
        if child.name in LOG_ARTIFACTS:
            left.logs.append(child.name)
        elif (step_of(child.name) is not None or child.name == "final") and child.is_dir():
            (left.checkpoints if integrity.has_forge_manifest(child) else left.foreign).append(child.name)
        elif leftover is not None and not leftover.exists() and integrity.restorable(child):
            left.checkpoints.append(child.name)
    return left


def previous_run(output_dir: Path) -> list[str]:
    """What an earlier run left in output_dir: Forge's checkpoints (numbered, final/, a restorable leftover of
    a killed save) and its logs. Nothing else in the directory is Forge's."""
    left = what_is_left(output_dir)
    return sorted(left.checkpoints + left.logs)


def check_output_dir_is_free(output_dir: Path, *, resuming: bool, overwrite: bool, is_main: bool) -> None:
    """What `claim_output_dir` refuses, checked without changing anything in output_dir (it may create it): a
    file, a directory that cannot be written, a live run's lock, a folder with a step's name that is not
    Forge's (a save would replace it), and another run's checkpoints unless `resuming` or `overwrite`. Logs
    alone (a run stopped before its first checkpoint) do not stop a new run: `claim_output_dir` replaces them.
    `forge train` calls it before it loads the model."""
    check_output_dir(output_dir, is_main)
    if is_main:
        RunLock(output_dir / LOCK_NAME).release()  # raises OutputDirInUse while another run holds it
    left = what_is_left(output_dir)
    if left.foreign:
        raise OutputDirInUse(
            f"output_dir={str(output_dir)!r} holds {', '.join(f'{name}/' for name in left.foreign[:6])}, "
            f"named like a Forge checkpoint but not Forge's (no Forge COMPLETE in it: "
            f"another program's folder, or a damaged checkpoint); Forge neither deletes nor saves over it. "
            f"Move it out of {str(output_dir)!r}, or choose another --output_dir.")
    if left.checkpoints and not resuming and not overwrite:
        names = sorted(left.checkpoints, key=lambda name: (step_of(name) is None, step_of(name) or 0, name))
        names += sorted(left.logs)  # steps in step order (checkpoint-2 before checkpoint-10), then the rest
        raise OutputDirInUse(
            f"output_dir={str(output_dir)!r} already holds a run "
            f"({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}). Continue it with --resume "
            f"(resume_from='latest'), write this run to another --output_dir, or pass --overwrite_output_dir "
            f"(overwrite_output_dir=True) to delete that run's checkpoints and logs first.")


def claim_output_dir(output_dir: Path, *, resuming: bool, overwrite: bool, is_main: bool) -> RunLock | None:
    """Make output_dir this run's own, before any model work.

    - A run that does not resume refuses a directory that holds another run's checkpoints, unless `overwrite`:
      then Forge's own files are deleted first (checkpoint folders holding its COMPLETE, final/, its logs) and
      nothing else. A directory with only the logs of a run that stopped before its first checkpoint is taken
      over: there is nothing to resume, so those logs are replaced (and said so). A new run never mixes its
      steps with an old one's.
    - A folder with a step's name that is not Forge's is refused, whatever the flags
      (a save would replace it).
    - The main process holds an exclusive lock on {output_dir}/.forge.lock for the run's lifetime, so a second
      run into the same directory stops with a message instead of interleaving logs and checkpoints.
    - Leftovers of killed saves: N.tmp-PID of a dead process is deleted; N.old-PID is put back as N only when
      every file of it verifies, and the console says so."""
    check_output_dir(output_dir, is_main)
    lock = RunLock(output_dir / LOCK_NAME) if is_main else None
    try:
        check_output_dir_is_free(output_dir, resuming=resuming, overwrite=overwrite, is_main=False)
    except OutputDirInUse:
        if lock is not None:
            lock.release()
        raise
    if not is_main:
        return lock
    for leftover, action in integrity.remove_stale_temporaries(output_dir):
        target = integrity.stale_old_checkpoint(leftover)
        if action == "restored":
            tqdm.write(f"forge: restored checkpoint {target} from {leftover.name}, left by a save that was "
                       f"killed while replacing it (every file verifies against its COMPLETE)")
        elif action == "kept":
            tqdm.write(f"forge: left {leftover} as it is: a leftover of a killed save that is not a whole "
                       f"Forge checkpoint, so it was not put back; delete it or move it out of {output_dir}")
    left = what_is_left(output_dir)
    doomed = (left.checkpoints + left.logs) if overwrite and not resuming else [] if resuming else left.logs
    for name in doomed:
        target = output_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    if doomed and not left.checkpoints:
        tqdm.write(f"forge: {output_dir} held only the logs of a run that stopped before its first "
                   f"checkpoint ({', '.join(doomed)}): there is nothing to resume, so this run starts afresh "
                   f"and replaces them")
    elif doomed:
        tqdm.write(f"forge: --overwrite_output_dir: deleted the earlier run's {', '.join(doomed)} in "
                   f"{output_dir}")
    return lock


class RunLock:
    """An exclusive advisory lock (fcntl.flock) on {output_dir}/.forge.lock, held while a run writes there and
    removed when it ends; the OS drops it when the process dies, so a killed run never leaves a stale lock
    (the file may stay; it is taken over). No lock where fcntl is missing (Windows)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = None
        try:
            import fcntl
        except ImportError:
            return
        while True:
            handle = path.open("a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.seek(0)
                owner = handle.read().strip() or "unknown"
                handle.close()
                raise OutputDirInUse(f"another Forge run (pid {owner}) is writing to {str(path.parent)!r}; "
                                     f"wait for it to finish or choose another output_dir") from None
            if path.exists() and os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
            handle.close()  # the holder removed the file between our open and our lock: take the new one
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            self.path.unlink(missing_ok=True)
            self._file.close()  # closing drops the flock
            self._file = None


class RunLifecycle:
    """Checkpoints of finished steps, and resume, for one run. Only the main process writes (is_main)."""

    def __init__(self, output_dir: str | Path, parts: CheckpointParts, *, save_total_limit: int | None = None,
                 is_main: bool = True):
        self.output_dir = Path(output_dir)
        self.parts = parts
        self.save_total_limit = save_total_limit
        self.is_main = is_main
        self.last_finished: FinishedStep | None = None
        self.saved: tuple[int, Path] | None = None  # (step, path) of the newest checkpoint of this run

    def finished(self, step: FinishedStep) -> None:
        self.last_finished = step

    def save(self, finished: FinishedStep, name: str | None = None) -> Path:
        """Write the checkpoint of `finished` to {output_dir}/checkpoint-{step}/ (or {output_dir}/{name}/).
        Every process calls it: rank 0 writes, and under FSDP2 every rank writes its shards. name="final"
        writes the trained model only (weights or adapter, tokenizer, configs; under FSDP2 the whole gathered
        weights): no optimizer, scheduler or RNG state, which only the numbered checkpoints keep."""
        parts = self.parts
        path = self.output_dir / name if name else checkpoint_dir(self.output_dir, finished.step)
        final = name == "final"
        state = {"global_step": finished.step, "epoch": finished.epoch, "position": finished.position,
                 "nonfinite_in_a_row": finished.nonfinite_in_a_row, "skipped_steps": finished.skipped_steps,
                 "loss_scale": finished.loss_scale, "entropy_control": finished.entropy_control,
                 "micro_batch_size": finished.micro_batch_size, "model_name": parts.run_config["model_name"],
                 "num_input_tokens_seen": finished.num_input_tokens_seen,
                 "is_lora": parts.is_lora, **parts.dataset_identity,
                 "log_history": [{k: v if not isinstance(v, float) or math.isfinite(v) else None  # NaN: null
                                  for k, v in row.items()}
                                 for row in parts.log_history if row["step"] <= finished.step]}
        files = {"model": parts.model, "tokenizer": parts.tokenizer, "optimizer": parts.optimizer,
                 "scheduler": parts.scheduler, "trainer_state": state, "config": parts.run_config,
                 "rng_state": finished.rng_state}
        if parts.sharded_by is not None:
            ckpt.save_sharded_checkpoint(path, **files, ranks=parts.sharded_by, full_weights=final,
                                         training_state=not final)
        elif self.is_main:
            ckpt.save_checkpoint(path, **files, training_state=not final)
        if name is None:
            self.saved = (finished.step, path)
            if self.is_main:
                integrity.prune_checkpoints(self.output_dir, self.save_total_limit)
        return path

    def checkpoint_of_last_step(self, weights_are_of_it: bool) -> Path | None:
        """A checkpoint of the last finished step, written now if this run has none; None before step 1.

        `weights_are_of_it`: no optimizer step is under way, so the weights, optimizer and schedule are still
        those of that step (its RNG state was captured when it finished)."""
        last = self.last_finished
        if last is None or last.step == 0 or not weights_are_of_it:
            return None
        if self.saved is not None and self.saved[0] == last.step:
            return self.saved[1]
        return self.save(last)

    def where_to_resume(self, weights_are_of_last_step: bool = True) -> str:
        """Save the last finished step if needed; say where it is and how to resume."""
        path = self.checkpoint_of_last_step(weights_are_of_last_step)
        if path is not None:
            return (f"The last finished step ({self.last_finished.step}) is saved in {path}. "
                    f"{resume_hint(path)}")
        if self.saved is not None:
            return f"The newest checkpoint is {self.saved[1]}. {resume_hint(self.saved[1])}"
        if self.last_finished is not None and self.last_finished.step > 0:
            return (f"No checkpoint of this run was saved (step {self.last_finished.step} could not be saved "
                    f"at this point): start the run again, with save_steps to keep checkpoints along the "
                    f"way.")
        return "No optimizer step had finished, so there is no checkpoint: start the run again."

    def resume(self, where: str) -> FinishedStep:
        """Load the checkpoint `where` ('latest' = the newest complete one) into the parts; its
        FinishedStep."""
        parts = self.parts
        path = checkpoint_to_resume(self.output_dir, where)
        state = ckpt.load_checkpoint(path)
        saved = fields.check_trainer_state(path, state.trainer_state,
                                           parts.dataset_identity.get("dataset_size"))
        if not isinstance(state.config, dict):
            raise fields.refused(path, integrity.CONFIG_NAME,
                                 f"is a JSON {type(state.config).__name__}, not an object")
        fields.check_compatible(state.config, parts.run_config, checkpoint_path=path)
        check_same_dataset(saved, parts.dataset_identity, path)
        check_same_sharding(path, sharded=parts.sharded_by is not None)
        load_weights_and_optimizer(path, state, parts.model, parts.optimizer,
                                   sharded=parts.sharded_by is not None)
        fields.check_scheduler_state(path, state.scheduler_state)
        with fields.loading(path, integrity.SCHEDULER_NAME):
            parts.scheduler.load_state_dict(state.scheduler_state)
        with fields.loading(path, integrity.RNG_STATE_NAME):
            restore_rng_state(state.rng_state)
        step = int(saved["global_step"])
        self.saved = (step, path)
        parts.log_history[:] = saved.get("log_history", [])  # state.log_history goes on from the checkpoint's
        # This run's learning_rate / weight_decay apply from here on (the saved optimizer state would win).
        changed = apply_new_hyperparameters(parts.optimizer, parts.scheduler,
                                            parts.run_config["learning_rate"],
                                            parts.run_config["weight_decay"])
        if self.is_main:
            tqdm.write(f"forge: resumed from step {step} ({path})"
                       + (f"; applying this run's {', '.join(changed)} from step {step + 1}" if changed
                          else ""))
        newer = [str(p) for s, p in integrity.numbered_checkpoints(self.output_dir) if s > step]
        if newer:
            warnings.warn(f"resuming from step {step} while {self.output_dir} holds later checkpoints "
                          f"{newer} of the earlier run; this run replaces each as it reaches its step, until "
                          f"then resume_from='latest' would pick them", stacklevel=3)
        return FinishedStep(step, int(saved["epoch"]), int(saved["position"]), state.rng_state,
                            int(saved.get("nonfinite_in_a_row", 0)), int(saved.get("skipped_steps", 0)),
                            float(saved.get("loss_scale", 1.0)), saved.get("entropy_control"),
                            saved.get("micro_batch_size"), int(saved.get("num_input_tokens_seen", 0)))


def load_weights_and_optimizer(path: Path, state: ckpt.CheckpointState, model, optimizer,
                               sharded: bool) -> None:
    """The checkpoint's weights and optimizer state into the run's (sharded: on every rank), each field
    checked against the run's first (forge/run/checkpoint_fields.py)."""
    own = fields.hyperparameters(optimizer)
    if sharded:
        ckpt.load_sharded_state(path, model, optimizer)
    else:
        ckpt.load_model_weights(model, path)
        fields.check_optimizer_state(path, state.optimizer_state, optimizer)
        with fields.loading(path, integrity.OPTIMIZER_NAME):
            optimizer.load_state_dict(state.optimizer_state)
    name = integrity.SHARDED_LAYOUT if sharded else integrity.OPTIMIZER_NAME
    fields.check_hyperparameters(path, name, optimizer, own)


def checkpoint_to_resume(output_dir: Path, where: str) -> Path:
    """The checkpoint resume_from=`where` names ('latest': the newest complete one in output_dir);
    FileNotFoundError where there is none, ValueError for a final/ (the trained model only)."""
    path = integrity.latest_checkpoint(output_dir) if where == "latest" else Path(where)
    if path is None:
        raise FileNotFoundError(nothing_to_resume(output_dir))
    if path.name == "final" and not any((path / name).exists() for name in integrity.TRAINING_STATE_NAMES):
        newest = integrity.latest_checkpoint(path.parent)
        raise ValueError(f"cannot resume from {path}: final/ holds the trained model only (no optimizer, "
                         f"schedule or RNG state). Resume from a numbered checkpoint" + (
                             f", the newest is {newest} (--resume, resume_from='latest')" if newest else
                             f"; {path.parent} has none, so start a new run from these weights "
                             f"(--model {path})"))
    return path


def check_before_launch(output_dir: Path, where: str, config: dict[str, Any]) -> Path | None:
    """What `forge train --nproc N` checks of the checkpoint its processes are to resume from, before it
    starts them, so that one that cannot be resumed is refused in one line rather than once per process: it
    exists, every file verifies (against COMPLETE; the shards' safetensors headers too), and the run's
    `config` (GRPOConfig.to_dict()) keeps the settings a resume needs unchanged (the model's name, known only
    once it loads, is left to the processes). Returns it; None where a leftover of a killed save may be put
    back first (the processes decide, `claim_output_dir`)."""
    if where == "latest" and output_dir.is_dir() and any(
            integrity.stale_old_checkpoint(child) is not None for child in output_dir.iterdir()):
        return None
    path = checkpoint_to_resume(output_dir, where)
    integrity.verify_checkpoint(path)
    if integrity.is_sharded(path):
        ckpt.check_shard_files(path)
    saved = ckpt.saved_config(path)
    fields.check_compatible(saved, config, checkpoint_path=path,
                            keys=tuple(k for k in fields.COMPATIBILITY_KEYS if k != "model_name"))
    return path


def nothing_to_resume(output_dir: Path) -> str:
    """What `--resume` says about an output_dir without a numbered checkpoint, and how to start afresh."""
    left = what_is_left(output_dir)
    head = f"resume_from='latest' (--resume) but {output_dir} holds no complete checkpoint"
    if "final" in left.checkpoints:
        return (f"{head}, only final/ (a trained model, without the optimizer state a resume needs). Start a "
                f"new run from its weights: --model {output_dir / 'final'} with another --output_dir.")
    if left.logs:
        return (f"{head}: the run that wrote {', '.join(left.logs)} there stopped before its first "
                f"checkpoint was complete, so there is nothing to resume. To start afresh, run the same "
                f"command without --resume (resume_from=None): it replaces those logs and touches nothing "
                f"else.")
    return f"{head}. To start a run there, run the same command without --resume (resume_from=None)."


def check_same_sharding(path: Path, sharded: bool) -> None:
    """A checkpoint of an FSDP2 run holds shards, one of a data-parallel run the whole model: refuse the
    other."""
    if integrity.is_sharded(path) and not sharded:
        raise ValueError(f"cannot resume from checkpoint {path}: it was saved by an FSDP run (its weights "
                         f"and optimizer are shards in {path / 'sharded'}). Resume with --fsdp and several "
                         f"processes (`forge train --nproc N --fsdp ... --resume`; any N: the shards are "
                         f"redistributed).")
    if sharded and not integrity.is_sharded(path):
        raise ValueError(f"cannot resume from checkpoint {path} with --fsdp: it was saved by a run without "
                         f"FSDP (whole weights and {integrity.OPTIMIZER_NAME}). Resume it without --fsdp, or "
                         f"start a new FSDP run from its weights (--model {path}).")


def check_same_dataset(saved_state: dict, identity: dict, path: Path) -> None:
    """The saved (epoch, position) only means something on the same rows: refuse another size, warn on
    edits."""
    saved_size, size = saved_state.get("dataset_size"), identity.get("dataset_size")
    if saved_size is not None and saved_size != size:
        raise ValueError(
            f"cannot resume from checkpoint {path}: it was trained on a dataset of {saved_size} rows, this "
            f"run has {size}. Resuming would skip or repeat rows; pass the same dataset (and --max_samples), "
            f"or start a fresh run in a new output_dir.")
    if saved_state.get("dataset_fingerprint") not in (None, identity.get("dataset_fingerprint")):
        warnings.warn(f"the dataset's contents changed since checkpoint {path} was saved (same number of "
                      f"rows); resuming at its position anyway", stacklevel=3)


__all__ = [
    "CheckpointParts",
    "FinishedStep",
    "OutputDirInUse",
    "RunLeft",
    "RunLifecycle",
    "RunLock",
    "check_output_dir",
    "check_output_dir_is_free",
    "claim_output_dir",
    "nothing_to_resume",
    "previous_run",
    "resume_hint",
    "what_is_left",
]
