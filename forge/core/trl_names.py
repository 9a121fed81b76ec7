"""TRL's GRPOConfig names, and every field of transformers' TrainingArguments it inherits: one table of what
each means in Forge (docs/from-trl.md, generated from it by forge/core/config_docs.py).

Every name is in one class:

    a GRPOConfig field     the same name, the same meaning (learning_rate, max_steps, seed, ...)
    TRL_NAMES              mapped: another name for a Forge field (num_generations -> group_size)
    TRL_CONVERTED          mapped: a value Forge states another way (bf16=True -> dtype='bfloat16'); a
                           converter refuses, with the reason, a value Forge cannot honour
                           (save_strategy='epoch')
    TRL_IGNORED            accepted, no effect, with the one-line reason (dataloader_num_workers: no
                           DataLoader)
    TRL_REFUSED            refused with the reason and what to set instead, unless given its "off" value
                           (None, False, 0, empty, or TRL_NEUTRAL's): honouring it silently would mislead
                           (push_to_hub)

`convert_names` turns keyword values given in these names into Forge's fields; GRPOConfig applies it to every
construction and reads the names back (trl_attributes.py), and the command line takes the mapped names as
flags (cli_config.py). TRL's batch names are converted together, by TRL's arithmetic (trl_batch.py). The names
the table covers are recorded in forge/core/trl_fields.py (transformers 5.24, TRL 1.16);
tests/units/test_trl_table.py fails when an installed transformers or TRL has a field the table does not
classify.
"""

from __future__ import annotations

from collections.abc import Callable
from difflib import get_close_matches
from typing import Any

from forge.core.trl_batch import BATCH_NAMES, forge_batch, speaks_trl_batch
from forge.core.trl_values import field_value, is_unset

TRL_NAMES = {
    "num_generations": "group_size",
    "max_completion_length": "max_new_tokens",
    "beta": "kl_beta",
    "epsilon": "clip_epsilon",
    "use_bias_correction_kl": "kl_bias_correction",
    "use_adaptive_entropy": "adaptive_entropy",
    "activation_checkpointing": "gradient_checkpointing",
    "run_name": "wandb_run_name",
    "eval_on_start": "eval_before_training",
    "shuffle_dataset": "shuffle",
    "heartbeat_stale_after_s": "rollout_timeout",
}
"""TRL name -> the Forge field that means the same thing. Names TRL and Forge share (loss_type, scale_rewards,
num_iterations, temperature, learning_rate, gradient_accumulation_steps, logging_steps, save_steps, max_steps,
seed, top_p, top_k, ...) need no entry."""

Converter = Callable[[Any, dict], dict]


def _batch(doc: str) -> Converter:
    """A converter for one of TRL's batch names (the table's entry); convert_names converts them together,
    with forge_batch (forge/core/trl_batch.py)."""

    def convert(value: Any, values: dict) -> dict:
        return forge_batch(values, values.get("num_generations", values["group_size"]))

    convert.__doc__ = doc
    return convert


def _report_to(value: Any, values: dict) -> dict:
    """use_wandb, use_tensorboard, use_trackio from "wandb", "tensorboard", "trackio", "none", "all" or a
    list."""
    wanted = {value} if isinstance(value, str) else set(value or ())
    known = {"wandb", "tensorboard", "trackio"}
    if wanted - known - {"none", "all"}:
        raise TypeError(
            f"report_to={value!r}: Forge reports to {sorted(known)} (and always to the console and "
            f"training_log.jsonl)"
        )
    wanted = known if "all" in wanted else wanted & known
    return {f"use_{name}": name in wanted for name in sorted(known)}


def _precision(dtype: str) -> Converter:
    def convert(value: Any, values: dict) -> dict:
        return {"dtype": dtype} if value else {}

    convert.__doc__ = (f"dtype='{dtype}' when true (Forge's default 'auto' picks bf16 where the hardware "
                       f"runs it fast)")
    return convert


def _auto_batch(value: Any, values: dict) -> dict:
    """micro_batch_size='auto' when true: the largest loss-pass micro-batch that fits max_memory_mb."""
    return {"micro_batch_size": "auto"} if value else {}


