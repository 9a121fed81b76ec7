"""Never lose a run: failing rewards, non-finite numbers, signals, bad input, checkpoints, sandbox, security.

Each failure mode has a test that provokes it on the tiny model and checks three things: the message says
what happened and what to do, nothing bad reached the weights, and a checkpoint to resume from exists.
The CLI-level kill-and-resume acceptance tests live in test_resume.py; hypothesis fuzzing in test_fuzz.py.
"""

import json
import math
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

import forge.core.trainer as trainer_module
from forge import GRPOConfig, GRPOTrainer
from forge.core.reward_sources import build_reward_list
from forge.core.reward_timeouts import RewardTimeout
from forge.core.reward_timeouts import call_with_timeout as _call_with_timeout
from forge.core.scoring import RewardError, reward_kwargs, score_completions
from forge.core.trainer import TrainingInterrupted
from forge.model.tiny import build_tiny_model
from forge.run.integrity import COMPLETE_MARKER, latest_checkpoint, verify_checkpoint
from forge.run.loop import StepFailed
from forge.tools.sandbox import run_python

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]
POISON = "What is poison?"


def text_length(prompts, completions, **kwargs):
    """Varies inside a group, so the advantages are non-zero and the weights move."""
    return [len(text) % 5 / 4 for text in completions]


class PoisonedReward:
    """text_length, but it raises on the poison prompt while `armed`; counts its calls."""

    def __init__(self, armed=True):
        self.armed, self.calls = armed, 0

    def __call__(self, prompts, completions, **kwargs):
        self.calls += 1
        if self.armed and POISON in prompts:
            raise ZeroDivisionError("cannot score poison")
        return text_length(prompts, completions)


def config(tmp_path, **overrides) -> GRPOConfig:
    values = {"preflight": "off", "group_size": 4, "prompts_per_step": 2, "gradient_accumulation_steps": 1, "max_new_tokens": 6,
              "learning_rate": 1e-2, "warmup_ratio": 0.0, "logging_steps": 1, "save_steps": 0, "shuffle": False,
              "max_steps": 2, "output_dir": str(tmp_path / "run")}
    return GRPOConfig(**(values | overrides))


def trainer_for(tmp_path, reward=text_length, model=None, **overrides) -> GRPOTrainer:
    model, tokenizer = build_tiny_model() if model is None else model
    return GRPOTrainer(model, tokenizer, reward, config(tmp_path, **overrides))


def read_log(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "training_log.jsonl").read_text().splitlines()]


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------------
# rewards that fail, inside a run


def test_raising_reward_names_reward_step_row_and_text_and_leaves_a_resumable_checkpoint(tmp_path):
    rows = [*ROWS[:2], {"prompt": POISON, "reference": "0"}, ROWS[2]]  # step 2 holds rows 2 and 3
    clean = trainer_for(tmp_path / "clean", PoisonedReward(armed=False), max_steps=3)
    clean.train(rows)

    failing = trainer_for(tmp_path / "failing", PoisonedReward(), max_steps=3)  # save_steps=0: no checkpoint yet
    with pytest.raises(RewardError) as caught:
        failing.train(rows)
    message = str(caught.value)
    checkpoint = tmp_path / "failing" / "run" / "checkpoint-1"
    assert "reward 'PoisonedReward' raised ZeroDivisionError: cannot score poison at step 2" in message
    assert "dataset row 2" in message and "What is poison?" in message and "on completion 0" in message
    assert f"The last finished step (1) is saved in {checkpoint}" in message and "--resume" in message
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    assert (checkpoint / COMPLETE_MARKER).is_file()
    assert [row["step"] for row in read_log(tmp_path / "failing" / "run")] == [1]

    # The saved state is exactly the end of step 1 (RNG included): resuming repeats the clean run bit for bit.
    resumed = trainer_for(tmp_path / "failing", PoisonedReward(armed=False), max_steps=3, resume_from="latest")
    resumed.train(rows)
    assert same_weights(weights(resumed.model), weights(clean.model))
    clean_log, resumed_log = read_log(tmp_path / "clean" / "run"), read_log(tmp_path / "failing" / "run")
    assert [row["step"] for row in resumed_log] == [1, 2, 3]
    assert [row["reward"] for row in resumed_log] == [row["reward"] for row in clean_log]


