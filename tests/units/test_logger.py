"""ForgeLogger: console format, JSONL rows, resume truncation, disabled ranks, missing backends."""

import json
import math
import sys

import numpy as np
import pytest
import torch

from forge.logging import ForgeLogger


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_console_line_format(tmp_path, capsys):
    logger = ForgeLogger(tmp_path)
    logger.log({"loss": 0.123456, "reward": 0.5, "kl": 0.001}, step=3, epoch=1)
    logger.log({"reward": 1.0}, step=4, epoch=1.5)
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 3 | epoch 1 | loss 0.1235 | reward 0.5000 | kl 0.0010",
        "step 4 | epoch 1.5 | loss n/a | reward 1.0000 | kl n/a",
    ]


def test_an_evaluation_row_prints_its_evaluation_metrics(tmp_path, capsys):
    with ForgeLogger(tmp_path) as logger:
        logger.log({"eval_strict_accuracy": 0.25, "eval_soft_accuracy": 0.5, "eval_format_rate": 1.0, "eval_n": 60,
                    "eval_seconds": 3.2}, step=3, epoch=0)
        logger.log({"eval_reward": 0.4, "eval_rewards/vowels/mean": 0.4, "eval_n": 8}, step=4, epoch=0)
        logger.log({"eval_bleu": 0.125}, step=5, epoch=0)  # an evaluator of the user's: its own metrics
    assert capsys.readouterr().out.splitlines() == [
        "step 3 | eval | strict_accuracy 0.2500 | soft_accuracy 0.5000 | n 60",
        "step 4 | eval | reward 0.4000 | n 8",
        "step 5 | eval | bleu 0.1250",
    ]


def test_forge_warnings_print_as_one_line_and_others_keep_their_format(monkeypatch):
    import warnings

    import forge.run.loop
    from forge.logging import install_warning_format

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # put back after the test
    install_warning_format()
    install_warning_format()  # a second call wraps nothing twice
    ours = warnings.formatwarning("most groups are flat", UserWarning, forge.run.loop.__file__, 84, "code line")
    theirs = warnings.formatwarning("deprecated", FutureWarning, "/site-packages/transformers/x.py", 7, "code line")
    assert ours == "forge: warning: most groups are flat\n"
    assert theirs.startswith("/site-packages/transformers/x.py:7: FutureWarning: deprecated")
    assert theirs.count("forge") == 0


def test_the_command_line_and_a_training_run_install_the_warning_format(tmp_path, monkeypatch):
    import warnings

    from forge import GRPOConfig, GRPOTrainer
    from forge.cli import main
    from forge.model.tiny import build_tiny_model

    plain = warnings.formatwarning
    monkeypatch.setattr(warnings, "formatwarning", plain)
    assert main(["train", "--max_samples", "0"]) == 2
    assert getattr(warnings.formatwarning, "forge_format", False)
    warnings.formatwarning = plain
    model, tokenizer = build_tiny_model()
    config = GRPOConfig(group_size=2, prompts_per_step=2, max_new_tokens=2, max_steps=1, save_steps=0,
                        output_dir=str(tmp_path / "run"))
    GRPOTrainer(model, tokenizer, lambda prompts, completions, **kw: [0.0] * len(completions), config).train(
        [{"prompt": "a", "reference": "1"}, {"prompt": "b", "reference": "2"}])
    assert getattr(warnings.formatwarning, "forge_format", False)


def test_console_false_prints_nothing(tmp_path, capsys):
    with ForgeLogger(tmp_path, console=False) as logger:
        logger.log({"loss": 1.0}, step=1, epoch=0)
    assert capsys.readouterr().out == ""
    assert len(read_rows(tmp_path / "training_log.jsonl")) == 1


