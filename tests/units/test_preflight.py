"""The preflight: it leaves the run unchanged, its table says what the samples showed, and preflight='strict'
stops a run that cannot learn, naming the fix (core/preflight.py)."""

from __future__ import annotations

import math
import re
import signal

import pytest
import torch

from forge import GRPOConfig, GRPOTrainer
from forge.core.preflight import PreflightFailed, format_report, preflight
from forge.core.scoring import RewardError
from forge.model.tiny import build_tiny_model

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


def vowel_count(prompts, completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in text)) for text in completions]


def config(tmp_path, **overrides) -> GRPOConfig:
    values = {"group_size": 4, "prompts_per_step": 2, "gradient_accumulation_steps": 1, "max_new_tokens": 6,
              "learning_rate": 1e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1,
              "save_steps": 0, "max_steps": 3, "kl_beta": 0.05, "output_dir": str(tmp_path / "run")}
    return GRPOConfig(**(values | overrides))


def trainer(tmp_path, reward=vowel_count, **overrides) -> GRPOTrainer:
    model, tokenizer = build_tiny_model(seed=0)
    return GRPOTrainer(model, tokenizer, reward, config(tmp_path, **overrides))


@pytest.mark.parametrize("lora", [False, True])
def test_the_preflight_leaves_the_run_bit_for_bit_as_without_it(tmp_path, lora):
    weights = {}
    for mode in ("warn", "off"):
        run = trainer(tmp_path / mode, preflight=mode, use_lora=lora, lora_r=4, lora_alpha=8)
        run.train(ROWS)
        weights[mode] = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    assert all(torch.equal(weights["warn"][n], weights["off"][n]) for n in weights["off"])


def test_warn_prints_the_table_and_trains(tmp_path, capsys):
    run = trainer(tmp_path)
    run.train(ROWS)
    out = capsys.readouterr().out
    assert "forge preflight: 4 prompts x 4 completions" in out
    assert "reward        vowel_count: mean" in out and "cut at max_new_tokens=6" in out
    assert "first prompt  'What is" in out and run.global_step == 3


def test_the_report_counts_what_each_reward_did(tmp_path):
    def flaky(prompts, completions, **kwargs):  # raises on most batches of one sample, NaN or None on others
        if len(completions) > 1:
            raise RuntimeError("scored one by one from here")
        text = completions[0]
        return [None] if len(text) % 3 == 0 else [math.nan] if len(text) % 3 == 1 else [1.0]

    def constant(prompts, completions, **kwargs):
        return [2.0] * len(completions)

    run = trainer(tmp_path, reward=[flaky, constant], max_new_tokens=4)
    report = preflight(run, ROWS, total_steps=3)
    flaky_check, constant_check = report.rewards
    assert flaky_check.raised == 0.0 and flaky_check.none + flaky_check.nonfinite <= 1.0
    assert (constant_check.mean, constant_check.std, constant_check.raised) == (2.0, 0.0, 0.0)
    assert report.prompts == 4 and report.group_size == 4 and report.max_new_tokens == 4
    assert 0.0 <= report.truncated <= 1.0 and report.step_seconds > 0 and report.run_seconds == pytest.approx(
        3 * report.step_seconds)
    assert report.prompt_as_seen == ROWS[0]["prompt"]
    assert "flaky" in format_report(report)


def test_strict_stops_a_run_whose_reward_never_varies(tmp_path):
    def always_zero(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    run = trainer(tmp_path, reward=always_zero, preflight="strict")
    generated = []
    real_generate = run.sample_completions
    run.sample_completions = lambda prompts, rows=None: generated.append(prompts) or real_generate(prompts, rows)
    with pytest.raises(PreflightFailed, match=r"no group of 4 completions got different rewards.*every group "
                                              r"scored low.*forge screen"):
        run.train(ROWS)
    assert len(generated) == 1 and run.global_step == 0  # only the preflight's rollout


def test_strict_stops_a_reward_that_fails_on_most_samples_and_cut_completions(tmp_path):
    def broken(prompts, completions, **kwargs):
        raise KeyError("answer")

    run = trainer(tmp_path, reward=broken, preflight="strict", max_new_tokens=2)
    with pytest.raises(PreflightFailed) as failure:
        run.train(ROWS)
    message = str(failure.value)
    assert "reward 'broken' failed on 100% of samples (100% raised" in message
    assert "cut at max_new_tokens=2" in message and "raise max_new_tokens" in message


def test_strict_passes_a_run_that_can_learn(tmp_path):
    run = trainer(tmp_path, preflight="strict", max_new_tokens=3, max_steps=1)
    report = preflight(run, ROWS, total_steps=1)
    assert not [p for p in report.problems if "different rewards" in p or "failed on" in p]


def test_plain_prompts_to_a_chat_model_are_pointed_out(tmp_path):
    run = trainer(tmp_path)
    assert run.tokenizer.chat_template  # the tiny tokenizer has one
    report = preflight(run, ROWS, total_steps=3)
    assert any("plain strings but the tokenizer has a chat template" in a for a in report.advice)
    chat_rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "reference": r["reference"]} for r in ROWS]
    chat_report = preflight(run, chat_rows, total_steps=3)
    assert chat_report.prompt_as_seen.startswith("<|user|>What is 2 + 3?</s><|assistant|>")
    assert not any("chat template" in a for a in chat_report.advice)


def test_the_command_line_exits_2_on_a_strict_failure(tmp_path, capsys):
    import json

    from forge.cli import main

    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "reference": r["reference"]}) + "\n" for r in ROWS))
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def zero(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n")
    code = main(["train", "--model", str(tmp_path / "tiny"), "--dataset", str(data), "--reward", f"{rewards}:zero",
                 "--output_dir", str(tmp_path / "out"), "--group_size", "4", "--prompts_per_step", "2",
                 "--max_new_tokens", "4", "--max_steps", "2", "--preflight", "strict"])
    assert code == 2
    assert "no group of 4 completions got different rewards" in capsys.readouterr().err


@pytest.mark.parametrize("on_reward_error", ["raise", "score"])
@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(0)], ids=["KeyboardInterrupt", "SystemExit"])
def test_a_reward_raising_keyboard_interrupt_or_system_exit_in_the_preflight_is_its_failure(
        tmp_path, capsys, error, on_reward_error):
    def interrupts(prompts, completions, **kwargs):
        raise error

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as before train() starts
    try:
        run = trainer(tmp_path, interrupts, on_reward_error=on_reward_error)
        if on_reward_error == "raise":  # the preflight counts it; step 1 stops at it, naming the reward
            with pytest.raises(RewardError, match=f"reward 'interrupts' raised {type(error).__name__}"):
                run.train(ROWS)
        else:
            run.train(ROWS)
            assert run.global_step == 3
    finally:
        signal.signal(signal.SIGINT, previous)
    assert re.search(r"reward        interrupts: .*; raised 100%", capsys.readouterr().out)