def test_raising_reward_before_any_step_ends_with_the_rewards_own_error(tmp_path):
    rows = [{"prompt": POISON, "reference": "0"}, *ROWS[:3]]
    trainer = trainer_for(tmp_path, PoisonedReward())
    with pytest.raises(RewardError) as caught:
        trainer.train(rows)
    message = str(caught.value)  # nothing to resume: no note after the reward's own error
    assert message.startswith("reward 'PoisonedReward' raised ZeroDivisionError: cannot score poison at step 1")
    assert message.endswith("to give failing samples reward_error_value and go on.")
    assert latest_checkpoint(tmp_path / "run") is None


def test_score_mode_counts_errors_and_nonfinite_and_keeps_training(tmp_path):
    def fails_on_first_row(prompts, completions, **kwargs):  # the batch fails; alone, only row 0's samples do
        if ROWS[0]["prompt"] in prompts:
            raise RuntimeError("cannot score row 0")
        return [1.0] * len(completions)

    def nan_for_second(prompts, completions, **kwargs):
        return [float("nan") if i % 4 == 1 else float(i % 2) for i in range(len(completions))]

    trainer = trainer_for(tmp_path, [fails_on_first_row, nan_for_second], on_reward_error="score",
                          reward_error_value=-1.0)
    trainer.train(ROWS)
    log = read_log(tmp_path / "run")
    assert [row["rewards/errors"] for row in log] == [4, 0]  # row 0's group of 4, in step 1
    assert [row["rewards/nonfinite"] for row in log] == [2, 2]  # one per group of 4, two groups per step
    assert all(math.isfinite(row["loss"]) and row["skipped_steps"] == 0 for row in log)


def test_score_mode_error_value_and_counts_unit():
    def boom_on_b(prompts, completions, **kwargs):
        if any("b" in c for c in completions):
            raise ValueError("no b")
        return [1.0] * len(completions)

    rewards = build_reward_list(boom_on_b)
    scores = score_completions(rewards, ["p"] * 3, ["a", "b", "c"], {}, on_error="score", error_value=-2.0)
    assert scores.total.tolist() == [1.0, -2.0, 1.0] and scores.errors == 1 and scores.valid.all()

    with pytest.raises(RewardError) as caught:
        score_completions(rewards, ["p1", "p2", "p3"], ["a", "b" * 500, "c"], {}, step=7, row_index=[4, 9, 11])
    message = str(caught.value)
    assert "reward 'boom_on_b' raised ValueError: no b at step 7, on completion 1 (dataset row 9)" in message
    assert "'" + "b" * 200 + "'" in message and "b" * 201 not in message  # completion text truncated


# sys.exit() / KeyboardInterrupt inside a reward (issue 18): a reward failure, never a silent end of the run


