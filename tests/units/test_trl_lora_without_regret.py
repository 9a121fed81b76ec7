"""TRL's "LoRA Without Regret" GRPO recipe (TRL docs, lora_without_regret) runs with only the import changed:
per_device_train_batch_size=1, gradient_accumulation_steps=4, num_generations=8, generation_batch_size=8, LoRA of
rank 1 on every linear layer; lengths and steps shortened, the tiny model in a folder, local prompts.

TRL 1.16's figures for this config, one process, derived from its code:

    GRPOConfig.__post_init__ (trl/trainer/grpo_config.py l. 1101-1110): generation_batch_size=8 given, so
        steps_per_generation = 8 / (per_device_train_batch_size 1 x 1 process) = 8; l. 1131: 8 is a multiple of
        num_generations=8.
    prompts per generation: the sampler's batch_size = generation_batch_size // num_generations = 1 prompt,
        repeated num_generations=8 times (GRPOTrainer._get_train_sampler, grpo_trainer.py l. 1309-1316).
    optimizer steps per generation: a generation every steps_per_generation x num_iterations = 8 passes
        (_prepare_inputs, l. 1538-1539), an optimizer step every gradient_accumulation_steps = 4 passes of
        per_device_train_batch_size = 1 completion (transformers' Trainer): 8 / 4 = 2 optimizer steps, each on
        4 completions, part `_step % 8` of the shuffled generation per pass (l. 1543-1546).
    max_steps=4: 4 optimizer steps, 16 passes, 4 x 4 / 8 = 2 generations; the generation's reward metrics are
        logged with its first optimizer step (log clears them, as for num_iterations).
"""

from __future__ import annotations

from datasets import Dataset
from peft import LoraConfig
from trl_scripts import PROMPTS, Counts, trl_batches

from forge import GRPOConfig, GRPOTrainer  # the one line a TRL script changes


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def test_trls_lora_without_regret_recipe_runs_with_trls_batch(model_folder, tmp_path):
    generations = []

    def counted_reward_len(prompts, completions, **kwargs):
        generations.append(prompts)
        return reward_len(completions)

    training_args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        beta=0.0,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        num_generations=8,
        generation_batch_size=8,
        max_completion_length=8,  # TRL's recipe: 4096
        max_steps=4,
        logging_steps=1,
        report_to="none",
        preflight="off",
    )
    peft_config = LoraConfig(r=1, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    trainer = GRPOTrainer(model=model_folder, reward_funcs=counted_reward_len, args=training_args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=peft_config)
    passes, real = [], trainer.loss_and_backward

    def counted_pass(batch, r, indices, normaliser, totals):  # one forward/backward of TRL's per_device batch
        passes.append((trainer.global_step + 1, len(indices)))
        return real(batch, r, indices, normaliser, totals)

    trainer.loss_and_backward = counted_pass
    counts = Counts.of(trainer)
    trainer.train()

    assert counts.batches() == trl_batches(len(PROMPTS), per_device_train_batch_size=1, gradient_accumulation_steps=4,
                                           num_generations=8, generation_batch_size=8, max_steps=4)
    assert trainer.global_step == 4  # max_steps optimizer steps
    assert len(generations) == 2  # 2 generations of 8 completions, 1 prompt each
    assert [len(prompts) for prompts in generations] == [8, 8]
    assert all(len(set(prompts)) == 1 for prompts in generations)
    for step in range(1, 5):  # each optimizer step: 4 passes of 1 completion, 4 of the generation's 8
        assert [size for at, size in passes if at == step] == [1, 1, 1, 1]
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # one row per optimizer step
    assert [row["step"] for row in rows if "reward" in row] == [1, 3]  # a generation every 2 optimizer steps
    assert len({row["learning_rate"] for row in rows}) == 1  # constant, ticked per optimizer step
    assert (training_args.per_device_train_batch_size, training_args.steps_per_generation,
            training_args.generation_batch_size) == (1, 8, 8)  # TRL's names read back as given