def test_jsonl_rows_keep_numeric_metrics(tmp_path):
    with ForgeLogger(tmp_path, console=False) as logger:
        logger.log(
            {
                "loss": torch.tensor(0.25),
                "reward": np.float32(0.5),
                "rewards/format": 1,
                "eval_gsm8k/accuracy": 0.75,
                "clipped": True,
                "completions": ["a", "b"],  # not a number: skipped
                "note": "text",  # not a number: skipped
            },
            step=1,
            epoch=0.5,
        )
        logger.log({"loss": 0.1}, step=2, epoch=1)
    rows = read_rows(tmp_path / "training_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    first = rows[0]
    assert set(first) == {
        "step",
        "epoch",
        "time",
        "loss",
        "reward",
        "rewards/format",
        "eval_gsm8k/accuracy",
        "clipped",
    }
    assert first["epoch"] == 0.5
    assert first["loss"] == 0.25 and first["reward"] == 0.5 and first["clipped"] == 1
    assert first["eval_gsm8k/accuracy"] == 0.75


def test_nan_and_inf_become_null(tmp_path):
    with ForgeLogger(tmp_path, console=False) as logger:
        logger.log({"loss": math.nan, "kl": math.inf, "reward": torch.tensor(float("nan"))}, step=1, epoch=0)
    text = (tmp_path / "training_log.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)
    assert row["loss"] is None and row["kl"] is None and row["reward"] is None


def test_each_row_is_flushed_before_close(tmp_path):
    logger = ForgeLogger(tmp_path, console=False)
    logger.log({"loss": 1.0}, step=1, epoch=0)
    assert len(read_rows(tmp_path / "training_log.jsonl")) == 1
    logger.close()


def test_log_samples_appends(tmp_path):
    with ForgeLogger(tmp_path, console=False) as logger:
        logger.log_samples([{"prompt": "1+1?", "completion": "2", "reward": 1.0}], step=5)
        logger.log_samples([{"prompt": "2+2?", "completion": "5", "reward": torch.tensor(0.0)}], step=6)
    rows = read_rows(tmp_path / "samples.jsonl")
    assert rows == [
        {"step": 5, "prompt": "1+1?", "completion": "2", "reward": 1.0},
        {"step": 6, "prompt": "2+2?", "completion": "5", "reward": 0.0},
    ]


def test_truncate_after_drops_later_rows(tmp_path):
    with ForgeLogger(tmp_path, console=False) as logger:
        for step in range(1, 6):
            logger.log({"loss": float(step)}, step=step, epoch=0)
            logger.log_samples([{"prompt": "p", "completion": "c", "reward": 0.0}], step=step)
        assert logger.last_logged_step() == 5
    # A resumed run from the step-3 checkpoint.
    with ForgeLogger(tmp_path, console=False) as logger:
        logger.truncate_after(3)
        assert logger.last_logged_step() == 3
        logger.log({"loss": 4.5}, step=4, epoch=0)
    rows = read_rows(tmp_path / "training_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[-1]["loss"] == 4.5
    assert [row["step"] for row in read_rows(tmp_path / "samples.jsonl")] == [1, 2, 3]
    assert not list(tmp_path.glob("*.tmp-*"))


def test_truncate_after_drops_a_torn_last_line(tmp_path):
    log_path = tmp_path / "training_log.jsonl"
    log_path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    logger = ForgeLogger(tmp_path, console=False)
    logger.truncate_after(10)
    assert read_rows(log_path) == [{"step": 1, "loss": 1.0}]


def test_truncate_after_leaves_out_lines_that_are_not_rows_and_names_each(tmp_path):
    """A line Forge did not write (an array, JSON nested past the recursion limit, a step that is no number) is
    left out of the log with a one-line warning naming the file and the line; the rows around it stay."""
    log_path = tmp_path / "training_log.jsonl"
    deep = "[" * 200_000 + "]" * 200_000
    log_path.write_text(f'{{"step": 1, "loss": 1.0}}\n[1, 2, 3]\n{deep}\n{{"step": "two"}}\n{{"step": 2, "loss": 2.0}}\n')
    logger = ForgeLogger(tmp_path, console=False)
    with pytest.warns(UserWarning) as caught:
        logger.truncate_after(10)
    assert [str(warning.message) for warning in caught] == [
        f"{log_path}, line 2 is not a JSON object (it holds an array): left out (not a row Forge wrote)",
        (f"{log_path}, line 3 is JSON nested 200,000 levels deep, more than the 100 Forge reads (no file Forge or "
         f"transformers writes nests more than a few): left out (not a row Forge wrote)"),
        f'{log_path}, line 4 has the step "two", not a number: left out (not a row Forge wrote)']
    assert read_rows(log_path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
    assert logger.last_logged_step() == 2


def test_last_logged_step_without_log(tmp_path):
    assert ForgeLogger(tmp_path, console=False).last_logged_step() is None


def test_disabled_logger_writes_nothing(tmp_path, capsys):
    output_dir = tmp_path / "run"
    logger = ForgeLogger(output_dir, enabled=False, use_tensorboard=True, use_wandb=True)
    logger.log({"loss": 1.0}, step=1, epoch=0)
    logger.log_samples([{"prompt": "p"}], step=1)
    logger.truncate_after(0)
    assert logger.last_logged_step() is None
    logger.close()
    assert not output_dir.exists()
    assert capsys.readouterr().out == ""


def test_missing_wandb_warns_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.warns(UserWarning, match="wandb"):
        logger = ForgeLogger(tmp_path, use_wandb=True, console=False)
    logger.log({"loss": 1.0}, step=1, epoch=0)
    logger.close()
    assert len(read_rows(tmp_path / "training_log.jsonl")) == 1


def test_wandb_sink_receives_metrics(tmp_path, monkeypatch):
    calls = []

    class FakeWandb:
        @staticmethod
        def init(project, name, config):
            calls.append(("init", project, name, config))

        @staticmethod
        def log(metrics, step):
            calls.append(("log", metrics, step))

        @staticmethod
        def finish():
            calls.append(("finish",))

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    with ForgeLogger(
        tmp_path, use_wandb=True, wandb_run_name="r1", config={"lr": 1e-5}, console=False
    ) as logger:
        logger.log({"loss": 0.5, "names": ["x"]}, step=7, epoch=0)
    assert calls == [("init", "forge", "r1", {"lr": 1e-5}), ("log", {"loss": 0.5}, 7), ("finish",)]


def test_tensorboard_writes_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    with ForgeLogger(tmp_path, use_tensorboard=True, console=False) as logger:
        logger.log({"loss": 0.5, "kl": math.nan}, step=1, epoch=0)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


# ---------------------------------------------------------------------------------------------------
# trackio


def test_missing_trackio_warns_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.warns(UserWarning, match="trackio is not installed"):
        logger = ForgeLogger(tmp_path, use_trackio=True, console=False)
    logger.log({"loss": 1.0}, step=1, epoch=0)
    logger.close()
    assert len(read_rows(tmp_path / "training_log.jsonl")) == 1


def test_trackio_sink_receives_numeric_metrics(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    class FakeTrackio:
        @staticmethod
        def init(project, name, config, **kwargs):
            calls.append(("init", project, name, config))
            return FakeRun()

    monkeypatch.setitem(sys.modules, "trackio", FakeTrackio)
    with ForgeLogger(tmp_path, use_trackio=True, trackio_project="proj", wandb_run_name="r1", config={"lr": 1e-5},
                     console=False) as logger:
        logger.log({"loss": 0.5, "kl": math.nan, "names": ["x"]}, step=7, epoch=0)
    assert calls == [("init", "proj", "r1", {"lr": 1e-5}), ("log", {"loss": 0.5}, 7), ("finish",)]


def test_a_failing_trackio_init_warns_and_training_goes_on(tmp_path, monkeypatch):
    class BrokenTrackio:
        @staticmethod
        def init(**kwargs):
            raise RuntimeError("no space")

    monkeypatch.setitem(sys.modules, "trackio", BrokenTrackio)
    with pytest.warns(UserWarning, match="trackio.init failed"):
        logger = ForgeLogger(tmp_path, use_trackio=True, console=False)
    logger.log({"loss": 1.0}, step=1, epoch=0)
    logger.close()


TRACKIO_SCRIPT = """
import json, sys
from forge.logging import ForgeLogger
with ForgeLogger(sys.argv[1], use_trackio=True, trackio_project="forge-test", wandb_run_name="run-1",
                 config={"lr": 0.001}, console=False) as logger:
    logger.log({"loss": 0.5, "reward": 1.0}, step=1, epoch=0)
    logger.log({"loss": 0.25, "reward": float("nan")}, step=2, epoch=0)
from trackio.sqlite_storage import SQLiteStorage
logs = SQLiteStorage.get_logs("forge-test", "run-1")
print("LOGS " + json.dumps([{k: v for k, v in row.items() if k in ("step", "loss", "reward")} for row in logs]))
"""


def test_trackio_logs_locally_and_offline(tmp_path):
    """The real trackio, in a subprocess (it reads TRACKIO_DIR when imported): metrics land in a local SQLite
    file under TRACKIO_DIR, with the hub switched off and no Space or server configured."""
    pytest.importorskip("trackio")
    import os
    import subprocess

    env = {key: value for key, value in os.environ.items()
           if key not in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID", "TRACKIO_DATASET_ID")}
    env.update(TRACKIO_DIR=str(tmp_path / "trackio"), HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               HF_HUB_DISABLE_TELEMETRY="1")
    result = subprocess.run([sys.executable, "-c", TRACKIO_SCRIPT, str(tmp_path / "out")], env=env, check=False,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    logs = json.loads(next(line[5:] for line in result.stdout.splitlines() if line.startswith("LOGS ")))
    assert logs == [{"step": 1, "loss": 0.5, "reward": 1.0}, {"step": 2, "loss": 0.25}]
    assert list((tmp_path / "trackio").glob("forge-test*.db"))
    assert len(read_rows(tmp_path / "out" / "training_log.jsonl")) == 2
