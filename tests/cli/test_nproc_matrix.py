"""The fault matrix of `forge train --nproc 2`: SIGINT, SIGTERM and SIGHUP to the process group, and SIGKILL
to rank 1 or to rank 0, while step 2 generates, while it runs its loss pass, and while its checkpoint is
written; then `forge train --nproc 2 --resume`. tests/cli/test_fault_matrix.py is the same matrix for one
process.

How the ranks are paused: `forge train --nproc 2` starts torch.distributed's launcher, which starts each rank
as `python -m forge train ...` with the environment of `forge train`. The workspace, first on PYTHONPATH,
holds a sitecustomize.py (tests/cli/fault_runs.py SITECUSTOMIZE), which Python imports as it starts: in a
process with RANK set (a rank, not `forge train` nor the launcher) it imports PHASE_PAUSE, which pauses in the
phase of step 2 (the checkpoint write: rank 0's, the rank that writes a data-parallel checkpoint) for 3
seconds after touching ready-RANK. The test waits for the ready files of the ranks that pause, then sends the
fault: a stop signal to the group of `forge train` (Ctrl-C in a terminal, `timeout`, a job runner: the
launcher and its ranks run in a session of their own, so `forge train` passes it on), or SIGKILL to one rank
(the kernel's out-of-memory killer).

A stop signal: exit code 130, step 2 saved, one "forge: stopped by SIGx after step 2 of 3" line and no error.
SIGKILL of a rank: exit code 1, one line naming that process and "killed by SIGKILL", one naming the saved
step (step 1, or step 2 where rank 0 still finished writing it). Then, for every case: no process of the run
is left, the newest complete checkpoint verifies, and `--resume` ends the run with each step logged once and
no temporary of a save left. Two cases run in the default suite; the rest are marked slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fault_runs import (PHASES, STEPS, alive, children, logged_steps, orphans_of, sighup_at_its_default,
                        train_args, wait_for, write_workspace)

from forge.run.integrity import latest_checkpoint, numbered_checkpoints, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
FAULTS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGKILL-rank1", "SIGKILL-rank0")
DEFAULT_SUITE = {("SIGHUP", "checkpoint"), ("SIGKILL-rank1", "loss")}
CASES = [pytest.param(fault, phase, marks=() if (fault, phase) in DEFAULT_SUITE else pytest.mark.slow,
                      id=f"{fault}-{phase}") for fault in FAULTS for phase in PHASES]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_workspace(tmp_path_factory.mktemp("nproc-faults"))


def environment(root: Path, **pause: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **pause,
            "PYTHONPATH": os.pathsep.join([str(root), str(REPO), os.environ.get("PYTHONPATH", "")])}


def rank_processes(run: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the run's processes: the children of the launcher, the one child of `forge train`."""
    (launcher,) = children(run.pid)
    ranks = {}
    for pid in children(launcher):
        variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        ranks[int(next(v for v in variables if v.startswith(b"RANK=")).split(b"=")[1])] = pid
    assert sorted(ranks) == [0, 1], ranks
    return ranks


@pytest.mark.parametrize("fault, phase", CASES)
def test_a_fault_in_each_phase_of_a_two_process_run_keeps_the_last_checkpoint_and_the_run_resumes(
        workspace, tmp_path, fault, phase):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "forge", *train_args(workspace, out, "--nproc", "2")]
    env = environment(workspace, PAUSE_PHASE=phase, PAUSE_STEP="2", PAUSE_SECONDS="3",
                      READY_FILE=str(tmp_path / "ready-{rank}"))
    run = subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           start_new_session=True, preexec_fn=sighup_at_its_default)
    paused = [0] if phase == "checkpoint" else [0, 1]
    wait_for(run, [tmp_path / f"ready-{rank}" for rank in paused], f"the {phase} of step 2")
    ranks = rank_processes(run)
    killed = int(fault[-1]) if fault.startswith("SIGKILL") else None
    if killed is None:
        os.killpg(run.pid, getattr(signal, fault))
    else:
        os.kill(ranks[killed], signal.SIGKILL)
    _, stderr = run.communicate(timeout=300)

    lines = [line for line in stderr.splitlines() if line.startswith(("forge: error", "forge: stopped"))]
    newest = latest_checkpoint(out)
    if killed is None:
        assert run.returncode == 130, stderr[-3000:]
        assert len(lines) == 1 and lines[0].startswith(f"forge: stopped by {fault} after step 2 of {STEPS}."), \
            stderr[-3000:]
        assert newest == out / "checkpoint-2", newest
    else:
        assert run.returncode == 1, stderr[-3000:]
        assert len([line for line in lines if "killed by SIGKILL" in line]) == 1, stderr[-3000:]
        assert any(f"process {killed} of the run was killed by SIGKILL" in line for line in lines), stderr[-3000:]
        assert (f"forge: error: the 2-process run did not finish; the last finished step is saved in {newest}: "
                "continue with the same command plus --resume") in lines, stderr[-3000:]
        saved = (1, 2) if (killed, phase) == (1, "checkpoint") else (1,)
        assert newest.name in [f"checkpoint-{step}" for step in saved], newest
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr[-3000:]
    assert not [pid for pid in ranks.values() if alive(pid)] and not orphans_of(tmp_path)

    verify_checkpoint(newest)
    resumed = subprocess.run([*command, "--resume"], check=False, env=environment(workspace),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert logged_steps(out) == list(range(1, STEPS + 1))
    assert [step for step, _ in numbered_checkpoints(out)] == list(range(1, STEPS + 1))
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
