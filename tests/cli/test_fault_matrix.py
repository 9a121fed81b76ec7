"""The fault matrix of one process: SIGINT, SIGTERM, SIGHUP and SIGKILL while a step generates, while it runs
its loss pass, and while its checkpoint is written; then `--resume`.

The killed run is a real `forge train` (watched: two processes), started through `python -c` after importing
PHASE_PAUSE, which wraps the trainer's phases (GRPOTrainer.sample_completions, GRPOTrainer.loss_and_backward)
and the checkpoint writer's last act (forge.run.checkpoint.write_manifest, called before COMPLETE is written
and the folder renamed into place): in step 2 (or the save of step 2) it touches a "ready" file and sleeps
there, so the test knows which phase the signal lands in. A stop signal goes to the process group (Ctrl-C in a
terminal, systemd, Slurm); SIGKILL to the training process alone (the kernel's OOM killer). Then, for every
case: the newest complete checkpoint verifies, no temporary of a save is taken for one, `--resume` (in this
process, nothing wrapped) ends the run, and training_log.jsonl holds each step once.

A stop signal ends the run with exit code 130 and step 2 saved; SIGKILL ends it with exit code 1 and one line
naming how it ended (step 2 saved when the kill came after its checkpoint was renamed, else step 1). One case
per phase runs in the default suite; the rest are marked slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge.cli import main as forge_main
from forge.model.tiny import build_tiny_model
from forge.run.integrity import latest_checkpoint, numbered_checkpoints, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
PHASE_PAUSE = '''
"""Pause the training process once, in PAUSE_PHASE of step PAUSE_STEP, after touching READY_FILE."""
import os, pathlib, time

import forge.core.trainer as trainer_module
import forge.run.checkpoint as checkpoint_module

PHASE, STEP = os.environ["PAUSE_PHASE"], int(os.environ["PAUSE_STEP"])
saves, paused = [], []


def pause():
    if not paused:
        paused.append(True)
        pathlib.Path(os.environ["READY_FILE"]).touch()
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
RUN_FORGE = "import sys, phase_pause; from forge.cli import main; sys.exit(main())"
STEPS = 3
DEFAULT_SUITE = {("SIGTERM", "generation"), ("SIGKILL", "loss"), ("SIGINT", "checkpoint"), ("SIGKILL", "checkpoint")}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    rows = [{"prompt": f"What is {a} + 1?", "reference": str(a + 1)} for a in range(6)]
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "phase_pause.py").write_text(PHASE_PAUSE)
    return root


def train_args(root: Path, output_dir: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(root / "tiny"), "--dataset", str(root / "data.jsonl"), "--output_dir",
            str(output_dir), "--group_size", "2", "--prompts_per_step", "2", "--gradient_accumulation_steps", "1",
            "--max_new_tokens", "4", "--max_steps", str(STEPS), "--save_steps", "1", "--logging_steps", "1",
            "--preflight", "off", *extra]


def sighup_at_its_default() -> None:
    """As in a terminal's run, even when the tests themselves run under nohup (which Forge keeps ignoring)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def paused_run(root: Path, output_dir: Path, phase: str, pause_seconds: float) -> tuple[subprocess.Popen, Path]:
    ready = output_dir.parent / f"ready-{output_dir.name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAUSE_PHASE": phase, "PAUSE_STEP": "2",
           "READY_FILE": str(ready), "PAUSE_SECONDS": str(pause_seconds),
           "PYTHONPATH": os.pathsep.join([str(root), str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.Popen([sys.executable, "-c", RUN_FORGE, *train_args(root, output_dir)], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                           preexec_fn=sighup_at_its_default)
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached the pause"
        time.sleep(0.05)
    return run, ready


def training_process(run: subprocess.Popen) -> int:
    children = Path(f"/proc/{run.pid}/task/{run.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def logged_steps(output_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output_dir / "training_log.jsonl").read_text().splitlines()]


CASES = [pytest.param(signum, phase, marks=() if (signum, phase) in DEFAULT_SUITE else pytest.mark.slow,
                      id=f"{signum}-{phase}")
         for signum in ("SIGINT", "SIGTERM", "SIGHUP", "SIGKILL") for phase in ("generation", "loss", "checkpoint")]


@pytest.mark.parametrize("signum, phase", CASES)
def test_a_signal_in_each_phase_keeps_the_last_checkpoint_and_the_run_resumes_each_step_once(workspace, tmp_path,
                                                                                             signum, phase):
    output_dir = tmp_path / "out"
    kill = signum == "SIGKILL"
    run, _ = paused_run(workspace, output_dir, phase, pause_seconds=600 if kill else 1.5)
    trainer = training_process(run)
    if kill:
        os.kill(trainer, signal.SIGKILL)
    else:
        os.killpg(run.pid, getattr(signal, signum))
    _, stderr = run.communicate(timeout=300)
    errors = [line for line in stderr.splitlines() if line.startswith("forge: error: ")]
    if kill:
        assert run.returncode == 1 and len(errors) == 1 and "killed by SIGKILL" in errors[0], stderr[-3000:]
    else:
        assert run.returncode == 130, stderr[-3000:]
        assert f"forge: stopped by {signum} after step 2 of {STEPS}" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr and not alive(trainer), stderr[-3000:]

    newest = latest_checkpoint(output_dir)
    verify_checkpoint(newest)
    assert [step for step, _ in numbered_checkpoints(output_dir)][-1] == (1 if kill else 2)
    assert forge_main(train_args(workspace, output_dir, "--resume")) == 0
    assert logged_steps(output_dir) == list(range(1, STEPS + 1))
    assert [step for step, _ in numbered_checkpoints(output_dir)] == list(range(1, STEPS + 1))
    assert not [p.name for p in output_dir.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