@pytest.fixture
def forge_sigint_handler():
    """A SIGINT handler other than Python's default is installed, as during GRPOTrainer.train()."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    yield
    signal.signal(signal.SIGINT, previous)


def exits_on_b(error):
    def reward(prompts, completions, **kwargs):
        if "b" in completions:
            raise error
        return [1.0] * len(completions)
    return reward


@pytest.mark.parametrize("error, shown", [
    (SystemExit(0), "SystemExit(0) (sys.exit() inside the reward"),
    (SystemExit("bye"), "SystemExit('bye')"),
    (KeyboardInterrupt(), "KeyboardInterrupt"),
])
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["same-thread", "timeout-thread"])
def test_sys_exit_or_keyboard_interrupt_in_a_reward_is_a_reward_failure(error, shown, timeout, forge_sigint_handler):
    rewards = build_reward_list(exits_on_b(error))
    with pytest.raises(RewardError, match=re.escape(f"raised {shown}") + r".* at step 4, on completion 1") as caught:
        score_completions(rewards, ["p"] * 3, ["a", "b", "c"], {}, step=4, timeout=timeout)
    assert caught.value.__cause__ is error
    scores = score_completions(rewards, ["p"] * 3, ["a", "b", "c"], {}, on_error="score", error_value=-1.0,
                               timeout=timeout)
    assert scores.total.tolist() == [1.0, -1.0, 1.0] and scores.errors == 1


def test_the_users_ctrl_c_goes_through_the_scoring(forge_sigint_handler):
    from forge.run.signals import note_user_interrupt

    def interrupted(prompts, completions, **kwargs):  # what Forge's signal handler does inside a reward call
        note_user_interrupt()
        raise KeyboardInterrupt
    for mode in ("raise", "score"):
        with pytest.raises(KeyboardInterrupt):
            score_completions(build_reward_list(interrupted), ["p"], ["a"], {}, on_error=mode)
    # the mark is used up: a KeyboardInterrupt the reward raises itself is its failure again
    with pytest.raises(RewardError, match="raised KeyboardInterrupt"):
        score_completions(build_reward_list(exits_on_b(KeyboardInterrupt())), ["p"], ["b"], {})


def test_without_a_forge_handler_every_keyboard_interrupt_is_the_users():
    # Python's own handler, whatever this test process inherited (a background job starts with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            score_completions(build_reward_list(exits_on_b(KeyboardInterrupt())), ["p"], ["b"], {},
                              on_error="score")
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_reward_calling_sys_exit_stops_the_run_with_a_reward_error_and_a_checkpoint(tmp_path):
    import sys

    def exits_at_poison(prompts, completions, **kwargs):
        if POISON in prompts:
            sys.exit(0)
        return text_length(prompts, completions)

    rows = [*ROWS[:2], {"prompt": POISON, "reference": "0"}, ROWS[2]]
    trainer = trainer_for(tmp_path, exits_at_poison, max_steps=3)
    with pytest.raises(RewardError, match=r"raised SystemExit\(0\).* at step 2") as caught:
        trainer.train(rows)
    assert "The last finished step (1) is saved in" in str(caught.value)
    assert (tmp_path / "run" / "checkpoint-1" / COMPLETE_MARKER).is_file()


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        (lambda n: [1.0] * (n - 1), r"returned 2 scores for 3 completions at step 3; return exactly one"),
        (lambda n: ["1.0"] * n, r"returned '1.0' \(a str\) for completion 0 at step 3; scores must be int or float"),
        (lambda n: None, r"returned None \(a NoneType\) at step 3; it must return a RewardOutput or a list of 3"),
    ],
)
@pytest.mark.parametrize("mode", ["raise", "score"])
def test_malformed_reward_output_is_always_an_error(returned, match, mode):
    rewards = build_reward_list(lambda prompts, completions, **kw: returned(len(completions)))
    with pytest.raises(RewardError, match=match):
        score_completions(rewards, ["p"] * 3, ["a", "b", "c"], {}, on_error=mode, step=3)


def test_nonfinite_reward_raises_or_is_masked_and_counted():
    rewards = build_reward_list(lambda prompts, completions, **kw: [1.0, float("inf"), float("nan"), 0.5])
    with pytest.raises(RewardError, match=r"returned inf for completion 1 \(dataset row 8\) at step 2"):
        score_completions(rewards, ["p"] * 4, list("abcd"), {}, step=2, row_index=[7, 8, 8, 9])
    scores = score_completions(rewards, ["p"] * 4, list("abcd"), {}, on_error="score")
    assert scores.valid.tolist() == [True, False, False, True] and scores.nonfinite == 2
    assert torch.isfinite(scores.total).all()


def test_timeout_raises_or_is_counted_from_any_thread():
    def slow(prompts, completions, **kwargs):
        time.sleep(2)
        return [1.0] * len(completions)

    rewards = build_reward_list(slow)
    results = {}

    def worker():  # not the main thread: no signal-based timeout could work here
        started = time.perf_counter()
        try:
            score_completions(rewards, ["p"] * 2, ["a", "b"], {}, timeout=0.1, step=4)
        except RewardError as error:
            results["error"] = str(error)
        scores = score_completions(rewards, ["p"] * 2, ["a", "b"], {}, timeout=0.1, on_error="score",
                                   error_value=-1.0)
        results["scores"], results["seconds"] = scores, time.perf_counter() - started

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert "reward 'slow' took longer than reward_timeout=0.1s at step 4" in results["error"]
    assert results["scores"].timeouts == 1 and results["scores"].total.tolist() == [-1.0, -1.0]
    assert results["seconds"] < 1.5


def test_a_hung_reward_does_not_keep_the_process_alive():
    release = threading.Event()
    with pytest.raises(RewardTimeout):
        _call_with_timeout(lambda: release.wait(60), 0.05)
    hung = [t for t in threading.enumerate() if t.name == "forge-reward" and t.is_alive()]
    assert hung and all(t.daemon for t in hung)  # a daemon thread never blocks the interpreter's exit
    release.set()


@pytest.mark.filterwarnings("ignore:.*identical rewards")
def test_timeouts_are_logged_in_a_run(tmp_path):
    def slow_once(prompts, completions, **kwargs):
        if "What is 2 + 3?" in prompts:
            time.sleep(1.0)
        return text_length(prompts, completions)

    trainer = trainer_for(tmp_path, slow_once, reward_timeout=0.2, on_reward_error="score")
    trainer.train(ROWS)
    assert [row["rewards/timeouts"] for row in read_log(tmp_path / "run")] == [1, 0]


def test_private_columns_reach_no_reward(tmp_path):
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.append(sorted(kwargs))
        return text_length(prompts, completions)

    trainer_for(tmp_path, spy, max_steps=1).train([{**row, "topic": "sums"} for row in ROWS])
    assert seen == [["references", "topic"]]
    assert reward_kwargs([{"prompt": "p", "_row": 3, "reference": "1"}]) == {"references": ["1"]}


# ----------------------------------------------------------------------------------------------------
# numbers that go bad


def test_nan_gradient_never_steps_the_optimizer_and_aborts_after_k(tmp_path):
    trainer = trainer_for(tmp_path, max_steps=5, max_consecutive_nonfinite=3)
    before = weights(trainer.model)
    first = trainer.trainable[0]
    first.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    optimizer_steps = []
    trainer.optimizer.register_step_post_hook(lambda *args: optimizer_steps.append(1))
    with pytest.raises(FloatingPointError, match=r"3 optimizer steps in a row had a non-finite gradient "
                                                 r"\(last at step 3\); the weights were not updated"):
        trainer.train(ROWS * 2)
    assert optimizer_steps == [] and same_weights(weights(trainer.model), before)
    assert not trainer.optimizer.state  # AdamW moments never saw a NaN
    log = read_log(tmp_path / "run")
    assert [row["skipped_steps"] for row in log] == [1, 2]
    assert all(row["grad_norm"] is None for row in log)  # NaN is logged as null


def test_nan_loss_is_skipped_and_training_recovers(tmp_path, monkeypatch):
    real_loss, calls = trainer_module.grpo_loss, []

    def nan_on_first_step(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan"), stats) if len(calls) == 1 else (loss, stats)

    monkeypatch.setattr(trainer_module, "grpo_loss", nan_on_first_step)
    trainer = trainer_for(tmp_path, max_steps=3, max_consecutive_nonfinite=2)
    before = weights(trainer.model)
    first_step_at = []
    trainer.optimizer.register_step_pre_hook(lambda *args: first_step_at.append(trainer.global_step) and None)
    trainer.train(ROWS * 2)
    assert first_step_at == [1, 2]  # optimizer.step() ran in steps 2 and 3, never in step 1
    assert not same_weights(weights(trainer.model), before)
    assert [row["skipped_steps"] for row in read_log(tmp_path / "run")] == [1, 1, 1]
    assert trainer.guard.nonfinite_in_a_row == 0


def test_flat_rewards_warn_once(tmp_path):
    trainer = trainer_for(tmp_path, lambda prompts, completions, **kw: [1.0] * len(completions), max_steps=2)
    with pytest.warns(UserWarning, match="100% of groups have identical rewards") as caught:
        trainer.train(ROWS)
    assert sum("identical rewards" in str(w.message) for w in caught) == 1
    assert [row["frac_reward_zero_std"] for row in read_log(tmp_path / "run")] == [1.0, 1.0]


# ----------------------------------------------------------------------------------------------------
# signals


def test_sigterm_finishes_the_step_saves_and_says_how_to_resume(tmp_path, capsys):
    class SignalOnStep2:
        def __init__(self):
            self.calls = 0

        def __call__(self, prompts, completions, **kwargs):
            self.calls += 1
            if self.calls == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return text_length(prompts, completions)

    previous = signal.getsignal(signal.SIGTERM)
    trainer = trainer_for(tmp_path, SignalOnStep2(), max_steps=4)
    with pytest.raises(TrainingInterrupted) as caught:
        trainer.train(ROWS * 2)
    assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert str(caught.value).startswith("stopped by SIGTERM after step 2 of 4.")
    assert f"saved in {checkpoint}" in str(caught.value) and "--resume" in str(caught.value)
    assert (checkpoint / COMPLETE_MARKER).is_file() and trainer.global_step == 2
    assert [row["step"] for row in read_log(tmp_path / "run")] == [1, 2]
    # what the signal said will happen is what happened: step 2 finished and was saved
    assert ("forge: SIGTERM received; step 2 finishes, is saved, then the run stops (send SIGTERM again to abandon "
            "step 2: the last finished step (1) is saved)") in capsys.readouterr().out
    assert f"The last finished step (2) is saved in {checkpoint}" in str(caught.value)


def test_a_signal_that_came_both_ways_counts_once_and_nohups_sighup_stays_ignored():
    from forge.run import signals as stop_signals
    from forge.run.signals import StopSignals, relayed_as

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with StopSignals(lambda: 3) as signals:
            signals.under_way = 3
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGTERM)  # sent to the process group: directly ...
            os.kill(os.getpid(), relayed_as(signal.SIGTERM))  # ... and relayed by forge train's watching process
            assert signals.requested == signal.SIGTERM
            with pytest.raises(KeyboardInterrupt):  # a second one, both ways again, abandons the step
                os.kill(os.getpid(), relayed_as(signal.SIGTERM))
                os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGHUP, previous)
        stop_signals._user_interrupt.clear()  # the abandon marked the interrupt as the user's


def test_a_signal_between_steps_stops_at_the_step_that_finished(tmp_path, capsys):
    """A signal while a finished step is logged, evaluated or saved: that step is the one saved, none starts."""
    sent = []

    def evaluator(model, tokenizer, rows, **kwargs):  # runs after step 2, before the stop check
        if not sent:
            sent.append(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return {"reward": 0.0}

    model, tokenizer = build_tiny_model()
    trainer = GRPOTrainer(model, tokenizer, text_length, config(tmp_path, max_steps=4, eval_steps=2),
                          evaluator=evaluator)
    with pytest.raises(TrainingInterrupted) as caught:
        trainer.train(ROWS * 2, eval_dataset=ROWS[:1])
    assert "forge: SIGINT received; step 2 is finished: saving it, then stopping" in capsys.readouterr().out
    assert str(caught.value).startswith("stopped by SIGINT after step 2 of 4. The last finished step (2) is saved")
    assert trainer.global_step == 2


def test_second_signal_abandons_the_step_and_keeps_the_last_finished_one(tmp_path, capsys):
    class DoubleSigintOnStep2:
        def __init__(self):
            self.calls = 0

        def __call__(self, prompts, completions, **kwargs):
            self.calls += 1
            if self.calls == 2:
                os.kill(os.getpid(), signal.SIGINT)  # finish the step, please
                time.sleep(0.05)  # (the handler runs here)
                os.kill(os.getpid(), signal.SIGINT)  # no: now (KeyboardInterrupt inside the reward)
                time.sleep(0.05)
            return text_length(prompts, completions)

    trainer = trainer_for(tmp_path, DoubleSigintOnStep2(), max_steps=4)
    after_step_1 = {}
    original = trainer.step

    def remember(rows):
        metrics = original(rows)
        after_step_1.setdefault("weights", weights(trainer.model))
        return metrics

    trainer.step = remember
    with pytest.raises(TrainingInterrupted, match=r"stopped by a second SIGINT; step 2 was abandoned\. The last "
                                                  r"finished step \(1\) is saved in"):
        trainer.train(ROWS * 2)
    saved = load_file(tmp_path / "run" / "checkpoint-1" / "model.safetensors")
    assert same_weights({k: saved[k] for k in after_step_1["weights"]}, after_step_1["weights"])
    assert same_weights(weights(trainer.model), after_step_1["weights"])  # step 2 never touched them
    printed = capsys.readouterr().out
    assert "step 2 finishes, is saved, then the run stops (send SIGINT again to abandon step 2" in printed
    assert "forge: a second SIGINT: step 2 is abandoned; the last finished step (1) is saved" in printed


# ----------------------------------------------------------------------------------------------------
# checkpoints and resume


def test_save_total_limit_keeps_the_newest_and_latest_skips_incomplete(tmp_path):
    trainer = trainer_for(tmp_path, max_steps=4, save_steps=1, save_total_limit=2)
    trainer.train(ROWS * 2)
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint-3", "checkpoint-4", "final"]
    (run / "checkpoint-4" / COMPLETE_MARKER).unlink()  # as if the save of step 4 had been cut short
    assert latest_checkpoint(run) == run / "checkpoint-3"
    resumed = trainer_for(tmp_path, max_steps=4, save_steps=1, resume_from="latest")
    with pytest.raises(ValueError, match=r"holds checkpoint-4/, named like a Forge checkpoint but not Forge's"):
        resumed.train(ROWS * 2)  # step 4's save would replace a folder without Forge's COMPLETE: moved out first
    (run / "checkpoint-4").rename(tmp_path / "4-cut-short")
    resumed.train(ROWS * 2)
    assert [row["step"] for row in read_log(run)] == [1, 2, 3, 4]  # step 4 logged once, not twice


def test_resuming_before_later_checkpoints_warns_and_replaces_them(tmp_path):
    trainer_for(tmp_path, max_steps=3, save_steps=1).train(ROWS * 2)
    stale = (tmp_path / "run" / "checkpoint-3" / "model.safetensors").stat().st_mtime_ns
    resumed = trainer_for(tmp_path, max_steps=3, save_steps=1, resume_from=str(tmp_path / "run" / "checkpoint-1"))
    with pytest.warns(UserWarning, match=r"resuming from step 1 while .* holds later checkpoints"):
        resumed.train(ROWS * 2)
    assert (tmp_path / "run" / "checkpoint-3" / "model.safetensors").stat().st_mtime_ns != stale
    assert [row["step"] for row in read_log(tmp_path / "run")] == [1, 2, 3]


def test_a_line_of_the_training_log_that_is_not_a_row_is_left_out_with_a_warning_and_the_run_resumes(tmp_path):
    trainer_for(tmp_path, max_steps=2, save_steps=1).train(ROWS)
    log = tmp_path / "run" / "training_log.jsonl"
    first, *rest = log.read_text().splitlines(keepends=True)
    log.write_text(first + "[1, 2, 3]\n" + "".join(rest))  # a line that is JSON but no row
    resumed = trainer_for(tmp_path, max_steps=3, save_steps=1, resume_from="latest")
    with pytest.warns(UserWarning, match=rf"^{re.escape(str(log))}, line 2 is not a JSON object \(it holds an array\)"):
        resumed.train(ROWS)
    assert [row["step"] for row in read_log(tmp_path / "run")] == [1, 2, 3]


def test_save_model_refuses_a_checkpoint_of_the_run_which_still_verifies(tmp_path):
    trainer = trainer_for(tmp_path, max_steps=2, save_steps=1)
    trainer.train(ROWS)
    checkpoint = tmp_path / "run" / "checkpoint-1"
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    with pytest.raises(ValueError, match=rf"save_model\('{re.escape(str(checkpoint))}'\): .* holds a Forge checkpoint"):
        trainer.save_model(str(tmp_path / "run") + "/checkpoint-1")
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before
    verify_checkpoint(checkpoint)
    assert (trainer.save_model(tmp_path / "saved") / "model.safetensors").is_file()  # a new folder: written


class ChangesTheConfig(TrainerCallback):
    """Sets `values` on the config (TRL's `args`) in on_step_end of step 1, as a TRL callback may."""

    def __init__(self, **values):
        self.values = values

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            for name, value in self.values.items():
                setattr(args, name, value)


@pytest.mark.parametrize("change, said", [
    ({"max_new_tokens": 0}, "max_new_tokens=0 must be >= 1"),  # was an IndexError in the next step
    ({"temperature": "hot"}, "temperature='hot' (str) must be a float"),  # a TypeError
    ({"group_size": 0}, "group_size=0: GRPO needs >= 2 completions per prompt"),  # a ZeroDivisionError
    ({"kl_beta": 0.1}, "kl_beta=0.1 needs the frozen reference model"),  # an AttributeError: no reference
    ({"loss_type": "bogus"}, "loss_type='bogus' unknown"),  # a KeyError
    ({"temperature": 0}, "temperature=0 must be > 0"),  # a NaN loss
    ({"group_size": 8}, "group_size=8 (it was 4)"),  # valid, but the run was laid out (and saved) for 4
    ({"use_lora": True}, "use_lora=True (it was False)"),
], ids=["max_new_tokens", "temperature-str", "group_size-0", "kl_beta-without-reference", "loss_type",
        "temperature-0", "group_size-changed", "use_lora"])
def test_a_config_a_callback_breaks_between_steps_stops_the_run_as_a_failed_step(tmp_path, change, said):
    trainer = trainer_for(tmp_path, max_steps=3, kl_beta=0.0)  # a full fine-tune: no reference model
    trainer.add_callback(ChangesTheConfig(**change))
    with pytest.raises(StepFailed) as caught:
        trainer.train(ROWS)
    message = str(caught.value)
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert said in message and "a callback changed the config" in message, message
    assert f"The last finished step (1) is saved in {checkpoint}" in message, message
    assert trainer.global_step == 1 and [row["step"] for row in read_log(tmp_path / "run")] == [1]
    verify_checkpoint(checkpoint)


def test_a_config_change_a_callback_makes_in_on_step_begin_is_checked_before_the_step(tmp_path):
    class Shorter(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                args.max_new_tokens = 0

    trainer = trainer_for(tmp_path, max_steps=3)
    trainer.add_callback(Shorter())
    with pytest.raises(StepFailed, match="max_new_tokens=0 must be >= 1(.|\n)*The last finished step \\(1\\)"):
        trainer.train(ROWS)
    assert trainer.global_step == 1


def test_checkpoint_holds_the_model_name_and_dataset_identity(tmp_path):
    model, tokenizer = build_tiny_model()
    model.config._name_or_path = "my-org/tiny"
    trainer_for(tmp_path, model=(model, tokenizer), max_steps=1, save_steps=1).train(ROWS)
    saved_config = json.loads((tmp_path / "run" / "checkpoint-1" / "forge_config.json").read_text())
    state = json.loads((tmp_path / "run" / "checkpoint-1" / "trainer_state.json").read_text())
    assert saved_config["model_name"] == "my-org/tiny"
    assert state["dataset_size"] == 4 and re.fullmatch(r"[0-9a-f]{16}", state["dataset_fingerprint"])
    assert (state["global_step"], state["epoch"], state["position"], state["skipped_steps"]) == (1, 0, 2, 0)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("model", r"model_name \(saved 'org/model-a', current 'org/model-b'\)"),
        ("group_size", r"group_size \(saved 4, current 2\)"),
        ("dataset", r"trained on a dataset of 4 rows, this run has 3"),
    ],
)
def test_resume_refuses_another_model_config_or_dataset(change, match, tmp_path):
    model, tokenizer = build_tiny_model()
    model.config._name_or_path = "org/model-a"
    trainer_for(tmp_path, model=(model, tokenizer), max_steps=1, save_steps=1).train(ROWS)
    model, tokenizer = build_tiny_model()
    model.config._name_or_path = "org/model-b" if change == "model" else "org/model-a"
    overrides = {"group_size": 2} if change == "group_size" else {}
    rows = ROWS[:3] if change == "dataset" else ROWS
    trainer = trainer_for(tmp_path, model=(model, tokenizer), resume_from="latest", **overrides)
    with pytest.raises(ValueError, match=match) as caught:
        trainer.train(rows)
    assert "cannot resume from checkpoint" in str(caught.value)
    assert trainer.global_step == 0


