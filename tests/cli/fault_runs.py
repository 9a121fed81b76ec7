"""What the fault tests of `forge train` share (tests/cli/test_fault_matrix.py, test_nproc_matrix.py,
test_nproc_failure.py): PHASE_PAUSE, a module that pauses a training process in a phase of a step, and the
checks of what a killed run leaves behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from forge.model.tiny import build_tiny_model

PHASE_PAUSE = '''
"""Pause the training process once, in PAUSE_PHASE of step PAUSE_STEP, after touching READY_FILE (its
"{rank}" replaced by the process's RANK under --nproc)."""
import os, pathlib, time

import forge.core.trainer as trainer_module
import forge.run.checkpoint as checkpoint_module

PHASE, STEP = os.environ["PAUSE_PHASE"], int(os.environ["PAUSE_STEP"])
saves, paused = [], []


def pause():
    if not paused:
        paused.append(True)
        pathlib.Path(os.environ["READY_FILE"].replace("{rank}", os.environ.get("RANK", "0"))).touch()
        time.sleep(float(os.environ["PAUSE_SECONDS"]))


def wrap(name, phase):
    original = getattr(trainer_module.GRPOTrainer, name)

    def in_phase(self, *args, **kwargs):
        if PHASE == phase and self.global_step + 1 == STEP:
            pause()
        return original(self, *args, **kwargs)
    setattr(trainer_module.GRPOTrainer, name, in_phase)


wrap("sample_completions", "generation")
wrap("loss_and_backward", "loss")
write_manifest = checkpoint_module.write_manifest


def in_checkpoint_write(directory):
    saves.append(directory)
    if PHASE == "checkpoint" and len(saves) == STEP:
        pause()
    return write_manifest(directory)


checkpoint_module.write_manifest = in_checkpoint_write
'''
# Python imports a sitecustomize module found on sys.path as it starts: in the processes that `forge train
# --nproc` starts (RANK set), this one imports PHASE_PAUSE when a test asks for a pause (PAUSE_PHASE set)
SITECUSTOMIZE = '''
import os

if "RANK" in os.environ and "PAUSE_PHASE" in os.environ:
    import phase_pause
'''
SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGKILL")
PHASES = ("generation", "loss", "checkpoint")
STEPS = 3


def write_workspace(root: Path) -> Path:
    """The tiny model, 6 prompts, PHASE_PAUSE as phase_pause.py and SITECUSTOMIZE as sitecustomize.py."""
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    rows = [{"prompt": f"What is {a} + 1?", "reference": str(a + 1)} for a in range(6)]
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "phase_pause.py").write_text(PHASE_PAUSE)
    (root / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return root


def train_args(root: Path, output_dir: Path, *extra: str) -> list[str]:
    """`forge train` of STEPS steps on the workspace, saving and logging every step."""
    return ["train", "--model", str(root / "tiny"), "--dataset", str(root / "data.jsonl"), "--output_dir",
            str(output_dir), "--group_size", "2", "--prompts_per_step", "2", "--gradient_accumulation_steps",
            "1", "--max_new_tokens", "4", "--max_steps", str(STEPS), "--save_steps", "1", "--logging_steps", "1",
            "--preflight", "off", *extra]


def sighup_at_its_default() -> None:
    """As in a terminal's run, even when the tests themselves run under nohup (which Forge keeps ignoring)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def wait_for(run, files: list[Path], what: str, timeout: float = 300) -> None:
    """Until every file of `files` exists; the run's stderr if it ends first."""
    deadline = time.monotonic() + timeout
    while not all(file.exists() for file in files):
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the run never reached {what}"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def logged_steps(output_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output_dir / "training_log.jsonl").read_text().splitlines()]


def orphans_of(folder: Path) -> list[int]:
    """Processes still running whose command line names `folder`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(folder).encode() in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
