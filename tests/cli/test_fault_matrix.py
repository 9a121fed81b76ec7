"""The fault matrix of one process: SIGINT, SIGTERM, SIGHUP and SIGKILL while a step generates, while it runs
its loss pass, and while its checkpoint is written; then `--resume`.

The killed run is a real `forge train` (watched: two processes), started through `python -c` after importing
PHASE_PAUSE (tests/cli/fault_runs.py), which wraps the trainer's phases (GRPOTrainer.sample_completions,
GRPOTrainer.loss_and_backward) and the checkpoint writer's last act (forge.run.checkpoint.write_manifest,
called before COMPLETE is written and the folder renamed into place): in step 2 (or the save of step 2) it
touches a "ready" file and sleeps there, so the test knows which phase the signal lands in. A stop signal goes
to the process group (Ctrl-C in a terminal, systemd, Slurm); SIGKILL to the training process alone (the
kernel's OOM killer). Then, for every case: the newest complete checkpoint verifies, no temporary of a save is
taken for one, `--resume` (in this process, nothing wrapped) ends the run, and training_log.jsonl holds each
step once.

A stop signal ends the run with exit code 130 and step 2 saved; SIGKILL ends it with exit code 1 and one line
naming how it ended (step 2 saved when the kill came after its checkpoint was renamed, else step 1). One case
per phase runs in the default suite; the rest are marked slow. tests/cli/test_nproc_matrix.py is the same
matrix for `forge train --nproc 2`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fault_runs import (PHASES, SIGNALS, STEPS, alive, children, logged_steps, sighup_at_its_default, train_args,
                        wait_for, write_workspace)

from forge.cli import main as forge_main
from forge.run.integrity import latest_checkpoint, numbered_checkpoints, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
RUN_FORGE = "import sys, phase_pause; from forge.cli import main; sys.exit(main())"
DEFAULT_SUITE = {("SIGTERM", "generation"), ("SIGKILL", "loss"), ("SIGINT", "checkpoint"), ("SIGKILL", "checkpoint")}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_workspace(tmp_path_factory.mktemp("faults"))


def paused_run(root: Path, output_dir: Path, phase: str, pause_seconds: float) -> tuple[subprocess.Popen, Path]:
    ready = output_dir.parent / f"ready-{output_dir.name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAUSE_PHASE": phase, "PAUSE_STEP": "2",
           "READY_FILE": str(ready), "PAUSE_SECONDS": str(pause_seconds),
           "PYTHONPATH": os.pathsep.join([str(root), str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.Popen([sys.executable, "-c", RUN_FORGE, *train_args(root, output_dir)], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                           preexec_fn=sighup_at_its_default)
    wait_for(run, [ready], "the pause")
    return run, ready


def training_process(run: subprocess.Popen) -> int:
    trainers = children(run.pid)
    assert len(trainers) == 1, trainers
    return trainers[0]


CASES = [pytest.param(signum, phase, marks=() if (signum, phase) in DEFAULT_SUITE else pytest.mark.slow,
                      id=f"{signum}-{phase}")
         for signum in SIGNALS for phase in PHASES]


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