def _use_vllm(value: Any, values: dict) -> dict:
    """generation_backend='vllm' when true, and TRL's correction for vLLM's sampling with it
    (vllm_importance_sampling_correction, on by default) unless that is False or rollout_is is given."""
    return {"generation_backend": "vllm"} if value else {}


def _vllm_correction(value: Any, values: dict) -> dict:
    """With use_vllm (TRL's default when use_vllm=True): rollout_is = vllm_importance_sampling_mode
    ('sequence_mask' unless given; the same four modes), rollout_is_threshold =
    vllm_importance_sampling_clip_max (3.0 unless given; the deprecated vllm_importance_sampling_cap too): the
    weight pi_old / pi_sampler as TRL computes it. A lower bound (vllm_importance_sampling_clip_min) or no
    upper one is refused: Forge's rollout_is truncates or masks above its threshold only. Without vLLM TRL
    applies nothing, nor does Forge."""
    if not value or not (values.get("use_vllm") or values.get("generation_backend") == "vllm"):
        return {}
    mode = values.get("vllm_importance_sampling_mode", "sequence_mask")
    cap = values.get("vllm_importance_sampling_cap")
    threshold = cap if cap is not None else values.get("vllm_importance_sampling_clip_max", 3.0)
    if values.get("vllm_importance_sampling_clip_min") is not None or threshold is None:
        raise TypeError(
            "vllm_importance_sampling_clip_min / vllm_importance_sampling_clip_max=None: Forge's correction "
            "for vLLM's sampling (rollout_is) truncates or masks weights above one threshold only; give "
            "vllm_importance_sampling_clip_max (or rollout_is_threshold) and no clip_min")
    return {"rollout_is": mode, "rollout_is_threshold": float(threshold)}


def _read_by_correction(doc: str) -> Converter:
    """A setting of vllm_importance_sampling_correction, which reads it (its row)."""
    def convert(value: Any, values: dict) -> dict:
        return {}

    convert.__doc__ = doc
    return convert


def _epsilon_high(value: Any, values: dict) -> dict:
    """clip_epsilon_high; with loss_type='cispo' TRL caps the ratio at epsilon_high itself, Forge at 1 +
    clip_epsilon_high, so 5.0 becomes 4.0."""
    cispo = values.get("loss_type") == "cispo"
    return {"clip_epsilon_high": value - 1.0 if cispo and value is not None else value}


def _lr_scheduler(value: Any, values: dict) -> dict:
    """lr_scheduler: 'cosine', 'linear', 'constant' as they are, 'constant_with_warmup' as 'constant' (Forge's
    schedules all start with the warmup_ratio warmup)."""
    return {"lr_scheduler": "constant" if value == "constant_with_warmup" else str(value)}


def _warmup_steps(value: Any, values: dict) -> dict:
    """warmup_ratio: a value below 1 is the ratio itself (as in transformers); whole steps over max_steps."""
    if value < 1:
        return {"warmup_ratio": float(value)}
    if values["max_steps"] > 0:
        return {"warmup_ratio": value / values["max_steps"]}
    raise TypeError(
        f"warmup_steps={value}: with no max_steps Forge cannot turn steps into its warmup_ratio "
        f"before the dataset is read; set warmup_ratio (the fraction of the run spent warming up)"
    )


def _steps_strategy(name: str, every: str, off: dict | None, default_every: str | None = None) -> Converter:
    """TRL's save/eval/logging_strategy: 'steps' keeps `every`, 'no' sets `off` (None: refused); 'epoch' and
    'best' are refused (Forge counts in optimizer steps)."""

    def convert(value: Any, values: dict) -> dict:
        if value == "steps":  # eval_strategy='steps' without eval_steps: every logging_steps, as in TRL
            return {every: values[default_every]} if default_every and values[every] == 0 else {}
        if value in ("no", False) and off is not None:  # False: the command line reads `no` as a bool
            return off
        if value in ("no", False):
            raise TypeError(f"{name}='no': Forge always writes training_log.jsonl; set {every} to log less "
                            f"often")
        raise TypeError(
            f"{name}={value!r}: Forge counts {every} in optimizer steps; use 'steps' with {every} (one "
            f"epoch is rows / (prompts_per_step x gradient_accumulation_steps) x num_iterations steps)"
        )

    said = "refused" if off is None else "= " + ", ".join(f"{k}={v}" for k, v in off.items())
    convert.__doc__ = (f"{every}: 'steps' as given, 'no' {said}; 'epoch' refused (Forge counts in optimizer "
                       f"steps)")
    return convert


