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

from datasets import Dataset
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