def test_resume_latest_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"resume_from='latest' \(--resume\) but .* holds no complete "
                                                r"checkpoint\. To start a run there, run the same command without"):
        trainer_for(tmp_path, resume_from="latest").train(ROWS)


# ----------------------------------------------------------------------------------------------------
# bad input (the cases test_trainer.py does not already cover)


def test_prompt_of_the_wrong_type(tmp_path):
    with pytest.raises(ValueError, match=r"dataset row 1: 'prompt' has type int; it must be a non-empty str"):
        trainer_for(tmp_path).train([ROWS[0], {"prompt": 42, "reference": "1"}])


def test_a_gzipped_or_non_utf8_dataset_names_the_file_and_line(tmp_path):
    import gzip

    from forge.data.dataset import load_rows

    good = '{"prompt": "What is 2 + 3?", "reference": "5"}\n'
    packed = tmp_path / "train.jsonl.gz"
    packed.write_bytes(gzip.compress(good.encode()))
    with pytest.raises(ValueError, match=re.escape(f"{packed} is a gzip-compressed file, not JSON Lines text")):
        load_rows(packed)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(good.encode() + '{"prompt": "Caf\u00e9?", "reference": "1"}\n'.encode("latin-1"))
    # line 2 is {"prompt": "Caf + 0xe9: the 16th byte, which UTF-8 cannot start a character with
    with pytest.raises(ValueError, match=re.escape(f"{latin1}, line 2: not UTF-8 text (byte 0xe9 at column 16)")):
        load_rows(latin1)
    with_bom = tmp_path / "bom.jsonl"
    with_bom.write_bytes(b"\xef\xbb\xbf" + good.encode())  # what some Windows editors write: still fine
    assert load_rows(with_bom) == [{"prompt": "What is 2 + 3?", "reference": "5"}]


