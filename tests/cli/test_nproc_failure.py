"""`forge train --nproc 2` when a process dies mid-run: one line names the process and how it ended, one says
which step is saved for --resume, and no launcher traceback is printed; the exit code is 1."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_runs import orphans_of

from forge.model.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
REWARD = '''
import os, signal


def dies_on_rank_1_at_step_2(prompts, completions, **kwargs):
    """Rank 1's second call ends its process: os._exit(3), or the signal FORGE_TEST_SIGNAL names."""
    path = os.path.join(os.environ["FORGE_TEST_DIR"], "calls-" + os.environ["RANK"])
    calls = int(open(path).read()) + 1 if os.path.exists(path) else 1
    open(path, "w").write(str(calls))
    if os.environ["RANK"] == "1" and calls == 2:
        if "FORGE_TEST_SIGNAL" in os.environ:
            os.kill(os.getpid(), getattr(signal, os.environ["FORGE_TEST_SIGNAL"]))
        else:
            os._exit(3)
    return [float(len(c) % 3) for c in completions]
'''


def two_process_run(tmp_path: Path, module: str, source: str, reward: str) -> tuple[list[str], dict, Path]:
    """(command, environment, output dir) of a 3-step `forge train --nproc 2` on the tiny model, saving every step,
    with the reward `reward` of a module `module` written from `source`."""
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / f"{module}.py").write_text(source)
    rows = [{"prompt": f"What is {a} + 1?", "reference": str(a + 1)} for a in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FORGE_TEST_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "out"
    command = [sys.executable, "-m", "forge", "train", "--nproc", "2", "--model", str(tmp_path / "tiny"),
               "--dataset", str(tmp_path / "data.jsonl"), "--reward", f"{module}:{reward}",
               "--group_size", "2", "--prompts_per_step", "2", "--gradient_accumulation_steps", "1",
               "--max_new_tokens", "4", "--max_steps", "3", "--save_steps", "1", "--preflight", "off",
               "--output_dir", str(out)]
    return command, env, out


def test_a_process_that_dies_is_named_and_the_saved_step_is_given(tmp_path):
    command, env, out = two_process_run(tmp_path, "dying", REWARD, "dies_on_rank_1_at_step_2")
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    # process 0 is either stopped by the launcher or ends first on its lost collective (exit 1): both are named
    assert any(line.startswith("forge: error: ") and "process 1 of the run exited with code 3" in line
               for line in done.stderr.splitlines()), done.stderr[-3000:]
    assert (f"forge: error: the 2-process run did not finish; the last finished step is saved in "
            f"{out / 'checkpoint-1'}: continue with the same command plus --resume") in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr


def test_the_failure_line_names_who_failed_and_who_was_stopped():
    from types import SimpleNamespace as Failure

    from forge.parallel.launch import failures_line

    assert failures_line({0: Failure(exitcode=-15), 1: Failure(exitcode=3)}) == (
        "process 1 of the run exited with code 3 (its own output is above); the launcher then stopped process 0")
    assert failures_line({0: Failure(exitcode=1), 1: Failure(exitcode=-9), 2: Failure(exitcode=-15)}) == (
        "process 0 of the run exited with code 1, process 1 of the run was killed by SIGKILL (the kernel's "
        "out-of-memory killer sends it when memory runs out: see `dmesg`) (each one's own output is above); the "
        "launcher then stopped process 2")
    assert failures_line({0: Failure(exitcode=-15)}) == "process 0 of the run was killed by SIGTERM (its own output is above)"


def test_a_run_stopped_as_asked_is_told_from_a_failure_whichever_process_ended_first():
    """A stop signal to one process: rank 0 exits 130 after saying where it saved, the others exit 0 or, when
    rank 0 ended first, are stopped by the launcher (SIGTERM); anything else is a failure."""
    from types import SimpleNamespace as Failure

    from forge.parallel.launch import stopped_on_a_signal

    assert stopped_on_a_signal({0: Failure(exitcode=130)})
    assert stopped_on_a_signal({0: Failure(exitcode=130), 1: Failure(exitcode=-15)})
    assert stopped_on_a_signal({0: Failure(exitcode=130), 1: Failure(exitcode=130)})
    assert not stopped_on_a_signal({1: Failure(exitcode=130)})  # rank 0 never said where it saved
    assert not stopped_on_a_signal({0: Failure(exitcode=-15), 1: Failure(exitcode=130)})
    assert not stopped_on_a_signal({0: Failure(exitcode=130), 1: Failure(exitcode=1)})
    assert not stopped_on_a_signal({0: Failure(exitcode=130), 1: Failure(exitcode=-9)})


PAUSING = '''
import os, pathlib, time