def _sampling(value: Any, values: dict) -> dict:
    """shuffle: 'random' = True, 'sequential' = False."""
    if value not in ("random", "sequential"):
        raise TypeError(f"train_sampling_strategy={value!r}: Forge shuffles ('random') or keeps the order "
                        f"('sequential'), set with shuffle")
    return {"shuffle": value == "random"}


def _resume(value: Any, values: dict) -> dict:
    """resume_from: True = 'latest' (the newest checkpoint in output_dir), a path as it is."""
    return {} if value in (None, False) else {"resume_from": "latest" if value is True else str(value)}


def _project(value: Any, values: dict) -> dict:
    """wandb_project and trackio_project: the project the trackers log to."""
    return {"wandb_project": str(value), "trackio_project": str(value)}


_LOADING_AS_FORGE_DOES = {"revision": ("main",), "trust_remote_code": (False,),
                          "low_cpu_mem_usage": (True, False)}
"""from_pretrained keywords Forge's own loading honours with these values; TRL's scripts pass them (and others
as None: attn_implementation, device_map, quantization_config)."""


def _model_init_kwargs(value: Any, values: dict) -> dict:
    """dtype: a torch_dtype / dtype of bfloat16 or float16 (weights TRL trains in that dtype; Forge keeps
    float32 masters and computes in it); float32 and auto change nothing (Forge's masters are float32, its
    compute dtype
    is bf16 / fp16 / dtype's). revision='main', trust_remote_code=False and None values are accepted."""
    kwargs = dict(value or {})
    dtype = str(kwargs.pop("dtype", kwargs.pop("torch_dtype", None))).removeprefix("torch.")
    kwargs = {k: v for k, v in kwargs.items() if v is not None and v not in _LOADING_AS_FORGE_DOES.get(k, ())}
    if kwargs:
        raise TypeError(
            f"model_init_kwargs {sorted(kwargs)}: Forge loads a model by name with its dtype only; load "
            f"it yourself (AutoModelForCausalLM.from_pretrained(name, ...)) and pass the model object"
        )
    return {"dtype": dtype} if dtype in ("bfloat16", "float16") else {}


def _checkpointing_kwargs(value: Any, values: dict) -> dict:
    """gradient_checkpointing's arguments: Forge's checkpointing is non-reentrant ({'use_reentrant':
    False})."""
    if dict(value or {}) not in ({}, {"use_reentrant": False}):
        raise TypeError(
            f"gradient_checkpointing_kwargs={value!r}: Forge checkpoints non-reentrantly and takes no "
            f"other arguments; leave it out or give {{'use_reentrant': False}}"
        )
    return {}


def _fixed(name: str, what_forge_does: str, *accepted: Any) -> Converter:
    """A setting Forge has fixed: accepted when its value is what Forge does, refused saying what that is."""

    def convert(value: Any, values: dict) -> dict:
        if value in accepted:
            return {}
        raise TypeError(f"{name}={value!r}: {what_forge_does}; leave it out")

    convert.__doc__ = f"{' or '.join(map(repr, accepted))} only: {what_forge_does}"
    convert.forge_value = accepted[0]  # what it reads back: the setting Forge uses
    return convert


