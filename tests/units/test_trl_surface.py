"""What TRL scripts do with a GRPOConfig besides constructing it (docs/from-trl.md): TRL's own example scripts
parse it with TrlParser (transformers' HfArgumentParser) next to TRL's ModelConfig; its batch names mean TRL's
arithmetic; the script reads TRL's names back and assigns model_init_kwargs; a peft model without its tokenizer;
the trainer's quantization_config.

The TRL figures below are derived by hand from TRL 1.16's GRPOConfig.__post_init__ (trl/trainer/grpo_config.py):
B = per_device_train_batch_size x processes, steps_per_generation = gradient_accumulation_steps unless given,
generation_batch_size = B x steps_per_generation, which must hold whole groups; an optimizer step trains on
B x gradient_accumulation_steps completions (transformers' gradient accumulation).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from datasets import Dataset
from transformers import HfArgumentParser
from trl_scripts import PROMPTS, ModelArguments, trl_args

from forge import GRPOConfig, GRPOTrainer  # the one line a TRL script changes
from forge.core.trl_names import TRL_CONVERTED, TRL_IGNORED, TRL_NAMES, TRL_REFUSED


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


# --------------------------------------------------------------------------------------------------
# 1. TRL's example scripts: TrlParser, model_init_kwargs, quantization_config


def test_hf_argument_parser_takes_grpo_config_next_to_a_dataclass_with_dtype(tmp_path):
    parser = HfArgumentParser((GRPOConfig, ModelArguments))  # TRL's grpo.py: (GRPOConfig, ModelConfig, ...)
    config, model_args = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--group_size", "4", "--dtype", "bfloat16"])
    assert (config.group_size, config.output_dir, model_args.dtype) == (4, str(tmp_path), "bfloat16")
    assert GRPOConfig(dtype="bfloat16", lora_r=4).lora_r == 4  # Forge's own keywords keep working
    assert {"dtype", "lora_r"} <= {f.name for f in dataclasses.fields(GRPOConfig)} and "dtype" in config.to_dict()
    kept = dataclasses.replace(GRPOConfig(dtype="bfloat16", lora_r=4), max_steps=3)  # replace() keeps every field
    assert (kept.dtype, kept.lora_r, kept.max_steps) == ("bfloat16", 4, 3)
    assert dataclasses.replace(kept, dtype="float16").dtype == "float16"


def test_trls_own_grpo_parser_builds_with_forges_config(tmp_path):
    """TRL's trl/scripts/grpo.py make_parser, with Forge's GRPOConfig in place of TRL's."""
    trl = pytest.importorskip("trl")  # `pip install 'forge-rl[bench]'` brings TRL
    from trl.scripts.grpo import GRPOScriptArguments

    parser = trl.TrlParser((GRPOScriptArguments, GRPOConfig, trl.ModelConfig, trl.DatasetMixtureConfig))
    _, training_args, model_args, _ = parser.parse_args_and_config(
        ["--output_dir", str(tmp_path), "--group_size", "4", "--dtype", "bfloat16", "--use_peft", "--lora_r", "4"])
    assert (training_args.group_size, model_args.dtype, trl.get_peft_config(model_args).r) == (4, "bfloat16", 4)


def test_trls_grpo_script_reads_and_assigns_its_names(tmp_path):
    """The lines of TRL's trl/scripts/grpo.py main() that touch training_args."""
    parser = HfArgumentParser((GRPOConfig, ModelArguments))
    training_args, model_args = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--dtype",
                                                                     "bfloat16"])
    model_init_kwargs = dict(  # noqa: C408 - as TRL's script writes it
        revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs
    assert training_args.dtype == "bfloat16" and training_args.model_init_kwargs == model_init_kwargs
    assert training_args.eval_strategy == "no" and training_args.push_to_hub is False
    assert training_args.resume_from_checkpoint is None
    # ModelConfig's default dtype, float32, is the dtype TRL loads the weights in: Forge's float32 masters already
    training_args.model_init_kwargs = {**model_init_kwargs, "dtype": "float32"}
    assert training_args.dtype == "bfloat16"
    with pytest.raises(TypeError, match=r"model_init_kwargs \['attn_implementation'\]"):
        training_args.model_init_kwargs = {"attn_implementation": "flash_attention_2"}


def test_a_switch_on_by_default_is_turned_off_with_no_as_hf_argument_parser_spells_it(tmp_path):
    """transformers gives a bool field that defaults to True a `--no_<name>` flag: Forge's switches
    (shuffle, share_prompt_prefix, merge_lora_for_generation) and TRL's (TRL_SWITCHES_ON) take it."""
    parser = HfArgumentParser((GRPOConfig, ModelArguments))
    config, _ = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--no_shuffle", "--no-share-prompt-prefix", "--use_vllm",
         "--no_vllm_importance_sampling_correction", "--no_gradient_checkpointing", "--no_log_on_each_node"])
    assert (config.shuffle, config.share_prompt_prefix, config.merge_lora_for_generation) == (False, False, True)
    assert (config.gradient_checkpointing, config.rollout_is) == (False, "none")  # TRL's correction turned off
    config, _ = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--no_shuffle_dataset",
                                                    "--use_vllm", "--merge_lora_for_generation", "false"])
    assert (config.shuffle, config.rollout_is, config.merge_lora_for_generation) == (False, "sequence_mask", False)
    config, _ = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert (config.shuffle, config.share_prompt_prefix) == (True, True)
    with pytest.raises(SystemExit):  # argparse's error: a negation takes no value
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--no_shuffle", "false"])


