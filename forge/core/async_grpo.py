"""TRL's async GRPO surface: `from forge import AsyncGRPOConfig, AsyncGRPOTrainer` runs a script written for
`trl.experimental.async_grpo` (TRL 1.16; a stable trainer from TRL 1.18) after changing only the import.

Underneath there is one engine: AsyncGRPOConfig is GRPOConfig with max_staleness=1 (one step off) by default,
and AsyncGRPOTrainer is GRPOTrainer, whose steps take their groups from the rollout worker
(forge/core/rollout_worker.py) instead of sampling them in the step. TRL's AsyncGRPOConfig fields are recorded
in forge/core/trl_fields.py (TRL_ASYNC_GRPO_FIELDS) and classified in forge/core/trl_names.py like
GRPOConfig's: mapped, ignored or refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge.core.config import GRPOConfig
from forge.core.trainer import GRPOTrainer
from forge.core.trl_attributes import with_trl_fields


@with_trl_fields
@dataclass(init=False)
class AsyncGRPOConfig(GRPOConfig):
    """GRPOConfig sampling one step ahead of the update by default (max_staleness=1; TRL's default is 4, a
    bound rather than Forge's fixed schedule); every other field and default is GRPOConfig's."""

    max_staleness: int | None = 1


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with a rollout worker, taking TRL's AsyncGRPOTrainer arguments in its order: model (a name
    or a model object), reward_funcs, args (default AsyncGRPOConfig()), train_dataset, processing_class,
    callbacks, optimizers, peft_config, tools, environment_factory. A config whose max_staleness is None gets
    1: this trainer samples ahead. Forge's own keywords (tokenizer=, reward_fn=, config=, eval_dataset=, ...)
    work too. TRL's `optimizers`, `rollout_worker` and `weight_transfer` hooks are refused when given: Forge's
    optimizer is AdamW on the config's learning rate, and its worker and weight transfer are its own."""

    def __init__(
        self,
        model,
        reward_funcs=None,
        args=None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
        **forge_keywords,
    ):
        for name, value in (("optimizers", optimizers if any(o is not None for o in optimizers) else None),
                            ("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
            if value is not None:
                raise TypeError(
                    f"AsyncGRPOTrainer({name}=...): Forge's optimizer is torch's AdamW on the config's "
                    f"learning_rate, and its rollout worker and weight transfer are its own "
                    f"(forge/core/rollout_worker.py); leave {name} out"
                )
        config = forge_keywords.pop("config", None) or args  # Forge's name or TRL's
        config = AsyncGRPOConfig() if config is None else config
        if config.max_staleness is None:
            config = config.replace(max_staleness=1)  # the TRL values given read back as before
        super().__init__(model, reward_funcs=reward_funcs, config=config, train_dataset=train_dataset,
                         processing_class=processing_class, callbacks=callbacks, peft_config=peft_config,
                         tools=tools, environment_factory=environment_factory, **forge_keywords)


__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer"]