TRL_CONVERTED: dict[str, Converter] = {
    "per_device_train_batch_size": _batch(
        "TRL's arithmetic with gradient_accumulation_steps, generation_batch_size or steps_per_generation "
        "and num_generations (forge/core/trl_batch.py): the same prompts and completions per optimizer step "
        "as in TRL. "
        "micro_batch_size = it (completions per forward/backward on a process) when it is smaller than the "
        "process's share of a rollout batch"
    ),
    "generation_batch_size": _batch(
        "prompts_per_step = it / num_generations: a rollout batch is a generation (forge/core/trl_batch.py)"
    ),
    "steps_per_generation": _batch(
        "generation_batch_size = per_device_train_batch_size x processes x it; gradient_accumulation_steps = "
        "the generations of an optimizer step. Several optimizer steps per generation (it a multiple of "
        "gradient_accumulation_steps): rollout_slices = it / gradient_accumulation_steps, each step on a "
        "slice of the generation (not num_iterations, which trains each step on the whole rollout; "
        "forge/core/trl_batch.py)"
    ),
    "report_to": _report_to,
    "bf16": _precision("bfloat16"),
    "fp16": _precision("float16"),
    "epsilon_high": _epsilon_high,
    "use_vllm": _use_vllm,
    "vllm_importance_sampling_correction": _vllm_correction,
    "vllm_importance_sampling_mode": _read_by_correction(
        "rollout_is, with vllm_importance_sampling_correction"),
    "vllm_importance_sampling_clip_max": _read_by_correction(
        "rollout_is_threshold, with vllm_importance_sampling_correction"),
    "vllm_importance_sampling_clip_min": _read_by_correction(
        "refused with vllm_importance_sampling_correction: Forge's rollout_is has no lower bound"),
    "vllm_importance_sampling_cap": _read_by_correction(
        "rollout_is_threshold, with vllm_importance_sampling_correction (TRL's older name of clip_max)"),
    "auto_find_batch_size": _auto_batch,
    "lr_scheduler_type": _lr_scheduler,
    "warmup_steps": _warmup_steps,
    "save_strategy": _steps_strategy("save_strategy", "save_steps", {"save_steps": 0}),
    "eval_strategy": _steps_strategy("eval_strategy", "eval_steps", {"eval_steps": 0}, "logging_steps"),
    "logging_strategy": _steps_strategy("logging_strategy", "logging_steps", None),
    "train_sampling_strategy": _sampling,
    "resume_from_checkpoint": _resume,
    "project": _project,
    "model_init_kwargs": _model_init_kwargs,
    "gradient_checkpointing_kwargs": _checkpointing_kwargs,
    "activation_checkpointing_kwargs": _checkpointing_kwargs,
    "optim": _fixed(
        "optim", "Forge's optimizer is torch's AdamW", "adamw_torch", "adamw_torch_fused", "adamw_hf"
    ),
    "adam_beta1": _fixed("adam_beta1", "Forge's AdamW uses torch's betas (0.9, 0.999)", 0.9),
    "adam_beta2": _fixed("adam_beta2", "Forge's AdamW uses torch's betas (0.9, 0.999)", 0.999),
    "adam_epsilon": _fixed("adam_epsilon", "Forge's AdamW uses torch's eps", 1e-8),
    "average_tokens_across_devices": _fixed(
        "average_tokens_across_devices", "Forge's loss always counts the tokens of every process", True
    ),
    "weight_sync_steps": _fixed(
        "weight_sync_steps",
        "Forge's rollout worker gets the weights after every "
        "optimizer step (max_staleness bounds how old they are)",
        1,
    ),
}
"""TRL name -> converter(value, every field: given or default) -> Forge fields: names whose value Forge states
another way. A converter raises TypeError, saying what to set, for a value Forge cannot honour."""

_NO_DATALOADER = "Forge reads the dataset rows in the training process; there is no DataLoader"
_NO_DDP = "Forge sums the gradients of its processes itself, without DistributedDataParallel"
_PREDICTION_LOOP = "a setting of the Trainer's prediction loop; Forge's evaluation scores greedy completions"
_HUB_ONLY = "used only by push_to_hub, which Forge refuses"
_VLLM_OWN = "Forge's vLLM engine sets it for the run (forge/model/vllm_engine.py)"
_PLAIN_PROCESSES = "Forge's processes are plain data parallel, or FSDP2 with fsdp=True (docs/scaling.md)"

