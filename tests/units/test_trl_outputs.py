"""What a TRL script reads from a run, with only the import changed: what its rewards receive and log, the rows of
`trainer.state.log_history` (TRL's metric names), `trainer.evaluate()`'s keys, and checkpoints that transformers'
`get_last_checkpoint` finds and `train(resume_from_checkpoint=...)` resumes.

TRL's figures are derived from TRL 1.16.0's code (the wheel, trl/trainer/grpo_trainer.py): rewards are called with
`prompts`, `completions`, `completion_ids`, the columns, `trainer_state`, `log_extra` and `log_metric`
(`_calculate_rewards`); a value given to `log_metric(name, value)` is logged under `name`, the mean of the values
since the last log; with `num_iterations=2` a generation is made every `steps_per_generation x num_iterations`
passes (`_prepare_inputs`), and `log` clears the metrics it logs, so the rows of the optimizer steps that reuse a
generation hold the loss's metrics but no reward.
"""

from __future__ import annotations

import json
import os

import pytest
from datasets import Dataset
from transformers.trainer_utils import get_last_checkpoint
from trl_scripts import PROMPTS, trl_args

from forge import GRPOTrainer  # the one line a TRL script changes


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def train_rows(trainer) -> list[dict]:
    return [row for row in trainer.state.log_history if "loss" in row]


# --------------------------------------------------------------------------------------------------
# what rewards receive and log


def test_a_reward_naming_completion_ids_gets_ids_through_forges_own_reward_fn(model_folder, tmp_path):
    seen = []

    def token_count(completions, completion_ids, **kwargs):  # TRL's names, passed Forge's way (reward_fn=)
        seen.append((completions, completion_ids))
        return [float(len(ids)) for ids in completion_ids]

    trainer = GRPOTrainer(model_folder, reward_fn=token_count, args=trl_args(tmp_path, max_steps=1),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()
    completions, ids = seen[0]
    assert all(isinstance(text, str) for text in completions)
    for one_ids, text in zip(ids, completions):  # token ids, at most max_completion_length=8 of them
        assert all(isinstance(i, int) for i in one_ids) and 1 <= len(one_ids) <= 8
        assert trainer.tokenizer.decode(one_ids, skip_special_tokens=True) == text
    assert 1 <= train_rows(trainer)[0]["reward"] <= 8  # a token count, not a character count


def test_a_rewards_log_metric_appears_in_the_log(model_folder, tmp_path):
    logged = []

    def reward_len_logging(completions, log_metric=None, **kwargs):
        lengths = [len(completion) for completion in completions]
        logged.append(sum(lengths) / len(lengths))
        log_metric("completions/mean_chars", logged[-1])
        return [-abs(20 - n) for n in lengths]

    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len_logging, args=trl_args(tmp_path),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()
    assert [row["completions/mean_chars"] for row in train_rows(trainer)] == logged  # one call per step


def test_num_iterations_logs_one_row_per_optimizer_step(model_folder, tmp_path):
    args = trl_args(tmp_path, num_iterations=2, logging_steps=1, max_steps=4)
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()
    rows = train_rows(trainer)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [row["step"] for row in rows if "reward" in row] == [1, 3]  # a generation every 2 optimizer steps
    assert all("grad_norm" in row and "learning_rate" in row for row in rows)


# --------------------------------------------------------------------------------------------------
# evaluate() and log_history under TRL's names


def test_evaluate_returns_trls_keys(model_folder, tmp_path):
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=trl_args(tmp_path),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:3]}))
    metrics = trainer.evaluate()
    for key in ("eval_reward", "eval_reward_std", "eval_rewards/reward_len/mean", "eval_rewards/reward_len/std",
                "eval_completions/mean_length", "eval_completions/min_length", "eval_completions/max_length",
                "eval_completions/clipped_ratio", "eval_completions/mean_terminated_length", "eval_runtime",
                "eval_samples_per_second"):
        assert isinstance(metrics[key], float), key
    assert metrics["eval_reward"] == metrics["eval_rewards/reward_len/mean"]  # one reward of weight 1
    assert metrics["eval_n"] == 3  # Forge's own: the rows evaluated, one greedy completion each
    assert metrics["eval_samples_per_second"] == pytest.approx(3 / metrics["eval_runtime"])
    assert 1 <= metrics["eval_completions/min_length"] <= metrics["eval_completions/max_length"] <= 8
    assert not any(key.startswith("eval/") for key in metrics)


