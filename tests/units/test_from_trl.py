"""A TRL user's GRPO code runs with only the import changed (docs/from-trl.md).

The scripts below follow the behaviour TRL's documentation describes for GRPOTrainer's quickstart and its reward
functions (written for these tests, on the tiny offline model saved to a folder, which stands in for a hub id):
`GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)`, TRL's config names, and
rewards that receive what TRL gives them: every argument by keyword, completions as text for plain prompts and
as `[{"role": "assistant", "content": ...}]` for chat prompts, `completion_ids` as token ids, each dataset
column by its own name, `trainer_state`.
"""

from __future__ import annotations

import re

import pytest
from datasets import Dataset
from trl_scripts import PROMPTS, trl_args

from forge import GRPOConfig, GRPOTrainer  # the one line a TRL script changes


def test_the_trl_quickstart_runs_with_the_import_changed(model_folder, tmp_path):
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    seen = []

    def reward_len(completions, **kwargs):
        seen.append((completions, kwargs))
        return [-abs(20 - len(completion)) for completion in completions]

    training_args = trl_args(tmp_path)
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
    trainer.train()

    assert trainer.global_step == 2 and (tmp_path / "out" / "final").is_dir()
    assert training_args.group_size == 4 and training_args.max_new_tokens == 8
    assert training_args.prompts_per_step == 2  # 8 completions per device = 2 prompts x 4 generations
    completions, kwargs = seen[0]
    assert all(isinstance(c, str) for c in completions) and len(completions) == 8
    assert set(kwargs) == {"prompts", "completion_ids", "trainer_state", "log_metric", "log_extra"}  # TRL's
    # keywords (TRL 1.16's GRPOTrainer._calculate_rewards); no other column in this dataset
    assert kwargs["prompts"][0] in PROMPTS and kwargs["trainer_state"].global_step == 0
    assert seen[1][1]["trainer_state"].global_step == 1
    tokenizer = trainer.tokenizer
    for ids, text in zip(kwargs["completion_ids"], completions):  # real token ids, not text
        assert all(isinstance(i, int) for i in ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_conversational_rewards_read_the_assistant_message(model_folder, tmp_path):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    contents = []

    def format_reward_func(completions, **kwargs):
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        completion_contents = [completion[0]["content"] for completion in completions]
        contents.extend(completion_contents)
        return [1.0 if re.match(pattern, content) else 0.0 for content in completion_contents]

    trainer = GRPOTrainer(model=model_folder, reward_funcs=[format_reward_func], args=trl_args(tmp_path, max_steps=1),
                          train_dataset=dataset)
    trainer.train()
    assert len(contents) == 8 and all(isinstance(c, str) for c in contents)


def test_dataset_columns_arrive_by_their_own_names(model_folder, tmp_path):
    dataset = Dataset.from_dict({"prompt": PROMPTS, "ground_truth": ["5", "red", "1 2 3", "yes"]})
    received = []

    def reward_func(completions, ground_truth, **kwargs):
        received.append(list(ground_truth))
        matches = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
        answers = [m.group(1) if m else "" for m in matches]
        return [1.0 if a == gt else 0.0 for a, gt in zip(answers, ground_truth)]

    def token_count(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    trainer = GRPOTrainer(model=model_folder, reward_funcs=[reward_func, token_count],
                          args=trl_args(tmp_path, max_steps=1, reward_weights=[1.0, 0.1]), train_dataset=dataset)
    trainer.train()
    truths = received[0]
    assert len(truths) == 8 and set(truths) <= {"5", "red", "1 2 3", "yes"}
    assert truths[0::4] == truths[::4] and len(set(truths[:4])) == 1  # a prompt's 4 completions share its row


def test_a_reward_that_cannot_take_the_call_fails_before_any_model_work(tmp_path):
    """The call's shape is checked when the trainer is built (the model name is never loaded)."""
    def trl_style(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(TypeError, match=r"reward 'trl_style': it takes 1 positional argument.*reward_funcs="):
        GRPOTrainer(model="no/such-model", tokenizer=None, reward_fn=trl_style, config=trl_args(tmp_path))
    with pytest.raises(TypeError, match=r"reward 'lambda': it has positional-only arguments.*reward_fn="):
        GRPOTrainer(model="no/such-model", reward_funcs=lambda p, c, /: [0.0], args=trl_args(tmp_path))


def test_a_reward_argument_no_column_supplies_fails_before_the_first_step(model_folder, tmp_path):
    def needs_a_column(completions, answer):
        return [0.0] * len(completions)

    generated = []
    trainer = GRPOTrainer(model=model_folder, reward_funcs=needs_a_column, args=trl_args(tmp_path),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS, "solution": ["5"] * 4}))
    trainer.sample_completions = lambda prompts, rows=None: generated.append(prompts)
    with pytest.raises(ValueError, match=r"reward 'needs_a_column': it needs \['answer'\].*columns are \['solution'\]"):
        trainer.train()
    assert generated == []


def test_trl_names_in_the_config_and_the_trainer(tmp_path):
    config = GRPOConfig(num_generations=4, max_completion_length=32, per_device_train_batch_size=8, beta=0.0,
                        epsilon=0.3, lr_scheduler_type="linear", report_to=["wandb"], bf16=True)
    assert (config.group_size, config.max_new_tokens, config.prompts_per_step, config.kl_beta, config.clip_epsilon,
            config.lr_scheduler, config.use_wandb, config.use_tensorboard, config.dtype) == (
        4, 32, 2, 0.0, 0.3, "linear", True, False, "bfloat16")
    assert GRPOConfig(loss_type="cispo", epsilon_high=5.0).clip_epsilon_high == 4.0  # TRL caps CISPO at 5.0 itself
    assert GRPOConfig(epsilon_high=0.28).clip_epsilon_high == 0.28
    assert GRPOConfig(use_vllm=True).generation_backend == "vllm"
    assert GRPOConfig(use_vllm=False).generation_backend == "auto"
    with pytest.raises(TypeError, match="unknown GRPOConfig fields \\['num_generation'\\]; num_generation: did "
                                        "you mean num_generations"):
        GRPOConfig(num_generation=4)
    with pytest.raises(TypeError, match="both 'beta' .* and 'kl_beta'"):
        GRPOConfig(beta=0.0, kl_beta=0.1)
    with pytest.raises(TypeError, match="multiple of num_generations=8"):
        GRPOConfig(per_device_train_batch_size=6)


def test_forges_own_rewards_take_either_call():
    """A built-in reward gives the same scores whether it is passed as reward_fn= or TRL's reward_funcs=, chat
    prompts included (where TRL's call gives the completions as assistant messages)."""
    from forge.core.reward import MathCorrectnessReward
    from forge.core.reward_sources import build_reward_list
    from forge.core.scoring import score_completions
    from forge.data.task import math_correctness

    prompts = [[{"role": "user", "content": "2 + 3?"}]] * 3
    completions = ["<answer>5</answer>", "<answer>6</answer>", "it is 5"]
    columns = {"reference": ["5", "5", "5"]}
    for rewards in ([math_correctness], [MathCorrectnessReward()]):
        for convention in ("forge", "trl"):
            scores = score_completions(build_reward_list(rewards, convention=convention), prompts, completions,
                                       columns)
            assert scores.total.tolist() == [1.0, 0.0, 1.0], (rewards, convention)


def test_docs_from_trl_lists_every_name_of_the_table():
    from pathlib import Path

    from forge.core.trl_names import TRL_CONVERTED, TRL_NAMES, TRL_REFUSED

    page = (Path(__file__).resolve().parents[2] / "docs" / "from-trl.md").read_text(encoding="utf-8")
    for name in [*TRL_NAMES, *TRL_NAMES.values(), *TRL_CONVERTED, *TRL_REFUSED]:
        assert f"`{name}`" in page, f"docs/from-trl.md does not mention {name}"
