"""TRL's own scripts and the scripts of TRL's, transformers' and the HF cookbook's documentation, run with
only the import changed (`from forge import GRPOConfig, GRPOTrainer`), their lengths and steps shortened, the
tiny model saved to a folder in place of a hub id and a few local rows in place of a hub dataset.

Each run trains as many optimizer steps, on as many prompts and completions per step, as TRL 1.16.0 computes
for that config (`trl_batches` in trl_scripts.py derives TRL's figures from its code, citing it; `Counts`
records what each Forge step trained on). TRL's trl/scripts/grpo.py runs as TRL ships it, from the installed
TRL (`pip install 'forge-rl[bench]'`; skipped without it); examples/scripts/gspo.py, which TRL's wheel does
not hold, line by line.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from transformers.trainer_utils import get_last_checkpoint
from trl_scripts import PROMPTS, CountedTrainer, Counts, trl_batches

from forge import GRPOConfig, GRPOTrainer  # the one line a TRL script changes

MORE_PROMPTS = [*PROMPTS, "Spell cat.", "Name a fruit.", "What is 1 + 1?", "Say no."]


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def chat(prompts: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": prompt}] for prompt in prompts]


# --------------------------------------------------------------------------------------------------
# TRL's example scripts, through TrlParser with ModelConfig


def test_trls_grpo_script_runs_as_trl_ships_it(model_folder, tmp_path, monkeypatch, capsys):
    """trl/scripts/grpo.py (TRL 1.16.0's wheel): make_parser() and main(), TRL's flags on its command line,
    with `from trl import GRPOConfig, GRPOTrainer` giving Forge's classes."""
    trl = pytest.importorskip("trl")
    from trl.scripts import grpo as script

    made = []

    class Trainer(CountedTrainer, GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(trl, "GRPOConfig", GRPOConfig)  # what the changed import does
    monkeypatch.setattr(trl, "GRPOTrainer", Trainer)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in chat(MORE_PROMPTS)))
    flags = {"num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
             "max_steps": 2}
    argv = ["--model_name_or_path", model_folder, "--dataset_name", str(data), "--reward_funcs",
            "think_format_reward", "--output_dir", str(tmp_path / "out"), "--learning_rate", "1e-5",
            "--max_completion_length", "8", "--logging_steps", "1", "--report_to", "none", "--use_peft",
            "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj", "--beta", "0.0"]
    argv += [item for name, value in flags.items() for item in (f"--{name}", str(value))]
    script_args, training_args, model_args, dataset_args = script.make_parser().parse_args_and_config(
        argv, fail_with_unknown_args=False)  # as its __main__ calls it
    script.main(script_args, training_args, model_args, dataset_args)

    trainer, = made
    assert trainer.counts.batches() == trl_batches(len(MORE_PROMPTS), **flags)
    assert trainer.is_lora and trainer.config.lora_r == 4 and trainer.config.group_size == 4
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()  # trainer.save_model(output_dir)
    said = capsys.readouterr().out
    assert "Training completed." in said and f"Model saved to {tmp_path / 'out'}." in said


GSPO_FLAGS = {  # examples/scripts/gspo.py's documented command line, lengths shortened, max_steps added
    "learning_rate": "1e-5", "dtype": "bfloat16", "max_completion_length": "8", "use_peft": None,
    "lora_target_modules": ["q_proj", "v_proj"], "log_completions": None, "per_device_train_batch_size": "8",
    "num_generations": "8", "importance_sampling_level": "sequence", "epsilon": "3e-4",
    "epsilon_high": "4e-4", "beta": "0.0", "loss_type": "grpo", "gradient_accumulation_steps": "2",
    "steps_per_generation": "8",
    "max_steps": "4", "report_to": "none",
}


def gspo_argv(model_folder: str, output_dir) -> list[str]:
    argv = ["--model_name_or_path", model_folder, "--output_dir", str(output_dir)]
    for name, value in GSPO_FLAGS.items():
        argv += [f"--{name}", *([] if value is None else [value] if isinstance(value, str) else value)]
    return argv