TRL_TRAIN_KEYS = ["loss", "grad_norm", "learning_rate", "num_tokens", "completions/mean_length",
                  "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                  "completions/mean_terminated_length", "completions/min_terminated_length",
                  "completions/max_terminated_length", "rewards/{f}/mean", "rewards/{f}/std", "reward",
                  "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min",
                  "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean", "step_time"]
"""TRL 1.16's GRPOTrainer logs these every logging step (_generate_and_score_completions, _compute_loss, log;
`{f}`: a reward function's name)."""


def test_a_plotting_loop_over_trls_metric_names_in_log_history(model_folder, tmp_path):
    completion_tokens = []

    def reward_len_counting(completions, completion_ids, **kwargs):
        completion_tokens.append(sum(len(ids) for ids in completion_ids))
        return reward_len(completions)

    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len_counting, args=trl_args(tmp_path, beta=0.04),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()
    history = trainer.state.log_history
    curves = {}
    for key in (key.format(f="reward_len_counting") for key in TRL_TRAIN_KEYS):  # a TRL user's plotting code
        curves[key] = ([row["step"] for row in history if key in row], [row[key] for row in history if key in row])
    assert all(steps == [1, 2] for steps, _ in curves.values())
    assert "rewards/reward_len_counting" not in history[0]
    assert "frac_zero_std_groups" not in history[0] and "step_seconds" not in history[0]  # each number once
    # num_tokens counts every completion's prompt and completion tokens so far, as TRL's num_input_tokens_seen
    first, second = curves["num_tokens"][1]
    assert first > completion_tokens[0] and second - first > completion_tokens[1]
    summary = history[-1]  # transformers' last row: this run's time, speed and mean loss
    assert summary["step"] == 2 and summary["train_loss"] == pytest.approx(sum(curves["loss"][1]) / 2)
    assert summary["train_steps_per_second"] * summary["train_runtime"] == pytest.approx(2)
    assert summary["train_samples_per_second"] * summary["train_runtime"] == pytest.approx(2 * 8)  # 8 per step


# --------------------------------------------------------------------------------------------------
# checkpoints that transformers' get_last_checkpoint finds


def logged_steps(output_dir) -> list[int]:
    lines = (output_dir / "training_log.jsonl").read_text().splitlines()
    return [row["step"] for row in map(json.loads, lines) if "loss" in row]


def test_get_last_checkpoint_finds_the_newest_checkpoint_and_train_resumes_from_it(model_folder, tmp_path):
    """The resume lines of transformers' examples and open-r1: `get_last_checkpoint(output_dir)` returns the
    newest `checkpoint-N`, and `train(resume_from_checkpoint=...)` goes on from step N, each step logged once."""
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    args = trl_args(tmp_path, max_steps=2, save_steps=1)
    GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=args, train_dataset=dataset).train()
    last_checkpoint = get_last_checkpoint(args.output_dir)
    assert last_checkpoint == os.path.join(args.output_dir, "checkpoint-2")

    args = trl_args(tmp_path, max_steps=4, save_steps=1)
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=last_checkpoint)
    assert trainer.state.global_step == 4
    assert [row["step"] for row in train_rows(trainer)] == [1, 2, 3, 4]
    assert logged_steps(tmp_path / "out") == [1, 2, 3, 4]
    assert get_last_checkpoint(args.output_dir) == os.path.join(args.output_dir, "checkpoint-4")


def test_an_earlier_forges_plain_numbered_checkpoints_still_resume(model_folder, tmp_path, capsys):
    """An earlier Forge named its checkpoints `{output_dir}/{step}`: `get_last_checkpoint` does not see them,
    but `train(resume_from_checkpoint=True)` (`--resume`) still goes on from the newest, and writes
    `checkpoint-N` from there."""
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    out = tmp_path / "out"
    GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=trl_args(tmp_path, max_steps=2, save_steps=1),
                train_dataset=dataset).train()
    for step in (1, 2):
        (out / f"checkpoint-{step}").rename(out / str(step))
    assert get_last_checkpoint(out) is None

    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len,
                          args=trl_args(tmp_path, max_steps=3, save_steps=1), train_dataset=dataset)
    capsys.readouterr()
    trainer.train(resume_from_checkpoint=True)
    said = capsys.readouterr()
    assert f"forge: resumed from step 2 ({out / '2'})" in said.out + said.err
    assert [row["step"] for row in train_rows(trainer)] == [1, 2, 3] and logged_steps(out) == [1, 2, 3]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["1", "2", "checkpoint-3", "final"]
    assert get_last_checkpoint(out) == str(out / "checkpoint-3")
