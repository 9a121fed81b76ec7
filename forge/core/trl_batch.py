"""TRL's batch arithmetic in Forge's terms: the prompts of one rollout batch (prompts_per_step), the rollout
batches of one optimizer step (gradient_accumulation_steps), the optimizer steps one rollout feeds
(rollout_slices) and the completions of one loss pass (micro_batch_size), from TRL's
per_device_train_batch_size, gradient_accumulation_steps, generation_batch_size, steps_per_generation and
num_generations, so that a TRL config trains on as many prompts and completions per optimizer step as in TRL.

TRL 1.16, GRPOConfig.__post_init__ (trl/trainer/grpo_config.py) and GRPOTrainer._prepare_inputs /
_get_train_sampler (trl/trainer/grpo_trainer.py):

    B = per_device_train_batch_size x processes        completions of one forward/backward (all processes)
    steps_per_generation                                default gradient_accumulation_steps; or
                                                        generation_batch_size / B (which must divide)
    generation_batch_size = B x steps_per_generation    generated at once, advantages over it; a multiple of
                                                        num_generations (whole groups); then shuffled and cut
                                                        into steps_per_generation slices of B, one per
                                                        forward/backward
    optimizer step = B x gradient_accumulation_steps completions (transformers' gradient accumulation); a new
    generation every steps_per_generation x num_iterations forward/backward passes

Forge generates a rollout batch (prompts_per_step prompts x group_size) at once, with advantages over it;
gradient_accumulation_steps rollout batches make an optimizer step, num_iterations passes train on them, and
rollout_slices cuts each pass into that many optimizer steps, each on a slice of the completions
(forge/core/rollout_slices.py). So:

    steps_per_generation divides TRL's gradient_accumulation_steps (equal by default): whole generations per
        optimizer step, exactly: prompts_per_step = generation_batch_size / num_generations, Forge's
        gradient_accumulation_steps = TRL's / steps_per_generation (1 by default), rollout_slices = 1.
    steps_per_generation a multiple of gradient_accumulation_steps: one generation feeds several optimizer
        steps, each a slice of it, as in TRL: prompts_per_step = generation_batch_size / num_generations,
        Forge's gradient_accumulation_steps = 1, rollout_slices = steps_per_generation /
        gradient_accumulation_steps.
        A slice may hold part of a group; its advantages are the whole generation's. TRL's LoRA Without Regret
        recipe (per_device_train_batch_size=1, gradient_accumulation_steps=4, num_generations=8,
        generation_batch_size=8) is prompts_per_step=1, rollout_slices=2, micro_batch_size=1.
    neither (an optimizer step straddles two generations): Forge generates each optimizer step's B x
        gradient_accumulation_steps completions for that step when they are whole groups (the same prompts and
        completions per step, sampled by the current weights); refused otherwise, saying what to set.

TRL's num_iterations is Forge's when one generation is one optimizer step, and when a generation is cut into
slices: TRL then makes a generation every steps_per_generation x num_iterations passes and trains the slices
in order, num_iterations times over (GRPOTrainer._prepare_inputs), as Forge does. With several generations
per step TRL reuses each of them num_iterations times inside one optimizer step, which Forge does not do
(refused).

micro_batch_size = per_device_train_batch_size (completions per forward/backward on a process, TRL's memory
knob) when it is smaller than a process's share of the rollout batch, else 0 (the whole share in one pass);
the loss is the same either way, normalised over the whole step.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

BATCH_NAMES = ("per_device_train_batch_size", "generation_batch_size", "steps_per_generation")
"""TRL's names whose values make Forge's batch fields together (with num_generations and
gradient_accumulation_steps)."""

MAPPING = "docs/from-trl.md#the-batch"
"""Where the mapping of TRL's batch names is described, for the refusals to point at."""

TRL_PER_DEVICE, TRL_ACCUMULATION = 8, 1
"""TRL's defaults for per_device_train_batch_size and gradient_accumulation_steps (transformers'
TrainingArguments)."""


def processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def speaks_trl_batch(values: dict) -> bool:
    """Whether keyword values describe the batch in TRL's terms: a TRL batch name, or num_generations without
    Forge's prompts_per_step (TRL's defaults then hold: 8 completions per device and step)."""
    return any(name in values for name in BATCH_NAMES) or ("num_generations" in values
                                                            and "prompts_per_step" not in values)


def _count(name: str, value: Any) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise TypeError(f"{name}={value!r} must be a whole number >= 1")
    return int(value)


