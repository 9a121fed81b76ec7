"""TRL's values and flags for a GRPOConfig (docs/from-trl.md): the values TRL and transformers accept for the
fields Forge has too (forge/core/trl_values.py), the TRL configs Forge refuses, each in the docs' table with
its reason, TRL's flags through transformers' HfArgumentParser (forge/core/trl_flags.py), and the part of the
trainer a TRL script reads after training (trainer.accelerator, trainer.end())."""

from __future__ import annotations

import dataclasses
import enum
import typing

import pytest
import transformers
from transformers import HfArgumentParser
from trl_scripts import ModelArguments, trl_args

from forge import AsyncGRPOConfig, GRPOConfig, GRPOTrainer
from forge.core.trl_names import TRL_REFUSED, is_off
from forge.core.trl_values import REFUSED_VALUES

DEFAULT = GRPOConfig()


def taken(config: dict) -> bool:
    try:
        GRPOConfig(**config).validate()
    except (TypeError, ValueError):
        return False
    return True


def listed(name: str, value) -> bool:
    """Whether the docs' tables say why `name=value` is refused: a refused name, or a row of the refused
    configs that names it (in its config or its reason: "the same for eval_strategy")."""
    return (name in TRL_REFUSED and not is_off(name, value)) or any(
        name in config or name in why for config, why in REFUSED_VALUES)


# --------------------------------------------------------------------------------------------------
# TRL's values of Forge's fields


@pytest.mark.parametrize("trl, forge", [
    ({"log_completions": True}, {"log_completions": 2}),
    ({"log_completions": False}, {"log_completions": 0}),
    ({"scale_rewards": True}, {"scale_rewards": "group"}),
    ({"scale_rewards": False}, {"scale_rewards": "none"}),
    ({"eval_steps": None}, {}),
    ({"eval_strategy": "steps", "eval_steps": None, "logging_steps": 5}, {"eval_steps": 5, "logging_steps": 5}),
    ({"fsdp": None}, {}), ({"fsdp": ""}, {}), ({"fsdp": "full_shard auto_wrap"}, {"fsdp": True}),
    ({"run_name": None}, {}), ({"activation_checkpointing": None}, {}),
    ({"max_tool_calling_iterations": None}, {"max_tool_calling_iterations": None}),
    ({"logging_steps": 0.25, "max_steps": 10}, {"logging_steps": 3, "max_steps": 10}),
    ({"save_steps": 0.5, "max_steps": 10}, {"save_steps": 5, "max_steps": 10}),
    ({"num_train_epochs": 2.0}, {"num_train_epochs": 2}),
    ({"vllm_importance_sampling_correction": True}, {}),
])
def test_trls_values_of_forges_fields_are_taken(trl, forge):
    assert GRPOConfig(**trl).validate() == GRPOConfig(**forge)


@pytest.mark.parametrize("trl, rollout_is, threshold, reads", [
    ({"use_vllm": True}, "sequence_mask", 3.0, True),  # TRL 1.16: correction on, sequence_mask, clip_max 3.0
    ({"use_vllm": True, "vllm_importance_sampling_correction": False}, "none", 3.0, False),
    ({"use_vllm": True, "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0},
     "token_truncate", 2.0, True),
    ({"use_vllm": True, "vllm_importance_sampling_cap": 5.0}, "sequence_mask", 5.0, True),
    ({"use_vllm": True, "rollout_is": "token_mask", "rollout_is_threshold": 4.0}, "token_mask", 4.0, True),
    ({"generation_backend": "vllm"}, "none", 3.0, False),  # Forge's own name: Forge's default
    ({}, "none", 3.0, True),  # no vLLM: TRL's True, which applies to nothing
])
def test_use_vllm_corrects_for_vllms_sampling_as_trl_does(trl, rollout_is, threshold, reads):
    config = GRPOConfig(**trl)
    assert (config.rollout_is, config.rollout_is_threshold) == (rollout_is, threshold)
    assert config.vllm_importance_sampling_correction is reads


def test_a_correction_given_with_its_forge_field_is_refused():
    with pytest.raises(TypeError, match="got both 'vllm_importance_sampling_correction'.*'rollout_is'"):
        GRPOConfig(use_vllm=True, vllm_importance_sampling_correction=True, rollout_is="token_mask")


@pytest.mark.parametrize("config, why", REFUSED_VALUES, ids=lambda v: ",".join(v) if isinstance(v, dict) else "")
def test_each_refused_trl_config_is_refused(config, why):
    assert not taken(config), f"{config} is taken: drop its row from trl_values.REFUSED_VALUES"


def test_the_defaults_and_choices_of_transformers_are_taken_or_listed():
    """Every TrainingArguments default, and every value of an enum or Literal field, is taken or its refusal
    is in the docs' tables."""
    hints = typing.get_type_hints(transformers.TrainingArguments)
    unlisted = []
    for field in dataclasses.fields(transformers.TrainingArguments):
        if field.name == "output_dir" or not field.init:
            continue
        values = [field.default_factory() if field.default is dataclasses.MISSING else field.default]
        kinds = [hints[field.name], *typing.get_args(hints[field.name])]
        values += [member.value for kind in kinds if isinstance(kind, type) and issubclass(kind, enum.Enum)
                   for member in kind]
        unlisted += [(field.name, value) for value in values
                     if not taken({field.name: value}) and not listed(field.name, value)]
    assert unlisted == []


def test_the_defaults_and_choices_of_trl_are_taken_or_listed():
    trl = pytest.importorskip("trl")  # `pip install 'forge-rl[bench]'` brings TRL
    from trl.experimental.async_grpo import AsyncGRPOConfig as TrlAsyncConfig

    inherited = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    unlisted = []
    for cls in (trl.GRPOConfig, TrlAsyncConfig):
        for field in dataclasses.fields(cls):
            if field.name in inherited or not field.init:
                continue
            values = [field.default_factory() if field.default is dataclasses.MISSING else field.default]
            values += list(field.metadata.get("choices", []))
            unlisted += [(field.name, value) for value in values
                         if not taken({field.name: value}) and not listed(field.name, value)]
    assert unlisted == []


def test_trls_loss_types_are_taken_or_listed():
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"):  # TRL 1.16's help
        assert taken({"loss_type": loss_type}) or listed("loss_type", loss_type), loss_type


# --------------------------------------------------------------------------------------------------
# TRL's flags: HfArgumentParser, which TRL's TrlParser extends


GSPO_ARGV = ["--learning_rate", "1e-5", "--dtype", "bfloat16", "--max_completion_length", "1024", "--use_peft",
             "--log_completions", "--per_device_train_batch_size", "8", "--num_generations", "8",
             "--importance_sampling_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4",
             "--beta", "0.0", "--loss_type", "grpo", "--gradient_accumulation_steps", "2",
             "--steps_per_generation", "8"]
"""examples/scripts/gspo.py's documented flags (its --lora_target_modules aside), in TRL's names."""


def test_trls_flags_parse_into_trls_batch(tmp_path):
    parser = HfArgumentParser((GRPOConfig, ModelArguments))
    config, model_args = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), *GSPO_ARGV])
    assert config == GRPOConfig(output_dir=str(tmp_path), learning_rate=1e-5, max_completion_length=1024,
                                log_completions=True, per_device_train_batch_size=8, num_generations=8,
                                importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4,
                                beta=0.0, loss_type="grpo", gradient_accumulation_steps=2,
                                steps_per_generation=8)
    # TRL: a generation of 8 x 8 completions feeding 4 optimizer steps of 8 x 2 completions
    assert (config.prompts_per_step, config.gradient_accumulation_steps, config.rollout_slices,
            config.micro_batch_size, config.log_completions) == (8, 1, 4, 8, 2)
    assert (model_args.dtype, model_args.use_peft, config.dtype) == ("bfloat16", True, "auto")