def test_trls_gspo_example_runs_line_by_line(model_folder, tmp_path):
    """examples/scripts/gspo.py: TrlParser((ScriptArguments, GRPOConfig, ModelConfig)), model_init_kwargs with
    a torch dtype, conversational rows with a system prompt, TRL's think_format_reward and accuracy_reward,
    quantization_config and peft_config from ModelConfig, train, save_model. TRL: a generation of 8 prompts x
    8 completions feeds 4 optimizer steps of 16 (steps_per_generation 8 = 4 x gradient_accumulation_steps
    2)."""
    pytest.importorskip("trl")
    import torch
    from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config
    from trl.rewards import accuracy_reward, think_format_reward

    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    _, training_args, model_args = parser.parse_args_and_config(gspo_argv(model_folder, tmp_path / "out"))
    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    training_args.model_init_kwargs = dict(  # noqa: C408 - as the script writes it
        revision=model_args.model_revision, attn_implementation=model_args.attn_implementation, dtype=dtype)

    rows = {"problem": MORE_PROMPTS, "solution": ["5", "red", "1 2 3", "yes", "cat", "apple", "2", "no"],
            "messages": [[{"role": "user", "content": p}] for p in MORE_PROMPTS]}
    train_dataset, eval_dataset = Dataset.from_dict(rows), Dataset.from_dict(rows).select(range(2))

    def make_conversation(example):
        return {"prompt": [{"role": "system", "content": "Think inside <think></think>, then answer."},
                           {"role": "user", "content": example["problem"]}]}

    train_dataset = train_dataset.map(make_conversation).remove_columns(["messages", "problem"])
    eval_dataset = eval_dataset.map(make_conversation).remove_columns(["messages", "problem"])
    trainer = GRPOTrainer(model=model_args.model_name_or_path, args=training_args,
                          reward_funcs=[think_format_reward, accuracy_reward], train_dataset=train_dataset,
                          eval_dataset=eval_dataset, quantization_config=get_quantization_config(model_args),
                          peft_config=get_peft_config(model_args))
    counts = Counts.of(trainer)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        raise AssertionError("push_to_hub reads False")

    figures = {name: int(GSPO_FLAGS[name]) for name in ("per_device_train_batch_size", "num_generations",
                                                        "gradient_accumulation_steps", "steps_per_generation",
                                                        "max_steps")}
    assert counts.batches() == trl_batches(len(MORE_PROMPTS), **figures)
    config = trainer.config
    assert (config.dtype, config.importance_sampling_level, config.clip_epsilon, config.clip_epsilon_high,
            config.loss_type, config.kl_beta, config.log_completions) == ("bfloat16", "sequence", 3e-4, 4e-4,
                                                                          "grpo", 0.0, 2)
    assert trainer.config.lora_target_modules == ["q_proj", "v_proj"]


# --------------------------------------------------------------------------------------------------
# the batches of TRL's advice and recipes


def run(counts_of: GRPOTrainer, **train_kwargs):
    counts = Counts.of(counts_of)
    counts_of.train(**train_kwargs)
    return counts


def test_trls_out_of_memory_advice(model_folder, tmp_path):
    """TRL's "out of memory?" advice: per_device_train_batch_size=1 and gradient_accumulation_steps=8, the
    same 8 completions of one prompt per optimizer step, one at a time."""
    training_args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=1,
                               gradient_accumulation_steps=8, max_completion_length=8, max_steps=2,
                               logging_steps=1, report_to="none")
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=training_args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    counts = run(trainer)
    assert counts.batches() == trl_batches(len(PROMPTS), per_device_train_batch_size=1,
                                           gradient_accumulation_steps=8, max_steps=2)
    assert counts.batches().completions_per_pass == 1


def test_the_cookbooks_peft_model_without_its_tokenizer(model_folder, tmp_path):
    """The HF cookbook (fine_tuning_llm_grpo_trl): get_peft_model(AutoModelForCausalLM.from_pretrained(id),
    lora_config), GRPOTrainer(model=model, ...) with no processing_class; its GRPOConfig, the accumulation and
    lengths shortened."""
    lora_config = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=32, lora_dropout=0.1,
                             target_modules=["q_proj", "v_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_folder), lora_config)
    training_args = GRPOConfig(output_dir=str(tmp_path / "out"), learning_rate=1e-5,
                               remove_unused_columns=False, gradient_accumulation_steps=2,
                               num_train_epochs=1, bf16=True, max_completion_length=8, num_generations=4,
                               report_to=["tensorboard"], logging_steps=1, push_to_hub=False,
                               save_strategy="steps", save_steps=10)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_len], args=training_args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    assert trainer.tokenizer.name_or_path == model_folder
    counts = run(trainer)
    assert counts.batches() == trl_batches(len(PROMPTS), gradient_accumulation_steps=2, num_train_epochs=1,
                                           num_generations=4)