def test_the_counts_transformers_types_float_parse_as_numbers_on_the_command_line(tmp_path):
    """num_train_epochs, logging_steps, save_steps and eval_steps are floats in TrainingArguments: `1.0` and a
    ratio of max_steps parse as TRL reads them; a fraction of an epoch is refused with what to set."""
    parser = HfArgumentParser((GRPOConfig, ModelArguments))
    config, _ = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--num_train_epochs", "1.0",
                                                    "--save_steps", "50.0", "--logging_steps", "5"])
    assert (config.num_train_epochs, config.save_steps, config.logging_steps) == (1, 50, 5)
    config, _ = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--max_steps", "100",
                                                    "--save_steps", "0.25"])
    assert config.save_steps == 25
    with pytest.raises(TypeError, match="Forge counts whole epochs; set max_steps to stop within one"):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--num_train_epochs", "2.5"])


def test_trls_switches_on_by_default_are_the_ones_trl_declares():
    trl = pytest.importorskip("trl")
    from forge.core.trl_flags import TRL_SWITCHES_ON

    on = {f.name for f in dataclasses.fields(trl.GRPOConfig) if f.default is True}
    assert TRL_SWITCHES_ON == on


def test_the_trainer_takes_quantization_config_none_and_refuses_a_value(tmp_path):
    from forge.model.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(seed=0)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward_len,
                          args=trl_args(tmp_path), quantization_config=None)
    assert trainer.config.group_size == 4
    with pytest.raises(TypeError, match="quantization_config=.*Forge trains unquantized weights"):
        GRPOTrainer(model="no/such-model", reward_funcs=reward_len, args=trl_args(tmp_path),
                    quantization_config={"load_in_4bit": True})


# --------------------------------------------------------------------------------------------------
# 2. TRL's batch arithmetic


@pytest.mark.parametrize("trl, processes, per_optimizer_step, forge", [
    # TRL's out-of-memory advice: B = 1, steps_per_generation = 8, one generation of 8 = 1 prompt per step
    ({"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "num_generations": 8}, 1, (1, 8),
     {"prompts_per_step": 1, "gradient_accumulation_steps": 1, "micro_batch_size": 1}),
    # generation_batch_size given: steps_per_generation = 8 / 1 = 8 = gradient_accumulation_steps
    ({"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "generation_batch_size": 8,
      "num_generations": 8}, 1, (1, 8), {"prompts_per_step": 1, "gradient_accumulation_steps": 1}),
    # TRL's defaults (per_device 8, accumulation 1) with num_generations=4: 8 / 4 = 2 prompts a step
    ({"num_generations": 4}, 1, (2, 8), {"prompts_per_step": 2, "gradient_accumulation_steps": 1,
                                         "micro_batch_size": 0}),
    ({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "num_generations": 8}, 1, (4, 32),
     {"prompts_per_step": 4, "gradient_accumulation_steps": 1, "micro_batch_size": 8}),
    # steps_per_generation 2 < accumulation 4: two generations of 16 completions per optimizer step
    ({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "steps_per_generation": 2,
      "num_generations": 8}, 1, (4, 32), {"prompts_per_step": 2, "gradient_accumulation_steps": 2}),
    # steps_per_generation 4 > accumulation 1: one generation of 4 prompts feeds 4 optimizer steps of 8
    # completions, a shuffled quarter of it each
    ({"per_device_train_batch_size": 8, "steps_per_generation": 4, "num_generations": 8}, 1, (4, 8),
     {"prompts_per_step": 4, "gradient_accumulation_steps": 1, "rollout_slices": 4, "micro_batch_size": 8}),
    # LoRA Without Regret (TRL docs): B = 1, generation 8 = 1 prompt, steps_per_generation 8 = 2 x accumulation 4:
    # two optimizer steps of 4 of its 8 completions
    ({"per_device_train_batch_size": 1, "gradient_accumulation_steps": 4, "num_generations": 8,
      "generation_batch_size": 8}, 1, (1, 4),
     {"prompts_per_step": 1, "gradient_accumulation_steps": 1, "rollout_slices": 2, "micro_batch_size": 1}),
    # two processes: B = 8, generation 16 = 2 prompts, 8 completions on each process, 4 per forward/backward
    ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 8}, 2, (2, 16),
     {"prompts_per_step": 2, "gradient_accumulation_steps": 1, "micro_batch_size": 4}),
], ids=["oom-advice", "generation_batch_size", "trl-defaults", "accumulation", "two-generations-a-step",
        "generation-for-four-steps", "lora-without-regret", "two-processes"])