def test_a_trl_flag_takes_trls_forms_of_a_value(tmp_path):
    parser = HfArgumentParser(GRPOConfig)
    config, = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--bf16", "--report_to", "wandb", "tensorboard", "--save_strategy", "no",
        "--model_init_kwargs", '{"torch_dtype": "bfloat16"}', "--shuffle_dataset", "false", "--run_name", "r",
        "--activation_checkpointing", "None", "--warmup_steps", "0.1"])
    assert (config.dtype, config.use_wandb, config.use_tensorboard, config.save_steps, config.shuffle,
            config.wandb_run_name, config.gradient_checkpointing, config.warmup_ratio) == (
        "bfloat16", True, True, 0, False, "r", False, 0.1)
    assert config.report_to == ["wandb", "tensorboard"] and config.bf16 is True
    config, = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--log_completions", "4",
                                                   "--group_size", "4", "--fsdp", "false"])
    assert (config.log_completions, config.group_size, config.fsdp) == (4, 4, False)


def test_a_yaml_file_of_trls_names_parses_as_the_keywords_would(tmp_path):
    """TrlParser's --config file sets the parser's defaults; parse_dict and parse_yaml_file build directly."""
    values = {"output_dir": str(tmp_path), "num_generations": 4, "per_device_train_batch_size": 4,
              "gradient_accumulation_steps": 2, "bf16": True, "eval_steps": None, "logging_steps": 5}
    parser = HfArgumentParser(GRPOConfig)
    assert parser.parse_dict(values)[0] == GRPOConfig(**values)
    parser.set_defaults(**values)  # what TrlParser.set_defaults_with_config does with the YAML file
    assert parser.parse_args_into_dataclasses([])[0] == GRPOConfig(**values)


def test_flags_left_out_leave_forges_defaults_and_the_fields_stay_forges(tmp_path):
    parser = HfArgumentParser((AsyncGRPOConfig, ModelArguments))
    config, _ = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert config == AsyncGRPOConfig(output_dir=str(tmp_path)) and config.max_staleness == 1
    assert GRPOConfig() == DEFAULT and GRPOConfig().group_size == 8  # nothing of the parser's view stays
    names = [f.name for f in dataclasses.fields(GRPOConfig)]
    assert "num_generations" not in names and names == [f.name for f in dataclasses.fields(GRPOConfig())]
    with pytest.raises(ValueError, match="not used by the HfArgumentParser"):
        parser.parse_args_into_dataclasses(["--num_genrations", "4"])  # a misspelt flag is still refused


def test_the_help_names_each_trl_flags_meaning(capsys):
    with pytest.raises(SystemExit):
        HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "[NUM_GENERATIONS ...] TRL's num_generations, mapped: `group_size`" in said
    assert "TRL's push_to_hub, refused: Forge reaches no hub" in said


# --------------------------------------------------------------------------------------------------
# what TRL's scripts read of the trainer after training


def test_the_trainer_has_what_trls_scripts_call_after_training(tmp_path, capsys):
    from forge.model.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(seed=0)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=lambda completions, **kw: [0.0],
                          args=trl_args(tmp_path))
    accelerator = trainer.accelerator
    accelerator.print("Training completed.")
    accelerator.wait_for_everyone()
    assert capsys.readouterr().out == "Training completed.\n"
    assert (accelerator.is_main_process, accelerator.is_local_main_process, accelerator.process_index,
            accelerator.num_processes) == (True, True, 0, 1)
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    trainer.end()  # one process: no group to end
