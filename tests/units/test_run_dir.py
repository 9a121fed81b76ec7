"""A run owns its output_dir, never leaves a non-finite weight, and a resume applies this run's learning rate.

- a new run into a used output_dir is refused unless overwrite_output_dir, which deletes the old run first, so
  two runs' checkpoints and training_log.jsonl rows never mix;
- two runs at once into one directory: the second is refused (a lock);
- N.tmp-PID directories of killed saves are cleaned at the start of a run;
- an optimizer step that overflows the weights is undone and counted as skipped, never reported as success;
- a changed learning_rate on resume applies from the next step, and the run says so.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model
from forge.run.lifecycle import LOCK_NAME, OutputDirInUse, RunLock

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


def text_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def run(tmp_path, name="run", **overrides) -> GRPOTrainer:
    values = {"group_size": 4, "max_new_tokens": 6, "gradient_accumulation_steps": 1, "learning_rate": 1e-2,
              "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1, "save_steps": 1, "max_steps": 2,
              "kl_beta": 0.0, "output_dir": str(tmp_path / name)}
    model, tokenizer = build_tiny_model()
    return GRPOTrainer(model, tokenizer, text_length, GRPOConfig(**(values | overrides)))


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "training_log.jsonl").read_text().splitlines()]


def test_a_new_run_refuses_a_directory_that_holds_another_run(tmp_path):
    run(tmp_path, max_steps=3).train(ROWS)
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    with pytest.raises(OutputDirInUse, match=r"already holds a run \(checkpoint-1, checkpoint-2, checkpoint-3, "
                                             r"final, samples.jsonl, training_log.jsonl\)\. Continue it with --resume"):
        run(tmp_path, max_steps=2).train(ROWS)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before  # nothing touched
    assert [row["step"] for row in read_log(tmp_path / "run")] == [1, 2, 3]


def test_the_refusal_lists_the_checkpoints_in_step_order(tmp_path):
    run(tmp_path, max_steps=3).train(ROWS)
    (tmp_path / "run" / "checkpoint-3").rename(tmp_path / "run" / "checkpoint-10")  # text order puts 10 first
    with pytest.raises(OutputDirInUse, match=r"already holds a run \(checkpoint-1, checkpoint-2, checkpoint-10, "
                                             r"final, samples.jsonl"):
        run(tmp_path, max_steps=2).train(ROWS)


def test_overwrite_output_dir_replaces_the_old_run_entirely(tmp_path):
    run(tmp_path, max_steps=3).train(ROWS)
    run(tmp_path, max_steps=2, overwrite_output_dir=True).train(ROWS)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-1", "checkpoint-2", "final",
                                                                    "samples.jsonl", "training_log.jsonl"]
    assert [row["step"] for row in read_log(tmp_path / "run")] == [1, 2]  # no step 3 of the old run left


def test_final_holds_the_trained_model_only_and_a_run_resumes_from_its_numbered_checkpoints(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from forge.run.integrity import CheckpointError, verify_checkpoint

    run(tmp_path, max_steps=2).train(ROWS)
    final, last = tmp_path / "run" / "final", tmp_path / "run" / "checkpoint-2"
    names = {p.name for p in final.iterdir()}
    assert not names & {"optimizer.safetensors", "scheduler.safetensors", "rng_state.safetensors"}  # the training state is in 1/ and 2/
    assert {"model.safetensors", "config.json", "tokenizer.json", "forge_config.json", "COMPLETE"} <= names
    assert {"optimizer.safetensors", "scheduler.safetensors", "rng_state.safetensors"} <= {p.name for p in last.iterdir()}
    assert verify_checkpoint(final, require_training_state=False)  # every file matches its sha256
    with pytest.raises(CheckpointError, match="cannot resume a run: optimizer.safetensors was not saved in it"):
        verify_checkpoint(final)
    loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in load_file(last / "model.safetensors").items())
    with pytest.raises(ValueError, match=r"final/ holds the trained model only .* the newest is .*2 \(--resume"):
        run(tmp_path, max_steps=3, resume_from=str(final)).train(ROWS)
    run(tmp_path, max_steps=3, resume_from="latest").train(ROWS)
    assert [row["step"] for row in read_log(tmp_path / "run")] == [1, 2, 3]


def test_an_empty_or_unrelated_directory_is_fine(tmp_path):
    (tmp_path / "run" / "vllm-weights").mkdir(parents=True)  # a run that pushed no weights to vLLM keeps it
    (tmp_path / "run" / "notes.txt").write_text("mine")
    (tmp_path / "run" / "vllm-weights" / "notes.txt").write_text("mine too")
    run(tmp_path, max_steps=1).train(ROWS)
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "run" / "vllm-weights" / "notes.txt").read_text() == "mine too"


def test_a_second_run_into_a_locked_directory_stops_with_the_owners_pid(tmp_path):
    (tmp_path / "run").mkdir()
    held = RunLock(tmp_path / "run" / LOCK_NAME)  # as a live run holds it
    try:
        with pytest.raises(OutputDirInUse, match=r"another Forge run \(pid \d+\) is writing to"):
            run(tmp_path, max_steps=1).train(ROWS)
    finally:
        held.release()
    run(tmp_path, max_steps=1).train(ROWS)  # free again: the run goes ahead
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # and removes its lock when done


def test_temporary_checkpoints_of_dead_processes_are_removed_at_start(tmp_path):
    stale = tmp_path / "run" / "checkpoint-7.tmp-999999999"  # no such process
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"x" * 1000)
    run(tmp_path, max_steps=1).train(ROWS)
    assert not stale.exists()


def test_an_update_that_overflows_the_weights_is_undone_and_counted(tmp_path):
    trainer = run(tmp_path, max_steps=3, save_steps=1)
    corrupted = []

    def overflow_once(optimizer, args, kwargs):  # what an fp16 AdamW step with eps underflow does
        if not corrupted:
            corrupted.append(1)
            with torch.no_grad():
                trainer.trainable[0].view(-1)[:5] = float("inf")

    trainer.optimizer.register_step_post_hook(overflow_once)
    trainer.train(ROWS * 2)
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    log = read_log(tmp_path / "run")
    assert [row["skipped_steps"] for row in log] == [1, 1, 1]  # step 1 was rolled back, steps 2-3 trained
    assert log[0]["param_delta_norm"] == 0 and log[2]["param_delta_norm"] > 0


def test_weights_that_stay_non_finite_abort_with_finite_weights_and_a_checkpoint(tmp_path, capsys):
    trainer = run(tmp_path, max_steps=4, save_steps=0, max_consecutive_nonfinite=2)
    steps = []

    def overflow_from_step_2(optimizer, args, kwargs):
        steps.append(1)
        if len(steps) >= 2:
            with torch.no_grad():
                trainer.trainable[0].view(-1)[0] = float("nan")

    trainer.optimizer.register_step_post_hook(overflow_from_step_2)
    with pytest.raises(FloatingPointError, match=r"2 optimizer steps in a row had a non-finite weight .*"
                                                 r"are finite\. The update overflowed.*\nThe last finished step "
                                                 r"\(2\) is saved in"):
        trainer.train(ROWS * 2)
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    assert (tmp_path / "run" / "checkpoint-2" / "COMPLETE").exists()


def test_resume_applies_a_changed_learning_rate_and_says_so(tmp_path, capsys):
    run(tmp_path, max_steps=2, learning_rate=1e-2).train(ROWS)
    capsys.readouterr()
    run(tmp_path, max_steps=3, learning_rate=3e-3, resume_from="latest").train(ROWS)
    out = capsys.readouterr()
    assert f"resumed from step 2 ({tmp_path / 'run' / 'checkpoint-2'})" in out.out + out.err
    assert "applying this run's learning_rate 0.01 -> 0.003 from step 3" in out.out + out.err
    log = read_log(tmp_path / "run")
    assert [row["step"] for row in log] == [1, 2, 3]
    assert math.isclose(log[2]["learning_rate"], 3e-3) and math.isclose(log[1]["learning_rate"], 1e-2)


def test_resume_with_the_same_settings_changes_nothing(tmp_path, capsys):
    run(tmp_path, max_steps=2).train(ROWS)
    capsys.readouterr()
    run(tmp_path, max_steps=3, resume_from="latest").train(ROWS)
    out = capsys.readouterr()
    assert "resumed from step 2" in out.out + out.err and "applying" not in out.out + out.err


def test_use_trackio_in_the_config_reaches_the_trackio_sink(tmp_path, monkeypatch):
    import sys

    logged = []

    class FakeRun:
        def log(self, metrics, step):
            logged.append(step)

        def finish(self):
            logged.append("finish")

    class FakeTrackio:
        @staticmethod
        def init(project, name, config, **kwargs):
            logged.append(project)
            return FakeRun()

    monkeypatch.setitem(sys.modules, "trackio", FakeTrackio)
    run(tmp_path, max_steps=2, use_trackio=True, trackio_project="mine").train(ROWS)
    assert logged == ["mine", 1, 2, 2, "finish"]  # the steps, then the run's summary (train_runtime, ...)


def test_the_default_evaluator_of_a_tool_run_generates_with_the_tools(tmp_path):
    from forge.tools.calls import calculator

    def calls_made(prompts, completions, tool_calls, **kwargs):  # needs the tool transcript
        return [float(len(calls)) for calls in tool_calls]

    model, tokenizer = build_tiny_model()
    config = GRPOConfig(group_size=4, max_new_tokens=6, gradient_accumulation_steps=1, max_steps=1, save_steps=0,
                        kl_beta=0.0, output_dir=str(tmp_path / "run"))
    trainer = GRPOTrainer(model, tokenizer, [text_length, calls_made], config, tools=[calculator])
    metrics = trainer.evaluator(trainer.model, tokenizer, ROWS, max_new_tokens=6, max_prompt_length=512)
    assert metrics["n"] == 4 and metrics["rewards/calls_made/mean"] == 0.0  # the random model calls nothing


def test_runs_probing_one_output_dir_at_once_never_take_each_others_probe(tmp_path):
    """The write probe of check_output_dir has no name another run can remove: two runs started on one
    output_dir at the same moment both pass it (the lock then decides which trains)."""
    import threading

    from forge.run.lifecycle import check_output_dir

    refused = []

    def probe():
        for _ in range(200):
            try:
                check_output_dir(tmp_path / "out", is_main=True)
            except ValueError as error:
                refused.append(str(error))
                return

    threads = [threading.Thread(target=probe) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert refused == []
    assert list((tmp_path / "out").iterdir()) == []  # no probe left behind