def forge_batch(values: dict, group_size: int, world_size: int | None = None) -> dict:
    """Forge's prompts_per_step, gradient_accumulation_steps, rollout_slices and micro_batch_size for keyword
    values in TRL's names (TRL's defaults for those not given; `group_size` is num_generations); TypeError, as
    TRL's __post_init__ or naming what to set, for a batch TRL refuses or Forge cannot train."""
    world = processes() if world_size is None else world_size
    per_device = _count("per_device_train_batch_size",
                        values.get("per_device_train_batch_size", TRL_PER_DEVICE))
    accumulation = _count("gradient_accumulation_steps",
                          values.get("gradient_accumulation_steps", TRL_ACCUMULATION))
    generation, steps = values.get("generation_batch_size"), values.get("steps_per_generation")
    per_pass = per_device * world  # B
    if generation is not None and steps is not None:
        raise TypeError("generation_batch_size and steps_per_generation: give one (TRL refuses both too)")
    if generation is not None:
        if _count("generation_batch_size", generation) % per_pass:
            raise TypeError(
                f"generation_batch_size={generation} must be divisible by per_device_train_batch_size x "
                f"processes = {per_pass}, as in TRL"
            )
        steps = generation // per_pass
    steps = accumulation if steps is None else _count("steps_per_generation", steps)
    generation = per_pass * steps
    if generation % group_size:
        raise TypeError(
            f"generation_batch_size={generation} (per_device_train_batch_size x processes x "
            f"steps_per_generation) must be a multiple of num_generations={group_size}: whole groups, "
            f"as in TRL ({MAPPING})"
        )
    per_step = per_pass * accumulation  # completions of one optimizer step
    batch = _generations_and_steps(values, generation, steps, accumulation, per_step, group_size)
    share = batch["prompts_per_step"] * group_size // world  # this process's completions of a rollout batch
    if not values.get("auto_find_batch_size"):
        batch["micro_batch_size"] = per_device if per_device < share else 0
    return batch


def _generations_and_steps(values: dict, generation: int, steps: int, accumulation: int, per_step: int,
                           group_size: int) -> dict:
    """prompts_per_step, gradient_accumulation_steps and rollout_slices for a generation of `generation`
    completions made every `steps` passes and an optimizer step of `accumulation` passes (`per_step`
    completions): whole generations per optimizer step, one generation cut into several, or neither (the
    module docstring); TypeError naming what to set where Forge cannot train it."""
    if accumulation % steps == 0:  # whole generations per optimizer step
        if values.get("num_iterations", 1) > 1 and steps != accumulation:
            raise TypeError(
                f"num_iterations={values['num_iterations']} with steps_per_generation={steps} < "
                f"gradient_accumulation_steps={accumulation}: TRL reuses each generation num_iterations "
                f"times inside one optimizer step, which is not Forge's num_iterations (optimizer steps "
                f"over the same rollouts); leave steps_per_generation and generation_batch_size out"
            )
        return {"prompts_per_step": generation // group_size,
                "gradient_accumulation_steps": accumulation // steps, "rollout_slices": 1}
    if steps % accumulation == 0:  # one generation, cut into steps / accumulation optimizer steps
        return {"prompts_per_step": generation // group_size, "gradient_accumulation_steps": 1,
                "rollout_slices": steps // accumulation}
    if per_step % group_size == 0:
        # a generation spans optimizer steps: each step's own prompts, for that step
        return {"prompts_per_step": per_step // group_size, "gradient_accumulation_steps": 1,
                "rollout_slices": 1}
    given = next((name for name in ("steps_per_generation", "generation_batch_size") if name in values),
                 "per_device_train_batch_size")
    raise TypeError(
        f"TRL trains each optimizer step on {per_step} completions (per_device_train_batch_size x "
        f"gradient_accumulation_steps x processes) of its generations of {generation}, which it "
        f"straddles, part of a group; Forge cuts a generation into whole optimizer steps or trains whole "
        f"groups ({given} is mapped so: {MAPPING}). Make steps_per_generation={steps} a multiple of "
        f"gradient_accumulation_steps (e.g. gradient_accumulation_steps={steps}: one generation per "
        f"optimizer step), or that product a multiple of num_generations={group_size}"
    )


def per_device_of(config: Any, world_size: int | None = None) -> int:
    """TRL's per_device_train_batch_size of a config: completions per forward/backward on a process."""
    world = processes() if world_size is None else world_size
    micro = config.micro_batch_size
    return (micro if isinstance(micro, int) and micro > 0
            else config.prompts_per_step * config.group_size // world // config.rollout_slices)


def generation_batch_of(config: Any) -> int:
    """TRL's generation_batch_size of a config: the completions generated at once (a rollout batch)."""
    return config.prompts_per_step * config.group_size


def steps_per_generation_of(config: Any, world_size: int | None = None) -> int:
    """TRL's steps_per_generation of a config: forward/backward passes per generation."""
    world = processes() if world_size is None else world_size
    return max(1, generation_batch_of(config) // (per_device_of(config, world) * world))