def test_output_dir_not_writable(tmp_path):
    (tmp_path / "file").write_text("x")
    trainer = trainer_for(tmp_path, output_dir=str(tmp_path / "file" / "run"))
    with pytest.raises(ValueError, match=r"output_dir=.*file/run' is not writable .*; choose another"):
        trainer.train(ROWS)


def test_prompts_per_step_must_split_over_processes(tmp_path):
    trainer = trainer_for(tmp_path, prompts_per_step=2)
    trainer.dist.world_size = 3
    with pytest.raises(ValueError, match=r"prompts_per_step=2 must be divisible by the number of processes \(3\)"):
        trainer.train(ROWS)


def test_prompt_longer_than_the_context(tmp_path):
    long_prompt = "What is 12 + 7? " * 200  # far over the 512-token context of the tiny model
    with pytest.raises(ValueError, match=r"prompt 0 has \d+ tokens, over max_prompt_length=506"):
        trainer_for(tmp_path).train([{"prompt": long_prompt, "reference": "1"}, *ROWS])


# ----------------------------------------------------------------------------------------------------
# sandbox for untrusted code


def test_sandbox_runs_normal_code_and_returns_its_output():
    result = run_python("import sys\nprint(sum(range(10)))\nprint('warn', file=sys.stderr)")
    assert result.ok and result.stdout == "45\n" and result.stderr == "warn\n" and not result.timed_out


