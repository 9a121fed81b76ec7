"""TRL's GRPOConfig names: one table of what each means in Forge (docs/from-trl.md).

`forge_names` turns keyword values given in TRL's names into Forge's fields; GRPOConfig applies it to every
construction, and the command line takes the same names as flags (cli_config.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from difflib import get_close_matches
from typing import Any

TRL_NAMES = {
    "num_generations": "group_size",
    "max_completion_length": "max_new_tokens",
    "beta": "kl_beta",
    "epsilon": "clip_epsilon",
    "lr_scheduler_type": "lr_scheduler",
    "use_bias_correction_kl": "kl_bias_correction",
    "use_adaptive_entropy": "adaptive_entropy",
}
"""TRL name -> the Forge field that means the same thing. Names TRL and Forge share (loss_type, scale_rewards,
num_iterations, temperature, learning_rate, gradient_accumulation_steps, max_prompt_length, logging_steps,
save_steps, max_steps, seed, top_p, top_k, ...) need no entry."""


def _completions_per_device(value: Any, values: dict) -> dict:
    """TRL's per_device_train_batch_size counts completions per process and step; Forge's prompts_per_step counts
    prompts over all processes: prompts_per_step = per_device_train_batch_size x processes / group_size."""
    group = values.get("num_generations", values["group_size"])
    total = int(value) * int(os.environ.get("WORLD_SIZE", "1"))
    if total % group:
        raise TypeError(f"per_device_train_batch_size={value} (TRL: completions per process) must be a multiple of "
                        f"num_generations={group}; or set Forge's prompts_per_step (prompts per rollout batch)")
    return {"prompts_per_step": total // group}


def _report_to(value: Any, values: dict) -> dict:
    """TRL's report_to ("wandb", "tensorboard", "trackio", "none", "all", or a list) -> Forge's use_* switches."""
    wanted = {value} if isinstance(value, str) else set(value or ())
    known = {"wandb", "tensorboard", "trackio"}
    if wanted - known - {"none", "all"}:
        raise TypeError(f"report_to={value!r}: Forge reports to {sorted(known)} (and always to the console and "
                        f"training_log.jsonl)")
    wanted = known if "all" in wanted else wanted & known
    return {f"use_{name}": name in wanted for name in sorted(known)}


def _precision(dtype: str) -> Callable[[Any, dict], dict]:
    return lambda value, values: {"dtype": dtype} if value else {}


def _epsilon_high(value: Any, values: dict) -> dict:
    """TRL's epsilon_high caps the ratio at 1 + epsilon_high, except under loss_type='cispo', where it caps it at
    epsilon_high itself; Forge's clip_epsilon_high always means 1 + clip_epsilon_high."""
    cispo = values.get("loss_type") == "cispo"
    return {"clip_epsilon_high": value - 1.0 if cispo and value is not None else value}


TRL_CONVERTED: dict[str, Callable[[Any, dict], dict]] = {
    "per_device_train_batch_size": _completions_per_device,
    "report_to": _report_to,
    "bf16": _precision("bfloat16"),
    "fp16": _precision("float16"),
    "epsilon_high": _epsilon_high,
    "use_vllm": lambda value, values: {"generation_backend": "vllm"} if value else {},
}
"""TRL name -> converter(value, every field: given or default) -> Forge fields: names whose value Forge states another way."""

TRL_REFUSED = {
    "generation_batch_size": "set prompts_per_step (prompts per rollout batch) and gradient_accumulation_steps",
    "steps_per_generation": "set gradient_accumulation_steps: the rollout batches of one optimizer step",
    "log_completions": "Forge writes log_completions samples per logged step to samples.jsonl (an int, 0 = none)",
    "num_completions_to_print": "set log_completions: how many samples per logged step go to samples.jsonl",
    "use_liger_loss": "Forge computes the loss in chunks itself (logprob_chunk_size)",
    "vllm_importance_sampling_correction": "set rollout_is ('token_truncate', ...) and rollout_is_threshold",
    "peft_config": "pass it to GRPOTrainer(..., peft_config=LoraConfig(...)), or set use_lora and lora_r, ...",
}
"""TRL name -> why Forge does not take it as is, and what to set instead."""


def forge_names(values: dict, defaults: dict[str, Any]) -> dict:
    """Keyword values with TRL's names turned into Forge's fields (the tables above); `defaults` maps every Forge
    field to its default. An unknown name, a refused one, or a TRL name given with its Forge field raises
    TypeError naming what to use."""
    known = set(defaults)
    out = {k: v for k, v in values.items() if k in known}
    unknown = sorted(k for k in values if k not in known and k not in TRL_NAMES and k not in TRL_CONVERTED
                     and k not in TRL_REFUSED)
    if unknown:
        guesses = {k: get_close_matches(k, sorted(known | set(TRL_NAMES) | set(TRL_CONVERTED)), n=2) for k in unknown}
        hint = "; ".join(f"{k}: did you mean {' or '.join(g)}?" for k, g in guesses.items() if g)
        raise TypeError(f"unknown GRPOConfig fields {unknown}{'; ' + hint if hint else ''} (every field: "
                        f"docs/config.md, `forge train --help`)")
    for name, value in values.items():
        if name in known:
            continue
        if name in TRL_REFUSED:
            raise TypeError(f"GRPOConfig: TRL's {name!r} has no Forge equivalent as is: {TRL_REFUSED[name]}")
        converted = ({TRL_NAMES[name]: value} if name in TRL_NAMES
                     else TRL_CONVERTED[name](value, {**defaults, **values}))
        for field_name, field_value in converted.items():
            if field_name in values:
                raise TypeError(f"GRPOConfig got both {name!r} (TRL's name) and {field_name!r}; give one")
            out[field_name] = field_value
    return out