def pauses_at_step_2(prompts, completions, **kwargs):
    path = os.path.join(os.environ["FORGE_TEST_DIR"], "calls-" + os.environ["RANK"])
    calls = int(open(path).read()) + 1 if os.path.exists(path) else 1
    open(path, "w").write(str(calls))
    if calls == 2:
        pathlib.Path(os.environ["FORGE_TEST_DIR"], "ready-" + os.environ["RANK"]).touch()
        time.sleep(3)
    return [float(len(c) % 3) for c in completions]
'''


@pytest.mark.parametrize("to_the_group", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["kill-INT-forge-train", "ctrl-c"])  # forge train alone passes it on as a group
def test_sigint_to_a_two_process_run_finishes_the_step_saves_it_and_exits_130(tmp_path, to_the_group):
    command, env, out = two_process_run(tmp_path, "pausing", PAUSING, "pauses_at_step_2")
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # its own process group, as a terminal's foreground job
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)):
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached step 2"
        time.sleep(0.1)
    if to_the_group:
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    else:
        os.kill(run.pid, signal.SIGINT)  # kill -INT, timeout -s INT, Popen.send_signal: forge train alone
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 130, stderr[-3000:]
    assert "forge: stopped by SIGINT after step 2 of 3" in stderr, stderr[-3000:]
    assert "a second SIGINT" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert (out / "checkpoint-2" / "COMPLETE").is_file() and not (out / "checkpoint-3").exists()


@pytest.mark.parametrize("name", ["SIGTERM", pytest.param("SIGKILL", marks=pytest.mark.slow)])  # SIGKILL ends
# a process as the os._exit case above does
def test_a_signal_to_one_process_of_a_two_process_run_ends_the_run_in_lines_and_keeps_the_saved_step(tmp_path,
                                                                                                     name):
    """SIGTERM or SIGKILL to one rank alone (an operator's `kill PID`, a scheduler preempting one process, the
    kernel's out-of-memory killer): the run ends, no process is left, the output names what happened, and the
    last finished step is a checkpoint that --resume continues from."""
    command, env, out = two_process_run(tmp_path, "dying", REWARD, "dies_on_rank_1_at_step_2")
    command, env["FORGE_TEST_SIGNAL"] = [*command, "--logging_steps", "1"], name
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith(("forge: error", "forge: stopped"))]
    assert done.returncode == (130 if name == "SIGTERM" else 1), done.stderr[-3000:]
    if name == "SIGTERM":  # every process finishes step 2 and stops, as after a stop signal to the group
        assert errors == [f"forge: stopped by a signal after step 2 of 3. The last finished step (2) is saved in "
                          f"{out / 'checkpoint-2'}. Resume with the same command plus --resume (`forge train ... "
                          f"--resume`), or in Python with GRPOConfig(..., resume_from='{out / 'checkpoint-2'}')."]
    else:
        assert any("process 1 of the run was killed by SIGKILL" in line for line in errors), errors
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr[-3000:]
    assert errors, done.stderr[-3000:]
    assert not orphans_of(tmp_path)
    assert (out / "checkpoint-1" / "COMPLETE").is_file(), done.stderr[-3000:]
    resumed = subprocess.run([*command, "--resume"], check=False, env=env,  # rank 1's calls go on from 3
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logged = [json.loads(line)["step"] for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3], logged  # each step once


def test_a_resume_with_other_settings_is_refused_in_one_line_before_any_process_starts(tmp_path):
    """The settings a resume needs unchanged (checkpoint_fields.COMPATIBILITY_KEYS) are compared in `forge train`
    itself: one refusal, exit 2, and no process of the run started to print it again."""
    from forge import GRPOConfig, GRPOTrainer

    source = "def length(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    command, env, out = two_process_run(tmp_path, "lengths", source, "length")
    rows = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    model, tokenizer = build_tiny_model(seed=0)
    config = GRPOConfig(group_size=2, prompts_per_step=2, gradient_accumulation_steps=1, max_new_tokens=4,
                        max_steps=1, save_steps=1, preflight="off", output_dir=str(out))
    GRPOTrainer(model, tokenizer, reward_fn=lambda prompts, completions, **kwargs: [1.0] * len(completions),
                config=config).train(rows)
    done = subprocess.run([*command, "--resume", "--group_size", "4"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert [line for line in done.stderr.splitlines() if "error" in line] == [
        f"forge: error: cannot resume from checkpoint {out / 'checkpoint-1'}: its config differs from this run's in "
        f"group_size (saved 2, current 4); set these back to the saved values to resume, or start a fresh run (a new "
        f"output_dir, or resume_from=None)."]