TRL_IGNORED = {
    "label_smoothing_factor": "a supervised-loss setting; the GRPO loss has no labels (TRL's GRPO ignores it "
    "too)",
    "bf16_full_eval": "evaluation runs in the run's precision (dtype)",
    "fp16_full_eval": "evaluation runs in the run's precision (dtype)",
    "tf32": "torch's own setting (torch.backends.cuda.matmul.allow_tf32); Forge leaves it as torch has it",
    "use_cache": "generation and the loss pass keep the prompt's KV cache themselves",
    "torch_empty_cache_steps": "Forge does not empty the CUDA cache on a schedule",
    "logging_first_step": "Forge logs every logging_steps and the last step",
    "log_on_each_node": "only the main process logs",
    "logging_nan_inf_filter": "a NaN/inf loss skips the step (max_consecutive_nonfinite); the log shows it "
    "as null",
    "include_num_input_tokens_seen": "Forge logs its own token counts (docs/metrics.md)",
    "log_level": "Forge prints its own one-line messages",
    "log_level_replica": "Forge prints its own one-line messages, on the main process",
    "disable_tqdm": "the progress bar shows on the main process; TQDM_DISABLE=1 hides it",
    "per_device_eval_batch_size": "evaluation decodes the eval rows 32 prompts at a time",
    "prediction_loss_only": _PREDICTION_LOOP,
    "eval_do_concat_batches": _PREDICTION_LOOP,
    "eval_use_gather_object": _PREDICTION_LOOP,
    "eval_accumulation_steps": _PREDICTION_LOOP,
    "include_for_metrics": _PREDICTION_LOOP,
    "batch_eval_metrics": _PREDICTION_LOOP,
    "save_only_model": "numbered checkpoints always hold the optimizer, schedule and RNG (resumable); final/ "
    "the "
    "model only",
    "save_on_each_node": "the main process writes the checkpoints",
    "enable_jit_checkpoint": "Forge always saves the finished step on SIGTERM, SIGINT and SIGHUP",
    "hub_token": _HUB_ONLY,
    "hub_private_repo": _HUB_ONLY,
    "hub_model_id": _HUB_ONLY,
    "hub_strategy": _HUB_ONLY,
    "hub_always_push": _HUB_ONLY,
    "hub_revision": _HUB_ONLY,
    "metric_for_best_model": "used only by load_best_model_at_end, which Forge refuses",
    "greater_is_better": "used only by load_best_model_at_end, which Forge refuses",
    "ignore_data_skip": "a resumed run always continues the data order where its checkpoint left it",
    "dataloader_drop_last": "an epoch's incomplete last batch is always left out",
    "dataloader_num_workers": _NO_DATALOADER,
    "dataloader_pin_memory": _NO_DATALOADER,
    "dataloader_persistent_workers": _NO_DATALOADER,
    "dataloader_prefetch_factor": _NO_DATALOADER,
    "dataloader_multiprocessing_context": _NO_DATALOADER,
    "dataloader_in_order": _NO_DATALOADER,
    "remove_unused_columns": "every dataset column reaches the rewards by its name",
    "label_names": "the GRPO loss has no labels",
    "length_column_name": "Forge does not group rows by length",
    "ddp_find_unused_parameters": _NO_DDP,
    "ddp_bucket_cap_mb": _NO_DDP,
    "ddp_broadcast_buffers": _NO_DDP,
    "ddp_static_graph": _NO_DDP,
    "ddp_backend": "Forge uses gloo on CPUs, NCCL for CUDA tensors (forge/parallel/distributed.py)",
    "ddp_timeout": "Forge's processes wait for each other with torch.distributed's default timeout",
    "debug": "a Trainer diagnostic Forge does not have",
    "skip_memory_metrics": "a Trainer diagnostic Forge does not have",
    "do_train": "a flag for your script; the Trainer does not read it either",
    "do_eval": "a flag for your script; the Trainer does not read it either",
    "do_predict": "a flag for your script; the Trainer does not read it either",
    "local_rank": "Forge reads LOCAL_RANK from the launcher's environment",
    "disable_dropout": "Forge always runs the policy without dropout",
    "cast_lm_head_to_fp32": "Forge computes the log-softmax in float32 (logprob_chunk_size positions at a "
    "time)",
    "num_generations_eval": "evaluation scores one greedy completion per prompt",
    "ds3_gather_for_generation": "no DeepSpeed; under fsdp rollouts gather the whole weights",
    "pad_to_multiple_of": "Forge pads each batch to its longest sequence",
    "cache_implementation": "Forge's decode loop keeps its own KV cache (generation_backend)",
    "vllm_model_impl": _VLLM_OWN,
    "vllm_enable_sleep_mode": _VLLM_OWN,
    "vllm_group_port": "Forge pushes weights to `forge vllm-serve` over its HTTP port (vllm_server_port)",
    "vllm_max_model_length": _VLLM_OWN,
    "vespo_k_pos": "used only by loss_type='vespo', which Forge does not have",
    "vespo_lambda_pos": "used only by loss_type='vespo', which Forge does not have",
    "vespo_k_neg": "used only by loss_type='vespo', which Forge does not have",
    "vespo_lambda_neg": "used only by loss_type='vespo', which Forge does not have",
    "ref_model_mixup_alpha": "used only by sync_ref_model, which Forge refuses",
    "ref_model_sync_steps": "used only by sync_ref_model, which Forge refuses",
    "log_multimodal": "Forge's prompts are text",
    "log_unique_prompts": "samples.jsonl holds log_completions samples of each logged step",
    "use_transformers_continuous_batching": "Forge decodes with its own loop or vLLM (generation_backend)",
    "transformers_continuous_batching_config": "Forge decodes with its own loop or vLLM (generation_backend)",
    "use_transformers_paged": "Forge decodes with its own loop or vLLM (generation_backend)",
    "fork_threshold_tokens": "Forge keeps one token sequence per completion, never re-tokenized, so there is "
    "nothing to reconcile",
    "request_timeout": "Forge's async worker samples with the own decode loop; rollout_timeout bounds a "
    "step's wait",
    "weight_sync_timeout": "the weights reach the async worker through shared memory; rollout_timeout bounds "
    "a "
    "step's wait",
    "token_budget": "Forge sizes the loss pass's micro-batches itself (micro_batch_size='auto' fits "
    "max_memory_mb)",
    "max_inflight_tasks": "Forge's worker samples whole steps, at most max_staleness steps ahead",
    "queue_maxsize": "Forge's queue holds at most max_staleness + 1 sampled steps",
}
"""TRL or TrainingArguments name -> why it changes nothing in a Forge run. Accepted with any value."""