def test_trl_batch_names_give_trls_prompts_and_completions_per_optimizer_step(trl, processes, per_optimizer_step,
                                                                              forge, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(processes))
    config = GRPOConfig(**trl).validate()
    prompts = config.prompts_per_step * config.gradient_accumulation_steps  # of the generations a step trains on
    assert (prompts, prompts * config.group_size // config.rollout_slices) == per_optimizer_step
    assert {name: getattr(config, name) for name in forge} == forge
    for name in ("per_device_train_batch_size", "generation_batch_size", "steps_per_generation"):
        if name in trl:
            assert getattr(config, name) == trl[name]  # read back as given


def test_trl_batches_forge_cannot_train_are_refused_saying_why():
    # steps_per_generation 4 > accumulation 3, not a multiple: a step of 6 completions straddles two generations
    with pytest.raises(TypeError, match=r"6 completions .* generations of 8, which it straddles.*"
                                        r"gradient_accumulation_steps=4"):
        GRPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=3, num_generations=8,
                   generation_batch_size=8)
    with pytest.raises(TypeError, match=r"generation_batch_size=12 .*multiple of num_generations=8"):
        GRPOConfig(per_device_train_batch_size=4, generation_batch_size=12, num_generations=8)
    with pytest.raises(TypeError, match=r"generation_batch_size=12 .*divisible by .* 8"):
        GRPOConfig(per_device_train_batch_size=8, generation_batch_size=12, num_generations=4)
    with pytest.raises(TypeError, match="generation_batch_size and steps_per_generation: give one"):
        GRPOConfig(generation_batch_size=16, steps_per_generation=2)
    with pytest.raises(TypeError, match=r"num_iterations=2 .* not Forge's num_iterations"):
        GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=4, steps_per_generation=2,
                   num_iterations=2)
    with pytest.raises(TypeError, match="both 'per_device_train_batch_size' .* and 'prompts_per_step'"):
        GRPOConfig(per_device_train_batch_size=8, prompts_per_step=2)


def test_forges_own_batch_names_keep_forges_meaning():
    config = GRPOConfig(group_size=4, gradient_accumulation_steps=2)
    assert (config.prompts_per_step, config.gradient_accumulation_steps, config.micro_batch_size) == (1, 2, 0)
    config = GRPOConfig(num_generations=4, prompts_per_step=3, gradient_accumulation_steps=2)  # a Forge batch
    assert (config.prompts_per_step, config.gradient_accumulation_steps) == (3, 2)


def test_training_arguments_float_counts_take_whole_numbers():
    config = GRPOConfig(num_train_epochs=1.0, logging_steps=5.0, save_steps=50.0, eval_steps=10.0).validate()
    assert (config.num_train_epochs, config.logging_steps, config.save_steps, config.eval_steps) == (1, 5, 50, 10)
    assert isinstance(config.num_train_epochs, int)
    with pytest.raises(TypeError, match=r"num_train_epochs=0.5: Forge .* whole .* max_steps"):
        GRPOConfig(num_train_epochs=0.5)


