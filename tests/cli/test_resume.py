"""Acceptance: a run killed mid-training and resumed with `forge train --resume` ends exactly like one that ran through.

The tiny model is saved to a folder so the CLI loads it with --model; the reward is a file the CLI imports.
That reward can pause at a chosen call (one call per optimizer step here): it touches a "ready" file and
sleeps, so the test knows the run is inside that step when it sends SIGKILL or SIGTERM. The killed runs are
real subprocesses; the uninterrupted baseline and the resumed runs call the same `forge.cli.main` in this
process (same code, same single thread), which keeps the test short.

Checked: final weights bitwise equal; every logged metric of the steps after the checkpoint equal (only wall
clock fields differ); training_log.jsonl has each step exactly once; samples.jsonl (the sampled completions
and their rewards) identical, which shows the RNG state saved is the one the next step uses.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from forge.cli import main as forge_main
from forge.model.tiny import build_tiny_model

STEPS = 6
WALL_CLOCK_FIELDS = {"time", "step_time", "tokens_per_second", "generation_share"}

REWARD_FILE = '''
import os, pathlib, time

CALLS = 0


def text_length(prompts, completions, **kwargs):
    """Varies inside a group; pauses at call FORGE_TEST_PAUSE_AT_CALL after touching FORGE_TEST_READY."""
    global CALLS
    CALLS += 1
    if CALLS == int(os.environ.get("FORGE_TEST_PAUSE_AT_CALL", "0")):
        pathlib.Path(os.environ["FORGE_TEST_READY"]).touch()
        deadline = time.monotonic() + float(os.environ.get("FORGE_TEST_PAUSE_SECONDS", "600"))
        while time.monotonic() < deadline:
            time.sleep(0.05)
    return [len(text) % 5 / 4 for text in completions]
'''


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    rows = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a in range(3) for b in range(3)]
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "rewards.py").write_text(REWARD_FILE)
    return root


def train_args(root: Path, output_dir: Path) -> list[str]:
    return ["train", "--model", str(root / "tiny"), "--dataset", str(root / "data.jsonl"),
            "--reward", f"{root / 'rewards.py'}:text_length", "--output_dir", str(output_dir),
            "--group_size", "4", "--prompts_per_step", "2", "--gradient_accumulation_steps", "1",
            "--max_new_tokens", "8", "--max_steps", str(STEPS), "--save_steps", "2", "--logging_steps", "1",
            "--learning_rate", "0.01", "--warmup_ratio", "0.2", "--seed", "3",
            "--preflight", "off"]  # the test pauses at the n-th reward call of the steps


@pytest.fixture(scope="module")
def baseline(workspace):
    """The run that was never interrupted."""
    output_dir = workspace / "baseline"
    assert forge_main(train_args(workspace, output_dir)) == 0
    return output_dir


def start_and_pause(root: Path, output_dir: Path, pause_at_call: int, pause_seconds: float) -> subprocess.Popen:
    """Start `forge train` in a subprocess and wait until it is inside step `pause_at_call`'s reward."""
    ready = output_dir.with_suffix(".ready")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FORGE_TEST_PAUSE_AT_CALL": str(pause_at_call),
           "FORGE_TEST_READY": str(ready), "FORGE_TEST_PAUSE_SECONDS": str(pause_seconds)}
    process = subprocess.Popen([sys.executable, "-m", "forge", *train_args(root, output_dir)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ready.exists():
        if process.poll() is not None:
            pytest.fail(f"forge train exited early ({process.returncode}):\n{process.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("forge train never reached the pause")
        time.sleep(0.1)
    return process


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_same_run(resumed_dir: Path, baseline_dir: Path, resumed_from: int) -> None:
    final, expected = load_file(resumed_dir / "final" / "model.safetensors"), \
        load_file(baseline_dir / "final" / "model.safetensors")
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected), "final weights differ from the baseline"
    log, expected_log = read_jsonl(resumed_dir / "training_log.jsonl"), read_jsonl(baseline_dir / "training_log.jsonl")
    assert [row["step"] for row in log] == list(range(1, STEPS + 1))  # each step once: none lost, none twice

    def metrics(row):
        return {k: v for k, v in row.items() if k not in WALL_CLOCK_FIELDS}

    assert [metrics(r) for r in log] == [metrics(r) for r in expected_log]  # steps before too: kept untouched
    assert any(r["step"] > resumed_from and r["param_delta_norm"] > 0 for r in log)
    assert read_jsonl(resumed_dir / "samples.jsonl") == read_jsonl(baseline_dir / "samples.jsonl")


def test_sigkill_then_resume_matches_the_uninterrupted_run(workspace, baseline):
    output_dir = workspace / "killed"
    process = start_and_pause(workspace, output_dir, pause_at_call=4, pause_seconds=600)  # inside step 4
    assert [row["step"] for row in read_jsonl(output_dir / "training_log.jsonl")] == [1, 2, 3]
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    assert sorted(p.name for p in output_dir.iterdir() if p.is_dir()) == ["checkpoint-2"]  # step 3 logged, not saved

    assert forge_main([*train_args(workspace, output_dir), "--resume"]) == 0  # from 2: step 3 runs again
    assert_same_run(output_dir, baseline, resumed_from=2)


def test_sigterm_saves_the_step_exits_130_and_resumes_exactly(workspace, baseline):
    output_dir = workspace / "terminated"
    process = start_and_pause(workspace, output_dir, pause_at_call=3, pause_seconds=1.0)  # inside step 3
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "forge: stopped by SIGTERM after step 3 of 6. The last finished step (3) is saved in" in stderr
    assert "--resume" in stderr
    assert (output_dir / "checkpoint-3" / "COMPLETE").is_file()  # save_steps=2: this one exists because of the signal

    assert forge_main([*train_args(workspace, output_dir), "--resume"]) == 0
    assert_same_run(output_dir, baseline, resumed_from=3)