_NO_HUB = ("Forge reaches no hub: after the run, upload output_dir's final/ folder with `huggingface-cli "
           "upload`")

TRL_REFUSED = {
    "num_completions_to_print": "set log_completions: how many samples per logged step go to samples.jsonl",
    "use_liger_loss": "Forge computes the loss in chunks itself (logprob_chunk_size)",
    "peft_config": "pass it to GRPOTrainer(..., peft_config=LoraConfig(...)), or set use_lora and lora_r, "
    "...",
    "lr_scheduler_kwargs": "Forge's schedules take no arguments (lr_scheduler: cosine and linear decay to 0)",
    "optim_args": "Forge's optimizer is torch's AdamW with its defaults (learning_rate, weight_decay)",
    "optim_target_modules": "Forge's optimizer is torch's AdamW over every trainable weight",
    "torch_compile": "Forge compiles the decode step only: generation_backend='compiled'",
    "torch_compile_backend": "Forge compiles the decode step only: generation_backend='compiled'",
    "torch_compile_mode": "Forge compiles the decode step only: generation_backend='compiled'",
    "use_liger_kernel": "Forge computes the loss in chunks itself (logprob_chunk_size)",
    "liger_kernel_config": "Forge computes the loss in chunks itself (logprob_chunk_size)",
    "neftune_noise_alpha": "Forge adds no noise to the embeddings",
    "trackio_space_id": "Forge's trackio logs locally (TRACKIO_DIR), to no Space",
    "trackio_bucket_id": "Forge's trackio logs locally (TRACKIO_DIR), to no bucket",
    "trackio_static_space_id": "Forge's trackio logs locally (TRACKIO_DIR), to no Space",
    "eval_delay": "Forge evaluates every eval_steps from the first step; set eval_steps",
    "push_to_hub": _NO_HUB,
    "log_completions_hub_repo": _NO_HUB,
    "load_best_model_at_end": "Forge keeps the last weights; pick a checkpoint by its eval_ rows in "
    "training_log.jsonl",
    "restore_callback_states_from_checkpoint": "Forge's checkpoints do not hold callbacks' state",
    "full_determinism": "call torch.use_deterministic_algorithms(True) before training; Forge seeds python, "
    "numpy "
    "and torch with seed",
    "data_seed": "Forge shuffles the rows with seed; set seed",
    "use_cpu": "hide the GPUs instead: CUDA_VISIBLE_DEVICES= python train.py",
    "accelerator_config": _PLAIN_PROCESSES,
    "parallelism_config": _PLAIN_PROCESSES,
    "fsdp_config": "Forge's FSDP2 shards each decoder layer and takes no config; set fsdp=True",
    "deepspeed": "Forge shards with FSDP2 instead: fsdp=True (docs/scaling.md)",
    "trust_remote_code": "Forge loads architectures transformers has; load the model yourself and pass the "
    "object",
    "router_aux_loss_coef": "Forge's loss adds no router auxiliary loss",
    "min_p": "Forge samples with temperature, top_p and top_k",
    "generation_kwargs": "Forge samples with temperature, top_p and top_k; no other generation arguments",
    "chat_template_kwargs": "Forge applies the tokenizer's chat template with no extra arguments",
    "repetition_penalty": "Forge samples with temperature, top_p and top_k",
    "vllm_structured_outputs_regex": "Forge's vLLM sampling has no structured outputs",
    "vllm_tensor_parallel_size": "Forge's vLLM engine runs on one device per process",
    "sync_ref_model": "Forge's reference stays the initial model (kl_beta)",
}
"""TRL or TrainingArguments name -> why Forge does not take it, and what to set instead. Given with its "off"
value (None, False, 0, '', empty, or the value in TRL_NEUTRAL) it is accepted, as it asks for nothing."""

