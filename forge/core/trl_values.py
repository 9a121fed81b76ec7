"""TRL's values of Forge's own fields, and the TRL configs Forge refuses (docs/from-trl.md).

A Forge field TRL has too, or that a TRL name stands for, takes the values TRL's GRPOConfig and transformers'
TrainingArguments take, said Forge's way (`field_value`, applied by convert_names to every construction):

    log_completions=True / False       TRL's switch: Forge's count of samples per logged step (2) / 0
    scale_rewards=True / False         TRL's 'group' / 'none', as TRL's __post_init__ maps them
    num_train_epochs=1.0, save_steps=50.0    a whole number given as a float (TrainingArguments: floats)
    logging_steps, save_steps, eval_steps below 1    transformers' ratio of max_steps: ceil(max_steps x it)
    eval_steps, fsdp, run_name, (activation_/gradient_)checkpointing = None    "not set": Forge's default
    fsdp='full_shard', 'full_shard auto_wrap', ''    transformers' options: FSDP2 per decoder layer; off

`REFUSED_VALUES` lists every TRL config that TRL accepts and Forge refuses, each with why and what to set;
docs/from-trl.md holds it as a table (config_docs.refused_values_markdown) and tests/units/test_trl_values.py
checks that each is refused and that TRL's defaults and choices are either taken or listed.
"""

from __future__ import annotations

import math
from typing import Any

UNSET_WHEN_NONE = {"eval_steps", "fsdp", "run_name", "activation_checkpointing", "gradient_checkpointing"}
"""Names whose None is TRL's default, "not set" (eval_steps: logging_steps under eval_strategy='steps'):
Forge's default for the field."""

WHOLE_COUNTS = {
    "num_train_epochs": "epochs; set max_steps to stop within one",
    "logging_steps": "optimizer steps",
    "save_steps": "optimizer steps",
    "eval_steps": "optimizer steps",
}
"""Forge's int fields that transformers' TrainingArguments types float: a whole number given as a float is
taken; the step counts below 1 are transformers' ratio of max_steps."""

LOGGED_SAMPLES = 2
"""log_completions=True: Forge's default count of samples written to samples.jsonl per logged step."""

_FSDP_AS_FORGES = {"full_shard", "auto_wrap"}
"""transformers' fsdp options that Forge's fsdp=True (FSDP2, each decoder layer a unit, every weight
sharded) does."""


def is_unset(name: str, value: Any) -> bool:
    """Whether a value in `name` asks for nothing but Forge's default (TRL's None for an unset count)."""
    return value is None and name in UNSET_WHEN_NONE


def _count(name: str, value: float, max_steps: int) -> int:
    if value >= 1:
        if not value.is_integer():
            raise TypeError(f"{name}={value}: Forge counts whole {WHOLE_COUNTS[name]}")
        return int(value)
    if name == "num_train_epochs":
        raise TypeError(f"{name}={value}: Forge counts whole {WHOLE_COUNTS[name]}")
    if max_steps > 0:  # transformers: a value below 1 is a ratio of the run's optimizer steps
        return math.ceil(max_steps * value)
    raise TypeError(f"{name}={value}: a ratio of max_steps, as transformers reads it, and there is no "
                    f"max_steps; give whole optimizer steps, or set max_steps")