def test_num_train_epochs_as_transformers_types_it(model_folder, tmp_path):
    """num_train_epochs=1.0 with no max_steps: TRL's steps for one epoch of 6 prompts, 2 per generation."""
    training_args = GRPOConfig(output_dir=str(tmp_path / "out"), num_train_epochs=1.0, num_generations=4,
                               per_device_train_batch_size=4, gradient_accumulation_steps=2,
                               max_completion_length=8, logging_steps=1, report_to="none")
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=training_args,
                          train_dataset=Dataset.from_dict({"prompt": MORE_PROMPTS[:6]}))
    counts = run(trainer)
    assert counts.batches() == trl_batches(6, num_train_epochs=1.0, num_generations=4,
                                           per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert counts.batches().optimizer_steps == 3 and trainer.state.epoch == 1.0


# --------------------------------------------------------------------------------------------------
# what transformers' examples and open-r1 do around train()


def test_get_last_checkpoint_then_resume_as_transformers_examples_do(model_folder, tmp_path):
    """transformers' examples and open-r1: get_last_checkpoint(output_dir), train(resume_from_checkpoint=...),
    then train_result.metrics, log_metrics, save_metrics and save_state."""
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    batch = {"num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}

    def script(max_steps: int):
        training_args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=max_steps, save_steps=1,
                                   max_completion_length=8, logging_steps=1, report_to="none", **batch)
        last_checkpoint = None
        if os.path.isdir(training_args.output_dir):
            last_checkpoint = get_last_checkpoint(training_args.output_dir)
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=training_args,
                              train_dataset=dataset)
        counts = Counts.of(trainer)
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        metrics = train_result.metrics
        metrics["train_samples"] = len(dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        return trainer, counts, checkpoint

    trainer, counts, checkpoint = script(2)
    assert checkpoint is None and counts.batches() == trl_batches(len(PROMPTS), max_steps=2, **batch)
    trainer, counts, checkpoint = script(4)
    assert checkpoint == os.path.join(str(tmp_path / "out"), "checkpoint-2")
    resumed = trl_batches(len(PROMPTS), max_steps=4, **batch)
    assert counts.batches() == dataclasses.replace(resumed, optimizer_steps=2, generations=2)  # steps 3 and 4
    assert [row["step"] for row in trainer.state.log_history if "loss" in row] == [1, 2, 3, 4]
    saved = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert saved["train_samples"] == 4 and saved["train_loss"] == pytest.approx(
        sum(row["loss"] for row in trainer.state.log_history[2:] if "loss" in row) / 2)
    assert json.loads((tmp_path / "out" / "trainer_state.json").read_text())["global_step"] == 4


def test_a_plotting_loop_over_trls_metric_names(model_folder, tmp_path):
    """A TRL user's plot: one curve per metric name TRL logs, read from trainer.state.log_history."""
    training_args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, max_completion_length=8,
                               max_steps=3, logging_steps=1, beta=0.04, report_to="none")
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=training_args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}))
    counts = run(trainer)
    assert counts.batches() == trl_batches(8, num_generations=4, max_steps=3)
    curves = {}
    for name in ("reward", "reward_std", "rewards/reward_len/mean", "rewards/reward_len/std", "loss", "kl",
                 "entropy", "grad_norm", "learning_rate", "num_tokens", "completions/mean_length",
                 "completions/max_length", "completions/clipped_ratio", "clip_ratio/region_mean",
                 "frac_reward_zero_std", "step_time"):
        steps = [row["step"] for row in trainer.state.log_history if name in row]
        values = [row[name] for row in trainer.state.log_history if name in row]
        curves[name] = (steps, values)
    assert all(steps == [1, 2, 3] for steps, _ in curves.values()), curves
    assert "train_runtime" in trainer.state.log_history[-1]