TRL_NEUTRAL = {"repetition_penalty": 1.0, "vllm_tensor_parallel_size": 1}
"""Refused names whose "off" value is not falsy."""

SAME_NAME_NOTES = {
    "gradient_accumulation_steps": "`gradient_accumulation_steps`: rollout batches per optimizer step. Given "
    "with "
    "TRL's batch names (per_device_train_batch_size, num_generations, ...) it is TRL's "
    "forward/backward passes per step, and Forge's becomes the generations per step "
    "(1 by default; forge/core/trl_batch.py)",
}
"""Forge fields of a TRL name whose meaning differs in part: what the docs table says of them."""


def is_off(name: str, value: Any) -> bool:
    """Whether a refused name's value asks for nothing (None, False, 0, '', empty, or TRL_NEUTRAL's value)."""
    return value is None or value is False or value == TRL_NEUTRAL.get(name, 0) or value in ("", [], {}, ())


def classify(name: str, forge_fields: set[str]) -> tuple[str, str]:
    """(class, meaning) of a TRL or TrainingArguments name: 'mapped' (a Forge field of that name, TRL_NAMES,
    TRL_CONVERTED), 'ignored' or 'refused'; ('unclassified', '') for a name the table does not hold."""
    if name in forge_fields:
        return "mapped", SAME_NAME_NOTES.get(name, f"`{name}`")
    if name in TRL_NAMES:
        return "mapped", f"`{TRL_NAMES[name]}`"
    if name in TRL_CONVERTED:
        doc = TRL_CONVERTED[name].__doc__ or ""
        return "mapped", " ".join(doc.split())
    if name in TRL_IGNORED:
        return "ignored", TRL_IGNORED[name]
    if name in TRL_REFUSED:
        return "refused", TRL_REFUSED[name]
    return "unclassified", ""


