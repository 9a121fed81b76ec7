"""TRL's names as attributes of a GRPOConfig, and its construction from Forge's names or TRL's: what a TRL
script does with its config after building it (docs/from-trl.md).

    args.num_generations                   a mapped name: the Forge field it stands for (group_size), as it
                                           is now
    args.bf16, args.eval_strategy, ...     a converted name: the value given while the Forge fields it set
                                           still hold what it set, else what those fields say now (dtype ==
                                           'bfloat16')
    args.dataloader_num_workers, ...       an ignored or refused name: the value given, else TRL's default
    args.beta = 0.1                        sets kl_beta; a converted name sets the fields it converts to (the
                                           batch names: TRL's arithmetic over the config as TRL sees it); an
                                           ignored name is kept; a refused one is refused unless off

dataclasses.fields(GRPOConfig), to_dict() and == stay Forge's fields only, so checkpoints and docs/config.md
do not change; the TRL values given are kept beside them.

GRPOConfig declares dtype, lora_r, lora_alpha, lora_dropout and lora_target_modules init=False: transformers'
HfArgumentParser, which TRL's TrlParser extends, makes flags of the init fields only, and TRL's scripts parse
the GRPOConfig in one parser with TRL's ModelConfig, which has those names too (a script passes ModelConfig's
dtype as model_init_kwargs, its lora_* as peft_config). Forge's __init__ takes them all the same, and an
instance shows dataclasses.replace every field as an init field (InitFields), so replace() keeps them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from forge.core.trl_batch import BATCH_NAMES, generation_batch_of, per_device_of, steps_per_generation_of
from forge.core.trl_flags import FLAG_TYPES, UNSET, asked_by_argument_parser, parser_fields
from forge.core.trl_names import TRL_CONVERTED, TRL_IGNORED, TRL_NAMES, TRL_REFUSED, convert_names

TRL_DEFAULTS = {
    "accelerator_config": None,
    "activation_checkpointing_kwargs": None,
    "batch_eval_metrics": False,
    "bf16_full_eval": False,
    "cache_implementation": None,
    "cast_lm_head_to_fp32": False,
    "chat_template_kwargs": None,
    "data_seed": None,
    "dataloader_drop_last": False,
    "dataloader_in_order": True,
    "dataloader_multiprocessing_context": None,
    "dataloader_num_workers": 0,
    "dataloader_persistent_workers": False,
    "dataloader_pin_memory": True,
    "dataloader_prefetch_factor": None,
    "ddp_backend": None,
    "ddp_broadcast_buffers": None,
    "ddp_bucket_cap_mb": None,
    "ddp_find_unused_parameters": None,
    "ddp_static_graph": None,
    "ddp_timeout": 1800,
    "debug": "",
    "deepspeed": None,
    "disable_dropout": False,
    "disable_tqdm": None,
    "do_eval": False,
    "do_predict": False,
    "do_train": False,
    "ds3_gather_for_generation": True,
    "enable_jit_checkpoint": False,
    "eval_accumulation_steps": None,
    "eval_delay": 0,
    "eval_do_concat_batches": True,
    "eval_use_gather_object": False,
    "fork_threshold_tokens": 1024,
    "fp16_full_eval": False,
    "fsdp_config": None,
    "full_determinism": False,
    "generation_kwargs": None,
    "gradient_checkpointing_kwargs": None,
    "greater_is_better": None,
    "hub_always_push": False,
    "hub_model_id": None,
    "hub_private_repo": None,
    "hub_revision": None,
    "hub_strategy": "every_save",
    "hub_token": None,
    "ignore_data_skip": False,
    "include_for_metrics": [],
    "include_num_input_tokens_seen": "no",
    "label_names": None,
    "label_smoothing_factor": 0.0,
    "length_column_name": "length",
    "liger_kernel_config": None,
    "load_best_model_at_end": False,
    "local_rank": -1,
    "log_completions_hub_repo": None,
    "log_level": "passive",
    "log_level_replica": "warning",
    "log_multimodal": True,
    "log_on_each_node": True,
    "log_unique_prompts": False,
    "logging_first_step": False,
    "logging_nan_inf_filter": True,
    "lr_scheduler_kwargs": None,
    "max_inflight_tasks": -1,
    "metric_for_best_model": None,
    "min_p": None,
    "neftune_noise_alpha": None,
    "num_completions_to_print": None,
    "num_generations_eval": None,
    "optim_args": None,
    "optim_target_modules": None,
    "pad_to_multiple_of": "auto",
    "parallelism_config": None,
    "peft_config": None,
    "per_device_eval_batch_size": 8,
    "prediction_loss_only": False,
    "push_to_hub": False,
    "queue_maxsize": 1024,
    "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512,
    "remove_unused_columns": False,
    "repetition_penalty": 1.0,
    "request_timeout": 600,
    "restore_callback_states_from_checkpoint": False,
    "router_aux_loss_coef": None,
    "save_on_each_node": False,
    "save_only_model": False,
    "skip_memory_metrics": True,
    "sync_ref_model": False,
    "tf32": None,
    "token_budget": None,
    "torch_compile": False,
    "torch_compile_backend": None,
    "torch_compile_mode": None,
    "torch_empty_cache_steps": None,
    "trackio_bucket_id": None,
    "trackio_space_id": None,
    "trackio_static_space_id": None,
    "transformers_continuous_batching_config": None,
    "trust_remote_code": False,
    "use_cache": False,
    "use_cpu": False,
    "use_liger_kernel": False,
    "use_liger_loss": None,
    "use_transformers_continuous_batching": False,
    "use_transformers_paged": False,
    "vespo_k_neg": 3.0,
    "vespo_k_pos": 2.0,
    "vespo_lambda_neg": 2.0,
    "vespo_lambda_pos": 3.0,
    "vllm_enable_sleep_mode": False,
    "vllm_group_port": 51216,
    "vllm_importance_sampling_cap": None,
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_max_model_length": None,
    "vllm_model_impl": "vllm",
    "vllm_structured_outputs_regex": None,
    "vllm_tensor_parallel_size": 1,
    "weight_sync_timeout": 1800,
}
"""TRL 1.16's GRPOConfig / AsyncGRPOConfig defaults (transformers 5.24's TrainingArguments where TRL keeps
them) of the names that read back no Forge field: the ignored and refused ones and the checkpointing kwargs.
tests/units/test_trl_surface.py compares them with the installed transformers and TRL."""


def _strategy(steps_field: str) -> Callable[[Any], str]:
    return lambda config: "no" if getattr(config, steps_field) == 0 else "steps"


READERS: dict[str, Callable[[Any], Any]] = {
    "per_device_train_batch_size": per_device_of,
    "generation_batch_size": generation_batch_of,
    "steps_per_generation": steps_per_generation_of,
    "report_to": lambda c: [
        name for name in ("wandb", "tensorboard", "trackio") if getattr(c, f"use_{name}")
    ],
    "bf16": lambda c: c.dtype == "bfloat16",
    "fp16": lambda c: c.dtype == "float16",
    "epsilon_high": lambda c: (
        None
        if c.clip_epsilon_high is None
        else c.clip_epsilon_high + (1.0 if c.loss_type == "cispo" else 0.0)
    ),
    "use_vllm": lambda c: c.generation_backend == "vllm",
    "vllm_importance_sampling_correction": lambda c: c.generation_backend != "vllm" or c.rollout_is != "none",
    "vllm_importance_sampling_mode": lambda c: "sequence_mask" if c.rollout_is == "none" else c.rollout_is,
    "vllm_importance_sampling_clip_max": lambda c: c.rollout_is_threshold,
    "auto_find_batch_size": lambda c: c.micro_batch_size == "auto",
    "lr_scheduler_type": lambda c: c.lr_scheduler,
    "warmup_steps": lambda c: round(c.warmup_ratio * c.max_steps) if c.max_steps > 0 else c.warmup_ratio,
    "save_strategy": _strategy("save_steps"),
    "eval_strategy": _strategy("eval_steps"),
    "logging_strategy": lambda c: "steps",
    "train_sampling_strategy": lambda c: "random" if c.shuffle else "sequential",
    "resume_from_checkpoint": lambda c: True if c.resume_from == "latest" else c.resume_from,
    "project": lambda c: c.wandb_project,
    "model_init_kwargs": lambda c: {"dtype": c.dtype} if c.dtype in ("bfloat16", "float16") else None,
}
"""A converted TRL name -> its value from the Forge fields it converts to (a `_fixed` one reads the setting
Forge uses, the checkpointing kwargs TRL's default)."""

ALWAYS_READ = {"report_to"}
"""Names TRL normalises after construction (report_to='wandb' reads ['wandb']): read from the fields, given or
not."""


def is_trl_name(name: str) -> bool:
    return name in TRL_NAMES or name in TRL_CONVERTED or name in TRL_IGNORED or name in TRL_REFUSED


def trl_value(config: Any, name: str) -> Any:
    """What TRL's name `name` reads on `config` (the module docstring)."""
    if name in TRL_NAMES:
        return getattr(config, TRL_NAMES[name])
    given, made = config.__dict__.get("_trl_given", {}), config.__dict__.get("_trl_made", {})
    if name in given and name not in ALWAYS_READ and all(getattr(config, field) == value
                                                           for field, value in made[name].items()):
        return given[name]
    if name in READERS:
        return READERS[name](config)
    if hasattr(TRL_CONVERTED.get(name), "forge_value"):
        return TRL_CONVERTED[name].forge_value
    return copy.copy(TRL_DEFAULTS[name])


def trl_view(config: Any) -> dict:
    """The config's batch in TRL's names: the keyword values TRL would take for the same batch."""
    steps = steps_per_generation_of(config)
    accumulation = steps * config.gradient_accumulation_steps // config.rollout_slices  # passes per step
    return {"per_device_train_batch_size": per_device_of(config), "steps_per_generation": steps,
            "gradient_accumulation_steps": accumulation,
            "num_generations": config.group_size, "num_iterations": config.num_iterations,
            "auto_find_batch_size": config.micro_batch_size == "auto"}


class InitFields:
    """A TRLAttributes dataclass's `__dataclass_fields__`: on the class its own fields (dataclasses.fields, a
    subclass's dataclass decorator), or, read by transformers' HfArgumentParser, the fields it makes flags of
    (trl_flags.py: TRL's names too, and every default unset); on an instance the class's fields with each
    init=False one (dtype, lora_*) shown as an init field: what dataclasses.replace reads, so replace() keeps
    them. Only reads of that one name come here."""

    def __init__(self, fields: dict) -> None:
        self.fields = fields

    def __get__(self, instance: Any, owner: type) -> dict:
        if instance is not None:
            return _init_fields(owner)
        if asked_by_argument_parser():
            return parser_fields(owner, tuple(self.fields.values()))
        return self.fields


def with_trl_fields(cls: type) -> type:
    """A class decorator, above @dataclass: the class's `__dataclass_fields__` as InitFields (TRLAttributes
    also installs it at a subclass's first instance)."""
    if isinstance(cls.__dict__.get("__dataclass_fields__"), dict):
        cls.__dataclass_fields__ = InitFields(cls.__dataclass_fields__)
    return cls


@functools.cache
def _init_fields(cls: type) -> dict:
    """The class's dataclass fields with each init=False one shown as an init field."""
    shown = {}
    for name, field in cls.__dataclass_fields__.items():
        if not field.init:
            field = copy.copy(field)
            field.init = True
        shown[name] = field
    return shown


class TRLAttributes:
    """Mixed into GRPOConfig: its __init__ (keyword values in Forge's names or TRL's) and TRL's names as
    attributes (the module docstring)."""

    def __init__(self, *args: Any, **values: Any) -> None:
        with_trl_fields(type(self))  # once per dataclass
        values = {name: value for name, value in values.items() if value is not UNSET}  # unset parser flags
        names = [f.name for f in dataclasses.fields(self)]
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments, "
                            f"got {len(args)}")
        for name, value in zip(names, args):
            if name in values:
                raise TypeError(f"{type(self).__name__} got two values for {name!r}")
            values[name] = value
        fields, made = convert_names(values, {f.name: f.default for f in dataclasses.fields(self)})
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, fields.get(f.name, f.default))
        object.__setattr__(self, "_trl_given", {name: values[name] for name in made if name in values})
        object.__setattr__(self, "_trl_made", made)

    def __getattr__(self, name: str) -> Any:  # only names that are no attribute: TRL's
        if not name.startswith("_") and is_trl_name(name):
            return trl_value(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if not is_trl_name(name):
            object.__setattr__(self, name, value)
        elif name in TRL_NAMES:
            setattr(self, TRL_NAMES[name], value)
        else:
            current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            values = {name: value}
            if name in BATCH_NAMES:  # TRL's arithmetic over the whole batch, as TRL sees this config
                values = {**trl_view(self), name: value}
                if name == "generation_batch_size":
                    values.pop("steps_per_generation")
            fields, made = convert_names(values, current)
            for field_name, field_value in fields.items():
                object.__setattr__(self, field_name, field_value)
            self._trl_given.update({made_name: values[made_name] for made_name in made})
            self._trl_made.update(made)

    def replace(self, **changes: Any) -> Any:
        """dataclasses.replace(self, **changes), keeping the TRL values given (what they read back)."""
        new = dataclasses.replace(self, **changes)
        object.__setattr__(new, "_trl_given", dict(self._trl_given))
        object.__setattr__(new, "_trl_made", dict(self._trl_made))
        return new


TRLAttributes.__annotations__ = dict(FLAG_TYPES)  # TRL's names as HfArgumentParser reads their types


__all__ = ["TRL_DEFAULTS", "TRLAttributes", "trl_value", "trl_view", "with_trl_fields"]