def test_a_trl_batch_trains_with_one_completion_per_forward_pass(model_folder, tmp_path):
    seen = []

    def count(completions, **kwargs):
        seen.append(len(completions))
        return reward_len(completions)

    args = trl_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=4, max_steps=1)
    trainer = GRPOTrainer(model=model_folder, reward_funcs=count, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()
    assert seen == [4] and trainer.micro_batch_size == 1  # one prompt's 4 completions, one at a time


# --------------------------------------------------------------------------------------------------
# 3. a model object without its tokenizer


def test_a_peft_model_without_processing_class_loads_its_tokenizer(model_folder, tmp_path):
    """The HF cookbook: get_peft_model(AutoModelForCausalLM.from_pretrained(path), lora_config), no tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_folder),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=trl_args(tmp_path, max_steps=1),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    assert trainer.tokenizer.name_or_path == model_folder and trainer.tokenizer.padding_side == "left"
    trainer.train()
    assert trainer.global_step == 1


def test_a_model_object_with_no_name_needs_its_tokenizer(tmp_path):
    from forge.model.tiny import build_tiny_model

    model, _ = build_tiny_model(seed=0)  # built from a config: no checkpoint to load a tokenizer from
    with pytest.raises(ValueError, match="processing_class="):
        GRPOTrainer(model=model, reward_funcs=reward_len, args=trl_args(tmp_path))


# --------------------------------------------------------------------------------------------------
# 4. TRL's names read back and assign


def test_trl_names_read_back_from_the_forge_fields():
    args = GRPOConfig(num_generations=4, max_completion_length=64, per_device_train_batch_size=8, beta=0.04,
                      bf16=True, report_to="wandb", save_strategy="no", dataloader_num_workers=2)
    assert (args.num_generations, args.max_completion_length, args.per_device_train_batch_size, args.beta) == (
        4, 64, 8, 0.04)
    assert (args.bf16, args.fp16, args.report_to, args.save_strategy, args.eval_strategy) == (
        True, False, ["wandb"], "no", "no")
    assert (args.push_to_hub, args.trust_remote_code, args.dataloader_num_workers) == (False, False, 2)
    assert (args.logging_strategy, args.use_vllm, args.model_init_kwargs, args.generation_batch_size) == (
        "steps", False, {"dtype": "bfloat16"}, 8)
    assert GRPOConfig().dataloader_pin_memory is True  # an ignored name not given: TRL's default
    args.group_size, args.kl_beta, args.save_steps, args.dtype = 6, 0.0, 50, "float16"  # a later change shows
    assert (args.num_generations, args.beta, args.save_strategy, args.bf16, args.fp16) == (6, 0.0, "steps", False,
                                                                                            True)


def test_assigning_a_trl_name_sets_the_forge_field():
    args = GRPOConfig()
    args.num_generations, args.beta, args.max_completion_length = 4, 0.1, 32
    assert (args.group_size, args.kl_beta, args.max_new_tokens) == (4, 0.1, 32)
    args.bf16, args.eval_strategy, args.report_to = True, "no", ["tensorboard"]
    assert (args.dtype, args.eval_steps, args.use_tensorboard, args.use_wandb) == ("bfloat16", 0, True, False)
    args.model_init_kwargs = {"torch_dtype": "float16"}
    assert args.dtype == "float16" and args.model_init_kwargs == {"torch_dtype": "float16"}
    args.dataloader_num_workers = 3
    assert args.dataloader_num_workers == 3
    with pytest.raises(TypeError, match="push_to_hub=True has no Forge equivalent"):
        args.push_to_hub = True
    assert args == GRPOConfig(num_generations=4, prompts_per_step=1, beta=0.1, max_completion_length=32,
                              dtype="float16", eval_steps=0, use_tensorboard=True)
    assert [f.name for f in dataclasses.fields(args)] == [f.name for f in dataclasses.fields(GRPOConfig)]
    assert set(args.to_dict()) == {f.name for f in dataclasses.fields(GRPOConfig)}
    json.dumps(args.to_dict())  # only Forge's fields, as checkpoints hold them


def test_assigning_a_trl_batch_name_redoes_trls_arithmetic():
    args = GRPOConfig(num_generations=4)  # TRL's 8 completions per device and step: 2 prompts
    args.per_device_train_batch_size = 16
    assert args == GRPOConfig(num_generations=4, per_device_train_batch_size=16)
    assert (args.prompts_per_step, args.gradient_accumulation_steps, args.per_device_train_batch_size) == (4, 1, 16)
    args.steps_per_generation = 2  # TRL: a generation of 32 completions for two optimizer steps of 16
    assert (args.prompts_per_step, args.steps_per_generation, args.rollout_slices) == (8, 2, 2)
    assert args.generation_batch_size == 32 and args.gradient_accumulation_steps == 1  # one generation, 2 slices
    args.generation_batch_size = 16
    assert (args.prompts_per_step, args.gradient_accumulation_steps) == (4, 1)


def test_trl_defaults_are_those_of_transformers():
    import transformers

    from forge.core.trl_attributes import TRL_DEFAULTS

    def default(field):
        return field.default_factory() if field.default is dataclasses.MISSING else field.default

    trl_own = {"remove_unused_columns"}  # TRL's GRPOConfig sets False (transformers: True)
    for field in dataclasses.fields(transformers.TrainingArguments):
        if field.name in TRL_DEFAULTS and field.name not in trl_own:
            assert TRL_DEFAULTS[field.name] == default(field), field.name


def test_trl_defaults_are_those_of_trl():
    from forge.core.trl_attributes import TRL_DEFAULTS

    def default(field):
        return field.default_factory() if field.default is dataclasses.MISSING else field.default

    trl = pytest.importorskip("trl")  # `pip install 'forge-rl[bench]'` brings TRL
    for field in dataclasses.fields(trl.GRPOConfig):
        if field.name in TRL_DEFAULTS:
            assert TRL_DEFAULTS[field.name] == default(field), field.name


@pytest.mark.parametrize("name", sorted({*TRL_NAMES, *TRL_CONVERTED, *TRL_IGNORED, *TRL_REFUSED}))
def test_every_name_of_the_table_reads_back(name):
    getattr(GRPOConfig(), name)


@pytest.mark.parametrize("name, value", [
    ("num_generations", 4), ("beta", 0.0), ("epsilon", 0.3), ("per_device_train_batch_size", 16),
    ("report_to", ["tensorboard"]), ("bf16", True), ("fp16", True), ("epsilon_high", 0.28), ("use_vllm", False),
    ("lr_scheduler_type", "linear"), ("warmup_steps", 0.1), ("save_strategy", "no"), ("eval_strategy", "no"),
    ("logging_strategy", "steps"), ("train_sampling_strategy", "sequential"), ("resume_from_checkpoint", True),
    ("project", "p"), ("model_init_kwargs", {"dtype": "bfloat16"}), ("optim", "adamw_torch_fused"),
    ("generation_batch_size", 16), ("steps_per_generation", 2), ("dataloader_num_workers", 4), ("tf32", True),
    ("push_to_hub", False), ("trust_remote_code", False), ("repetition_penalty", 1.0),
])
def test_a_trl_name_reads_back_what_was_given(name, value):
    assert getattr(GRPOConfig(**{name: value}), name) == value


# --------------------------------------------------------------------------------------------------
# 5. messages


def test_refusals_name_what_to_do():
    with pytest.raises(TypeError) as refused:
        GRPOConfig(push_to_hub=True)
    assert "{" not in str(refused.value) and "huggingface-cli upload" in str(refused.value)
    with pytest.raises(ValueError, match=r"generation_backend='vllm' \(TRL's use_vllm=True\) needs vLLM"):
        GRPOConfig(use_vllm=True).validate()  # vLLM is not installed with the test suite


def test_a_refused_steps_per_generation_points_at_its_mapping():
    # TRL trains each optimizer step on 6 completions (B = 2 x 3 passes) of generations of 8, straddling two
    with pytest.raises(TypeError, match=r"straddles.*steps_per_generation is mapped so: "
                                        r"docs/from-trl.md#the-batch.*gradient_accumulation_steps=4"):
        GRPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=3, steps_per_generation=4,
                   num_generations=8)


def test_a_reward_failing_on_conversational_completions_ends_with_its_own_error(model_folder, tmp_path):
    def words(completions, **kwargs):  # written for text; a conversational dataset's completions are messages
        return [float(len(completion.split())) for completion in completions]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": prompt}] for prompt in PROMPTS]})
    trainer = GRPOTrainer(model=model_folder, reward_funcs=words, args=trl_args(tmp_path), train_dataset=dataset)
    with pytest.raises(Exception) as failed:
        trainer.train()
    message = str(failed.value)  # no step finished: nothing to resume, so no note hides the error
    assert message.startswith("reward 'words' raised AttributeError: 'list' object has no attribute 'split'")
    assert message.endswith("to give failing samples reward_error_value and go on.")
