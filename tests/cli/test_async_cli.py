"""Async GRPO from the command line (`forge train --max_staleness 1`): a kill -9, SIGTERM and Ctrl-C leave no
sampling process behind, and `--resume` goes on from the last checkpoint with each step trained once.

The run is a real subprocess; its reward file pauses at a chosen call (one call per optimizer step) after
touching a "ready" file, so the test knows the run is inside that step when it sends the signal. The rollout
worker is the training process's child whose command line is multiprocessing's spawn.
"""

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
from test_resume import REWARD_FILE  # the reward that pauses at a chosen call, as the resume tests use it

STEPS = 6


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_cli")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    rows = [{"prompt": f"What is {a} + {b}?"} for a in range(3) for b in range(3)]
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "rewards.py").write_text(REWARD_FILE)
    return root


def train_args(root: Path, output_dir: Path) -> list[str]:
    return ["train", "--model", str(root / "tiny"), "--dataset", str(root / "data.jsonl"),
            "--reward", f"{root / 'rewards.py'}:text_length", "--output_dir", str(output_dir),
            "--group_size", "4", "--prompts_per_step", "2", "--gradient_accumulation_steps", "1",
            "--max_new_tokens", "8", "--max_steps", str(STEPS), "--save_steps", "2", "--logging_steps", "1",
            "--learning_rate", "0.01", "--seed", "3", "--preflight", "off", "--max_staleness", "1",
            "--sampler_threads", "1"]


def start_and_pause(root: Path, output_dir: Path, pause_at_call: int, pause_seconds: float = 600,
                    **popen) -> subprocess.Popen:
    ready = output_dir.with_suffix(".ready")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FORGE_TEST_PAUSE_AT_CALL": str(pause_at_call),
           "FORGE_TEST_READY": str(ready), "FORGE_TEST_PAUSE_SECONDS": str(pause_seconds)}
    process = subprocess.Popen([sys.executable, "-m", "forge", *train_args(root, output_dir)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    deadline = time.monotonic() + 300
    while not ready.exists():
        if process.poll() is not None:
            pytest.fail(f"forge train exited early ({process.returncode}):\n{process.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("forge train never reached the pause")
        time.sleep(0.1)
    return process


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def rollout_worker(pid: int) -> int:
    """The sampling process under `forge train` (the training process is its child, forge/run/supervisor.py)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        tree, found = [pid], []
        while tree:
            for child in children(tree.pop()):
                tree.append(child)
                command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                if b"spawn_main" in command:
                    found.append(child)
        if found:
            return found[0]
        time.sleep(0.1)
    pytest.fail(f"no rollout worker under pid {pid}")


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited; its parent (init) has yet to reap it
            return True
        time.sleep(0.05)
    return False


def steps_logged(output_dir: Path) -> list[int]:
    path = output_dir / "training_log.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_leaves_no_sampler_and_resume_trains_each_step_once(workspace):
    output_dir = workspace / "killed"
    process = start_and_pause(workspace, output_dir, pause_at_call=4)  # inside step 4
    worker = rollout_worker(process.pid)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    assert gone_within(worker, 10), "the rollout worker outlived its trainer"
    assert steps_logged(output_dir) == [1, 2, 3]
    assert sorted(p.name for p in output_dir.iterdir() if p.is_dir()) == ["checkpoint-2"]

    assert forge_main([*train_args(workspace, output_dir), "--resume"]) == 0  # from 2: step 3 again, once
    assert steps_logged(output_dir) == list(range(1, STEPS + 1))
    log = [json.loads(line) for line in (output_dir / "training_log.jsonl").read_text().splitlines()]
    # the resumed run samples its first step with the checkpoint's weights, then one step off again
    assert [row["async/staleness_max"] for row in log[2:]] == [0.0, 1.0, 1.0, 1.0]
    assert (output_dir / "final" / "COMPLETE").is_file()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_saves_the_step_and_stops_the_sampler_with_the_trainer(workspace):
    output_dir = workspace / "terminated"
    process = start_and_pause(workspace, output_dir, pause_at_call=3, pause_seconds=1.0)
    worker = rollout_worker(process.pid)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert (output_dir / "checkpoint-3" / "COMPLETE").is_file()
    assert gone_within(worker, 10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_to_the_process_group_stops_both_and_saves_the_step(workspace):
    """A terminal's Ctrl-C reaches every process of the group: the worker ignores it, the trainer finishes the
    step, saves it and stops the worker."""
    output_dir = workspace / "interrupted"
    process = start_and_pause(workspace, output_dir, pause_at_call=3, pause_seconds=1.0, start_new_session=True)
    worker = rollout_worker(process.pid)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert (output_dir / "checkpoint-3" / "COMPLETE").is_file()
    assert gone_within(worker, 10)