def convert_names(values: dict, defaults: dict[str, Any]) -> tuple[dict, dict[str, dict]]:
    """(Forge's fields, and the fields each TRL name given set) from keyword values in Forge's or TRL's names
    (the tables above); `defaults` maps every Forge field to its default. An unknown name, a refused one that
    asks for something, a value a converter cannot honour, a TRL name given with its Forge field, or two TRL
    names that ask for two values of one field (bf16=True, fp16=True) raises TypeError naming what to use.
    TRL's batch names are
    converted together (forge/core/trl_batch.py), gradient_accumulation_steps then in TRL's meaning."""
    known = set(defaults)
    unknown = sorted(k for k in values if k not in known and classify(k, known)[0] == "unclassified")
    if unknown:
        candidates = sorted(known | set(TRL_NAMES) | set(TRL_CONVERTED))
        guesses = {k: get_close_matches(k, candidates, n=2) for k in unknown}
        hint = "; ".join(f"{k}: did you mean {' or '.join(g)}?" for k, g in guesses.items() if g)
        raise TypeError(f"unknown GRPOConfig fields {unknown}{'; ' + hint if hint else ''} (every field: "
                        f"docs/config.md, `forge train --help`)")
    values = {k: v for k, v in values.items() if not is_unset(k, v)}  # TRL's None for "not set"
    if values.get("use_vllm") and "rollout_is" not in values:  # TRL corrects vLLM's samples by default
        values.setdefault("vllm_importance_sampling_correction", True)
    out = {k: field_value(k, v, values, defaults) for k, v in values.items() if k in known}
    produced: dict[str, dict] = {}
    set_by: dict[str, str] = {}  # Forge field -> the TRL name that set it
    if speaks_trl_batch(values):
        group_size = values.get("num_generations", values.get("group_size", defaults["group_size"]))
        batch = forge_batch(values, group_size)
        said = next((name for name in BATCH_NAMES if name in values), "num_generations")
        for own in ("prompts_per_step", "rollout_slices"):
            if own in values:
                raise TypeError(f"GRPOConfig got both {said!r} (TRL's batch) and {own!r}; give one")
        if "micro_batch_size" in values:  # the user's own loss-pass split
            batch.pop("micro_batch_size", None)
        out.update(batch)
        produced.update({name: batch for name in BATCH_NAMES if name in values})
    for name, value in values.items():
        if name in known or name in BATCH_NAMES:
            continue
        if name in TRL_REFUSED and not is_off(name, value):
            raise TypeError(f"GRPOConfig: {name}={value!r} has no Forge equivalent: {TRL_REFUSED[name]}")
        if name in TRL_IGNORED or name in TRL_REFUSED:
            produced[name] = {}
            continue
        alias = TRL_NAMES.get(name)
        converted = ({alias: field_value(alias, value, values, defaults)} if alias
                     else TRL_CONVERTED[name](value, {**defaults, **values}))
        for field_name, new in converted.items():
            if field_name in values:
                raise TypeError(f"GRPOConfig got both {name!r} (TRL's name) and {field_name!r}; give one")
            earlier = set_by.setdefault(field_name, name)
            if earlier != name and out[field_name] != new:  # bf16=True, fp16=True
                raise TypeError(
                    f"GRPOConfig got {earlier}={values[earlier]!r} and {name}={value!r}, which ask for "
                    f"{field_name}={out[field_name]!r} and {field_name}={new!r}: give one of them"
                )
            out[field_name] = new
        produced[name] = converted
    return out, produced


def forge_names(values: dict, defaults: dict[str, Any]) -> dict:
    """Keyword values with TRL's names turned into Forge's fields (convert_names)."""
    return convert_names(values, defaults)[0]
