"""GRPOTrainer's arguments in Forge's names or TRL's: which is the tokenizer, the rewards and the config."""

from __future__ import annotations

from typing import Any

from forge.core.config import GRPOConfig
from forge.model.lora import lora_fields


def trainer_arguments(tokenizer: Any, reward_fn: Any, config: Any, *, reward_funcs: Any = None,
                      args: Any = None, processing_class: Any = None,
                      peft_config: Any = None) -> tuple[Any, Any, GRPOConfig, str]:
    """GRPOTrainer's arguments in Forge's names or TRL's, as (tokenizer, rewards, config, reward convention).

    TRL's keywords mean: reward_funcs = the rewards, called TRL's way ('trl'); args = the config;
    processing_class = the tokenizer; peft_config = a peft LoraConfig (use_lora with its r, alpha, dropout and
    target modules, as the run's record; GRPOTrainer hands the LoraConfig itself to peft). TRL's positional
    order, GRPOTrainer(model, reward_funcs, args), is recognised by its types: in Forge's, the second argument
    is a tokenizer and the fourth a GRPOConfig."""
    if tokenizer is not None and not hasattr(tokenizer, "convert_tokens_to_ids"):  # TRL: model, rewards, args
        if reward_funcs is not None or (reward_fn is not None and not isinstance(reward_fn, GRPOConfig)):
            raise TypeError("GRPOTrainer(model, tokenizer, reward_fn, config): the second argument is not a "
                            "tokenizer; pass rewards by keyword (reward_funcs= for TRL's calling convention, "
                            "reward_fn= for Forge's)")
        tokenizer, reward_funcs, args = None, tokenizer, reward_fn if args is None else args
        reward_fn = None
    given = [name for name, value in (("reward_fn", reward_fn), ("reward_funcs", reward_funcs),
                                      ("config", config), ("args", args), ("tokenizer", tokenizer),
                                      ("processing_class", processing_class)) if value is not None]
    for forge, trl in (("reward_fn", "reward_funcs"), ("config", "args"), ("tokenizer", "processing_class")):
        if forge in given and trl in given:
            raise TypeError(f"GRPOTrainer got both {forge}= and TRL's {trl}=; give one")
    config = config if config is not None else args if args is not None else GRPOConfig()
    if peft_config is not None:
        config = config.replace(**lora_fields(peft_config))  # GRPOConfig.replace: the TRL values given kept
    rewards = reward_fn if reward_fn is not None else reward_funcs
    if rewards is None:
        raise ValueError("GRPOTrainer needs reward_fn (e.g. reward_fn=ExactMatchReward()), or TRL's "
                         "reward_funcs=[...]")
    return (tokenizer if tokenizer is not None else processing_class, rewards, config,
            "trl" if reward_funcs is not None else "forge")