def test_sandbox_reports_exit_status_and_reads_stdin():
    result = run_python("import sys\nprint(sys.stdin.read()[::-1])\nsys.exit(3)", stdin="abc")
    assert (result.stdout, result.returncode, result.ok) == ("cba\n", 3, False)


def test_sandbox_kills_an_infinite_loop_and_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    program = (f"import subprocess\nchild = subprocess.Popen(['sleep', '300'])\n"
               f"open({str(pid_file)!r}, 'w').write(str(child.pid))\nwhile True:\n    pass")
    started = time.perf_counter()
    result = run_python(program, timeout=1, namespaces=False)  # it writes a file; namespaces: test_sandbox.py
    assert result.timed_out and result.returncode == -signal.SIGKILL and not result.ok
    assert time.perf_counter() - started < 30
    assert not _running(int(pid_file.read_text()))  # the grandchild went with it


def _running(pid: int, wait: float = 5.0) -> bool:
    """Whether `pid` is still a live (not zombie) process after up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.05)
    return True


def test_sandbox_stops_a_memory_hog():
    result = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))", memory_mb=256, timeout=30)
    assert result.memory_exceeded and not result.ok and not result.timed_out


def test_sandbox_inherits_no_secrets_and_caps_output(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    result = run_python("import os\nprint(os.environ.get('OPENAI_API_KEY'))\nprint(os.getcwd())")
    assert result.stdout.splitlines()[0] == "None" and "forge-sandbox-" in result.stdout
    flood = run_python("while True:\n    print('x' * 1000)", output_limit_kb=16, timeout=10)
    assert len(flood.stdout) <= 16 * 1024 and not flood.ok


# ----------------------------------------------------------------------------------------------------
# security: no pickle of untrusted data, no eval/exec of data


PACKAGE = Path(__file__).resolve().parents[2] / "forge"


def test_nothing_in_the_package_calls_torch_load_or_torch_save():  # checkpoints are safetensors and JSON
    calls = [f"{path.relative_to(PACKAGE)}: {line.strip()}" for path in PACKAGE.rglob("*.py")
             for line in path.read_text().splitlines()
             if re.search(r"\btorch\.(load|save)\(", line) and not line.lstrip().startswith("#") and "`" not in line]
    assert calls == []


def test_a_pytorch_model_bin_folder_loads_and_pickled_code_in_it_never_runs(tmp_path):
    import pickle

    from forge.model import load_model

    model, tokenizer = build_tiny_model()
    model.config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # the pre-safetensors format
    loaded, _ = load_model(str(tmp_path))
    assert all(torch.equal(tensor, loaded.state_dict()[name]) for name, tensor in model.state_dict().items())

    ran = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"model.norm.weight": Payload()}))
    with pytest.raises(Exception, match="Weights only load failed"):  # torch's UnpicklingError
        load_model(str(tmp_path))
    assert not ran.exists()


def test_no_eval_exec_or_pickle_in_the_package():
    pattern = re.compile(r"(?<![\w.])(eval|exec)\(|\bimport pickle\b|\bpickle\.loads?\(|\bmarshal\.loads\(")
    hits = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}" for path in PACKAGE.rglob("*.py")
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    # The one pickle: a tool worker (tool_isolation='process') loads the tool object the trainer itself pickled
    # for it (a functools.partial, an instance); nothing read from disk, a checkpoint or a tool's reply.
    allowed = ["tools/worker.py: import pickle",
               ("tools/worker.py: return pickle.loads(base64.b64decode(reference[\"data\"]))  # written by the "
                "trainer, not by a tool")]
    assert [hit.split(":", 2)[0] + ":" + hit.split(":", 2)[2] for hit in hits] == allowed


def test_remote_code_is_off_unless_asked():
    import inspect

    from forge.model import loading as policy

    assert inspect.signature(policy.load_model).parameters["trust_remote_code"].default is False
    assert "trust_remote_code=True" not in "".join(p.read_text() for p in PACKAGE.rglob("*.py"))