def _fsdp(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    options = set(value.split())
    if options <= _FSDP_AS_FORGES:
        return bool(options)
    raise TypeError(f"fsdp={value!r}: Forge's FSDP2 shards every weight, each decoder layer a unit "
                    f"(transformers' 'full_shard auto_wrap'); set fsdp=True, or leave it out")


def field_value(name: str, value: Any, values: dict, defaults: dict) -> Any:
    """`value`, given in Forge field `name`, in Forge's terms (the module docstring); TypeError saying what
    to set for a TRL value Forge cannot take."""
    if name == "log_completions" and isinstance(value, bool):
        return LOGGED_SAMPLES if value else 0
    if name == "scale_rewards" and isinstance(value, bool):
        return "group" if value else "none"
    if name == "fsdp":
        return _fsdp(value)
    if name in WHOLE_COUNTS and isinstance(value, float) and math.isfinite(value) and value > 0:
        return _count(name, value, values.get("max_steps", defaults.get("max_steps", -1)))
    return value


_LOSSES = "Forge's losses are grpo, bnpo, dapo, dr_grpo, cispo and sapo"
_REFUSED = [
    ({"num_train_epochs": 2.5}, "Forge counts whole epochs; set max_steps to stop within one"),
    ({"logging_steps": 0.1}, "without max_steps Forge cannot turn transformers' ratio of the run into steps",
     "before the dataset is read; give whole steps or set max_steps (the same for save_steps and",
     "eval_steps)"),
    ({"warmup_steps": 10}, "without max_steps Forge cannot turn steps into its warmup_ratio before the",
     "dataset is read; set warmup_ratio, or max_steps"),
    ({"save_strategy": "epoch"}, "Forge counts in optimizer steps; use 'steps' with save_steps (the same for",
     "eval_strategy and logging_strategy)"),
    ({"save_strategy": "best"}, "Forge keeps no best checkpoint; use 'steps' and pick one by its eval_ rows"),
    ({"logging_strategy": "no"}, "Forge always writes training_log.jsonl; set logging_steps to log less",
     "often"),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, f"{_LOSSES}; LUSPO is not one of them"),
    ({"loss_type": "vespo"}, f"{_LOSSES}; VESPO is not one of them"),
    ({"lr_scheduler_type": "cosine_with_min_lr"}, "Forge's schedules are cosine, linear and constant, each",
     "after the warmup_ratio warmup (the same for polynomial, inverse_sqrt, cosine_with_restarts,",
     "reduce_lr_on_plateau, warmup_stable_decay)"),
    ({"optim": "adamw_8bit"}, "Forge's optimizer is torch's AdamW (optim='adamw_torch',",
     "'adamw_torch_fused'); the same for every other optim"),
    ({"adam_beta2": 0.99}, "Forge's AdamW uses torch's betas (0.9, 0.999) and eps (1e-08)"),
    ({"report_to": "mlflow"}, "Forge reports to wandb, tensorboard and trackio (and always to the console",
     "and training_log.jsonl)"),
    ({"train_sampling_strategy": "group_by_length"}, "Forge shuffles ('random') or keeps the order",
     "('sequential'); the same for 'batch_rebalance'"),
    ({"fsdp": "shard_grad_op"}, "Forge's FSDP2 shards every weight, each decoder layer a unit (transformers'",
     "'full_shard auto_wrap'); set fsdp=True"),
    ({"model_init_kwargs": {"attn_implementation": "flash_attention_2"}}, "Forge loads a model by name with",
     "its dtype only; load it yourself (AutoModelForCausalLM.from_pretrained(name, ...)) and pass the model",
     "object (the same for device_map and the other from_pretrained keywords)"),
    ({"gradient_checkpointing_kwargs": {"use_reentrant": True}}, "Forge checkpoints non-reentrantly; give",
     "{'use_reentrant': False} or leave it out"),
    ({"use_vllm": True, "vllm_importance_sampling_clip_min": 0.5}, "Forge's correction for vLLM's",
     "sampling (rollout_is) truncates or masks weights above one threshold only; give",
     "vllm_importance_sampling_clip_max and no clip_min"),
    ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "num_generations": 8,
      "generation_batch_size": 8}, "an optimizer step of 6 completions straddles generations of 8, part of a",
     "group: Forge cuts a generation into whole optimizer steps or trains whole groups; make",
     "steps_per_generation a multiple of gradient_accumulation_steps, or per_device_train_batch_size x",
     "gradient_accumulation_steps x processes a multiple of num_generations (docs/from-trl.md#the-batch)"),
    ({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "steps_per_generation": 2,
      "num_iterations": 2}, "TRL reuses each of a step's generations num_iterations times inside that one",
     "optimizer step; Forge's num_iterations takes optimizer steps over the same rollouts; leave",
     "steps_per_generation out"),
    ({"per_device_train_batch_size": 8, "steps_per_generation": 4, "max_steps": 5}, "a generation feeds 4",
     "optimizer steps, and every one of them trains before a checkpoint or the end, so a resumed run repeats",
     "nothing: make max_steps a multiple of 4"),
]

REFUSED_VALUES: list[tuple[dict, str]] = [(config, " ".join(why)) for config, *why in _REFUSED]
"""TRL configs that TRL 1.16 accepts and Forge refuses: (the config, why and what to set). The TRL_REFUSED
names given a value other than off (trl_names.py) are refused too, each with its reason in the table of
names; so is GRPOTrainer's quantization_config given a value (Forge trains unquantized weights)."""


__all__ = ["LOGGED_SAMPLES", "REFUSED_VALUES", "UNSET_WHEN_NONE", "WHOLE_COUNTS", "field_value", "is_unset"]
