"""A full disk during an export, and two runs started on one output folder at the same moment.

A full disk during a checkpoint's write is held by tests/units/test_reliability.py (each write of a save, the
sharded one too, and a full disk mid-run under `forge train`). Here: `forge export` whose weights or tokenizer
cannot be written (ENOSPC injected at the writer transformers uses) says so in one line naming --out, exits 1,
and leaves the earlier export in --out byte for byte, with no temporary beside it. Two `forge train` started
together into one output_dir: one trains, the other stops in one line (the lock, or the first run's
checkpoints) before it writes anything, and the checkpoints that remain verify with each step logged once.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers.modeling_utils
from transformers import PreTrainedTokenizerBase

from forge.cli import main as forge_main
from forge.model.tiny import build_tiny_model
from forge.run.integrity import numbered_checkpoints, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    rows = [{"prompt": f"What is {a} + 1?", "reference": str(a + 1)} for a in range(4)]
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert forge_main(train_args(root, root / "lora", "--use_lora", "true", "--lora_r", "2")) == 0
    return root


def train_args(root: Path, output_dir: Path, *extra: str, steps: int = 1) -> list[str]:
    return ["train", "--model", str(root / "tiny"), "--dataset", str(root / "data.jsonl"), "--output_dir",
            str(output_dir), "--group_size", "2", "--prompts_per_step", "2", "--gradient_accumulation_steps", "1",
            "--max_new_tokens", "2", "--max_steps", str(steps), "--save_steps", "1", "--logging_steps", "1",
            "--preflight", "off", *extra]


def contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("writer", ["weights", "tokenizer"])
def test_a_full_disk_during_an_export_is_one_line_and_the_earlier_export_stays(workspace, tmp_path, capsys,
                                                                              monkeypatch, writer):
    out = tmp_path / "merged"
    argv = ["export", "--adapter", str(workspace / "lora" / "final"), "--base", str(workspace / "tiny"),
            "--out", str(out)]
    assert forge_main(argv) == 0
    before = contents(out)
    if writer == "weights":
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
    else:
        monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
    capsys.readouterr()
    assert forge_main(argv) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forge: ")]
    assert len(lines) == 1, lines
    assert f"cannot write the export to {out}: the disk holding it is full" in lines[0], lines[0]
    assert contents(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no temporary, nothing moved aside


def test_two_runs_started_on_one_output_dir_at_once_one_trains_and_the_other_says_one_line(workspace, tmp_path):
    output_dir = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "forge", *train_args(workspace, output_dir, steps=3)]
    runs = [subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(2)]
    ended = [(run.returncode, stderr) for run in runs for _, stderr in [run.communicate(timeout=300)]]
    codes = sorted(code for code, _ in ended)
    assert codes == [0, 2], ended
    refused = next(stderr for code, stderr in ended if code == 2)
    errors = [line for line in refused.splitlines() if line.startswith("forge: error: ")]
    assert len(errors) == 1 and "Traceback" not in refused, refused
    # the lock while the first run trains; once its first checkpoint is written (a slow start), the run it holds
    lock = "another Forge run" in errors[0] and "is writing to" in errors[0]
    assert lock or "another run" in errors[0] or "already holds a run" in errors[0], errors
    for _, checkpoint in numbered_checkpoints(output_dir):
        verify_checkpoint(checkpoint)
    assert [step for step, _ in numbered_checkpoints(output_dir)] == [1, 2, 3]
    logged = [json.loads(line)["step"] for line in (output_dir / "training_log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3]
