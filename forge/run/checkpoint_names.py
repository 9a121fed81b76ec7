"""What a run's numbered checkpoints are called: `{output_dir}/checkpoint-{step}`, as transformers' Trainer
names them (`transformers.trainer_utils.PREFIX_CHECKPOINT_DIR`), so `get_last_checkpoint(output_dir)` and the
scripts that call it to resume (transformers' examples, open-r1) find a Forge run's newest checkpoint.

    checkpoint_dir(output_dir, step)   where the checkpoint of step `step` is written: every save uses it
    step_of(name)                      the step a folder's name says, in either form, or None

An earlier Forge wrote `{output_dir}/{step}` (`out/3`). Those folders are still read (resume, `forge export`,
`forge eval`, pruning, what --overwrite_output_dir deletes), and where a step has both forms,
`checkpoint-{step}` wins; nothing writes them any more.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"
_STEP_NAME = re.compile(r"^(?:checkpoint-)?(\d+)$")  # the second form: an earlier Forge's `{step}`


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint for optimizer step `step` lives: `{output_dir}/checkpoint-{step}`."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}"


def step_of(name: str) -> int | None:
    """The step of a folder named `checkpoint-{step}` (or an earlier Forge's `{step}`), else None."""
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def newest_last(name: str) -> tuple[int, bool]:
    """A sort key for a step folder's name: by step, and `checkpoint-{step}` after an earlier Forge's `{step}`
    of the same step, so the last of a sorted list is the one to resume from."""
    return step_of(name), name.startswith(CHECKPOINT_PREFIX)
