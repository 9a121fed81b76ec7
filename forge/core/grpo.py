"""GRPOConfig and the pure-tensor GRPO math: advantages, per-token log-probs, KL, and the clipped loss.

Forge implements GRPO as DeepSeekMath defines it (Shao et al. 2024, https://arxiv.org/abs/2402.03300,
eq. 3), not the per-sequence, ratio-against-the-reference shortcut of the first Forge design:

    ratio_t   = exp(logp_theta(o_t) - logp_old(o_t))          per token, against the sampling policy
    pg_t      = max(-A * ratio_t, -A * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    kl_t      = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     k3 estimator, >= 0
    loss      = aggregate(pg_t + beta * kl_t)

`A` is the group-relative advantage of the completion: its reward minus the group mean, divided by the
group std (or the batch std, or nothing: Dr. GRPO). The published variants change one piece of this, and
each is one small function plus one entry in a dict below, so adding a variant touches no other code:

    ADVANTAGE_SCALES           group / batch / none / rloo / reinforce_plus_plus_baseline
    MULTI_REWARD_AGGREGATIONS  sum_then_normalize / normalize_then_sum (GDPO); None rewards do not apply
    IMPORTANCE_LEVELS          token / sequence (GSPO)
    POLICY_OBJECTIVES          clip (+ dual-clip / two-sided cap) / cispo / sapo
    LOSS_AGGREGATIONS          per-sequence mean / token mean / constant (Dr. GRPO); LOSS_TYPES pairs them
    KL_ESTIMATORS              k1 / k2 / k3
    ROLLOUT_IS_MODES           none / token or sequence, truncated or masked sampler importance weights

plus the token entropy (from the same chunked log-softmax as the log-probs), its top-quantile mask and bonus.
grpo_loss takes the variant as one LossSettings (LossSettings.from_config reads a GRPOConfig).

This module imports only torch and the standard library: everything comes in as tensors and numbers.
"""

from __future__ import annotations

import math
import numbers
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

import torch

# ----------------------------------------------------------------------------------------------------
# Config


@dataclass
class GRPOConfig:
    """Every knob of a Forge run. The first block keeps the original Forge fields and defaults."""

    # --- original Forge fields (names and defaults unchanged) ---
    group_size: int = 8
    """Completions sampled per prompt (G). Directly multiplies generation cost."""
    clip_epsilon: float = 0.2
    """Lower clip range: the ratio is clipped to [1 - clip_epsilon, 1 + clip_epsilon_high]."""
    kl_beta: float = 0.01
    """Weight of the k3 KL penalty against the frozen reference policy; 0 skips the reference entirely."""
    temperature: float = 0.9
    """Sampling temperature for rollouts."""
    max_new_tokens: int = 512
    """Maximum tokens generated per completion."""
    learning_rate: float = 5e-6
    """Peak AdamW learning rate."""
    gradient_accumulation_steps: int = 4
    """Rollout batches (of prompts_per_step prompts each) accumulated before one optimizer step."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm, applied right before the optimizer step (0 disables)."""
    num_train_epochs: int = 3
    """Passes over the dataset (ignored when max_steps > 0)."""
    save_steps: int = 100
    """Write a checkpoint to {output_dir}/{step}/ every N optimizer steps (0 disables)."""
    logging_steps: int = 10
    """Log metrics every N optimizer steps."""
    output_dir: str = "forge_output"
    """Root for checkpoints, training_log.jsonl and samples.jsonl."""
    use_wandb: bool = False
    """Mirror metrics to Weights & Biases (falls back with a warning when wandb is missing)."""
    wandb_project: str = "forge"
    """W&B project name."""
    wandb_run_name: str = "grpo_run"
    """W&B run name."""
    seed: int = 42
    """Seeds python, numpy and torch once at the start of train(); the same seed repeats a CPU run."""

    # --- batching ---
    prompts_per_step: int = 1
    """Prompts generated together in one batched rollout (each gets group_size completions)."""
    micro_batch_size: int = 0
    """Completions per forward/backward pass when computing the loss; 0 = the whole rollout batch."""
    max_steps: int = -1
    """Stop after this many optimizer steps; -1 = run num_train_epochs."""
    shuffle: bool = True
    """Shuffle the dataset each epoch (seeded)."""

    # --- algorithm variant ---
    num_iterations: int = 1
    """Optimizer passes over each rollout (mu). >1 computes pi_old once and reuses it."""
    loss_type: str = "grpo"
    """grpo (per-sequence mean), bnpo / dapo (token mean), dr_grpo (sum / (B * max_new_tokens)): the clipped objective;
    cispo (MiniMax-M1: stop-gradient weight min(ratio, 1 + clip_epsilon_high) x A x logp, token mean; TRL's
    epsilon_high=5.0 is clip_epsilon_high=4.0 here); sapo (soft gate instead of the clip, per-sequence mean)."""
    importance_sampling_level: str = "token"
    """'token' (GRPO) or 'sequence' (GSPO: one length-normalised ratio per completion)."""
    clip_epsilon_high: float | None = None
    """Upper clip range (DAPO clip-higher, e.g. 0.28); None = clip_epsilon."""
    scale_rewards: str = "group"
    """Advantage: r - group mean divided by the 'group' std, the 'batch' std, or nothing ('none', Dr. GRPO); 'rloo'
    (r minus the mean of the other G-1 rewards); 'reinforce_plus_plus_baseline' (r - group mean, divided by the
    batch std of those differences)."""
    reward_weights: list[float] | None = None
    """Weights when reward_fn is a list of rewards; None = all 1.0."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_new_tokens without EOS from the loss (DAPO)."""
    drop_zero_std_groups: bool = False
    """Dynamic sampling (DAPO): leave groups whose rewards are all equal out of the loss."""
    advantage_epsilon: float = 1e-4
    """Added to the std when scaling advantages."""

    # --- algorithm catalogue: objective caps, KL estimator, several rewards, entropy, sampler correction ---
    # Every default below leaves the GRPO of the block above unchanged. Names follow TRL (delta, sapo_*,
    # multi_objective_aggregation, top_entropy_quantile, entropy_coef) or verl (clip_ratio_c, kl_loss_type,
    # rollout_is, rollout_is_threshold); README "The algorithm Forge computes" cites each paper and equation.
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): the ratio of a token with negative advantage is capped at delta, so its
    loss stays bounded however far the policy moved. Must be > 1 + clip_epsilon_high; None = off."""
    clip_ratio_c: float | None = None
    """Dual-clip PPO (Ye et al. 2020): negative-advantage loss capped at -A x clip_ratio_c, the same bound as delta
    under verl's name. verl applies 3.0 always; Forge keeps it off (None) so default runs are unchanged. Must be > 1."""
    sapo_temperature_pos: float = 1.0
    """loss_type='sapo': temperature of the soft gate for tokens with positive advantage."""
    sapo_temperature_neg: float = 1.05
    """loss_type='sapo': temperature of the soft gate for tokens with zero or negative advantage."""
    kl_loss_type: str = "k3"
    """Per-token estimator of KL(pi_theta || pi_ref) on sampled tokens, d = logp - ref: k1 = d, k2 = d^2 / 2,
    k3 = exp(-d) + d - 1 (>= 0, the GRPO default)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """Several rewards: 'sum_then_normalize' (weighted sum, then scale_rewards), or 'normalize_then_sum' (GDPO: each
    reward normalised within its group, weighted sum, then normalised over the batch)."""
    top_entropy_quantile: float = 1.0
    """The policy gradient flows only through this top fraction of completion tokens by entropy (Wang et al. 2025
    use 0.2); 1.0 = every token."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef x the mean entropy of the completion tokens (0 = off)."""
    rollout_is: str = "none"
    """Sampler/trainer mismatch correction with the sampler's log-probs: 'token_truncate' / 'sequence_truncate'
    (weight min(w, C)), 'token_mask' / 'sequence_mask' (weight 0 where w > C), or 'none'."""
    rollout_is_threshold: float = 3.0
    """C for rollout_is: the largest importance weight pi_old / pi_sampler kept (TRL's default 3.0)."""

    # --- sampling ---
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_prompt_length: int | None = None
    """Longest prompt in tokens; None = the model's context minus max_new_tokens."""
    truncate_prompts: str = "error"
    """What to do with a prompt over max_prompt_length: 'error' or 'left' (keep its last tokens)."""

    # --- optimizer and schedule ---
    lr_scheduler: str = "cosine"
    """'cosine', 'linear' or 'constant', each after a linear warmup."""
    warmup_ratio: float = 0.05
    """Fraction of optimizer steps spent warming the learning rate up from 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""

    # --- LoRA ---
    use_lora: bool = False
    """Train LoRA adapters (peft) instead of all weights; the reference is the adapter-disabled base."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_dropout: float = 0.0
    """Saved in the adapter's config for use elsewhere. Forge itself trains with dropout off (sampling, pi_old
    and pi_theta must be one network), so it does not change a Forge run."""
    lora_target_modules: list[str] | None = None
    """Module names to adapt; None = the attention projections of the architecture (q/k/v/o for Llama)."""

    # --- engine ---
    share_prompt_prefix: bool = True
    """Compute each prompt once per group (in generation and in the loss) instead of G times."""
    merge_lora_for_generation: bool = True
    """With LoRA, generate and evaluate with the adapters folded into a temporary copy of the adapted weights
    (policy.merged_adapters): one matmul per layer instead of three, 0.85-0.90x the generation time on a CPU
    (bench/merged_generation.py). The training weights are untouched (put back bit for bit); the sampler then
    differs from the trainer by fp32 rounding. Needs memory for one copy of the adapted weights during
    generation, and is skipped when that does not fit on the GPU, under FSDP2, for DoRA or quantised layers, and in
    bf16/fp16 (where W + s B A would round small adapter updates away)."""
    logprob_chunk_size: int = 1024
    """Positions per chunk in the log-softmax, so (tokens x vocab) fp32 logits are never all alive."""
    gradient_checkpointing: bool = False
    """Keep only each decoder layer's input in the loss pass and recompute the rest in backward: less activation
    memory for more compute. The loss pass then runs every completion with its own copy of the prompt
    (a checkpointed layer cannot keep the shared prompt cache), which costs the most with long prompts and
    large groups. Generation is unchanged."""
    fsdp: bool = False
    """Shard the weights, gradients and AdamW state over the processes with PyTorch's FSDP2 (`fully_shard` per
    decoder layer), instead of a whole copy on every process: for a model too big to train data-parallel. Needs
    several processes (`forge train --nproc N --fsdp`, torchrun, or `accelerate launch` with an FSDP2 config);
    rollouts gather the whole weights (core/sharding.py). With one process it changes nothing."""
    dtype: str = "auto"
    """Compute precision; trainable weights are always float32 masters. 'bfloat16'/'float16' = forward, backward
    and generation under autocast (fp16 adds a dynamic loss scale); 'auto' = bf16 on a GPU that supports it or
    a CPU with bf16 matrix units (AMX / AVX512-BF16; FORGE_CPU_BF16=0/1 overrides that detection), else fp32
    (logged, with the reason); 'float32' forces fp32."""

    # --- logging, eval, checkpoints ---
    use_tensorboard: bool = False
    """Write TensorBoard events under {output_dir}/tensorboard."""
    use_trackio: bool = False
    """Mirror metrics to trackio, stored locally under TRACKIO_DIR (falls back with a warning when trackio is missing)."""
    trackio_project: str = "forge"
    """trackio project name (the run is named wandb_run_name)."""
    log_completions: int = 2
    """Sample completions written to samples.jsonl per logging step."""
    eval_steps: int = 0
    """Evaluate on the eval dataset every N optimizer steps (0 = only before/after, if asked)."""
    eval_before_training: bool = False
    """Evaluate once before the first step (logged at step 0)."""
    save_total_limit: int | None = None
    """Keep only the newest N numbered checkpoints."""
    resume_from: str | None = None
    """Checkpoint directory to resume from, or 'latest' for the newest one in output_dir."""
    overwrite_output_dir: bool = False
    """Let a new run (not resuming) delete the checkpoints and logs another run left in output_dir; without it
    such a directory is refused."""

    # --- tools (multi-turn rollouts; used only when GRPOTrainer gets tools=[...], README "Tools") ---
    max_tool_calling_iterations: int = 4
    """Most tool calls per completion (TRL's name); a further call ends the completion there, unanswered."""
    tool_timeout: float = 10.0
    """Seconds one tool call may take; a slower call is answered with an error text and counted."""
    max_tool_output_chars: int = 1000
    """Longest tool output given back to the model; a longer one keeps its start and says it was truncated."""
    tool_format: str = "auto"
    """How calls are written: 'text' (<calc>expr</calc> -> <result>v</result>, shown by the prompt's worked
    examples), 'template' (the chat template's <tool_call>{json}</tool_call> and tool messages) or 'auto'
    (template when the tokenizer's chat template supports tools, else text)."""

    # --- failure handling ---
    on_reward_error: str = "raise"
    """'raise' stops with the failing sample named; 'score' gives it reward_error_value and counts it."""
    reward_error_value: float = 0.0
    """Score given to a sample whose reward failed, when on_reward_error == 'score'."""
    reward_timeout: float | None = None
    """Seconds one reward call may take; None = no limit."""
    max_consecutive_nonfinite: int = 3
    """Abort after this many optimizer steps in a row skipped for a NaN/inf loss or gradient."""

    @property
    def epsilon_high(self) -> float:
        return self.clip_epsilon if self.clip_epsilon_high is None else self.clip_epsilon_high

    @property
    def completions_per_step(self) -> int:
        """Completions generated in one rollout batch."""
        return self.prompts_per_step * self.group_size

    @property
    def prompts_per_optimizer_step(self) -> int:
        return self.prompts_per_step * self.gradient_accumulation_steps

    def validate(self) -> GRPOConfig:
        """Raise a ValueError that says what to change for every bad setting; returns self.

        First every field's type is checked against its annotation and every number for being finite
        (`_field_type_problems`), so the range checks below only ever see numbers of the right kind."""
        problems = _field_type_problems(self)
        if problems:
            raise ValueError("invalid GRPOConfig:\n  - " + "\n  - ".join(problems))

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        need(self.group_size >= 2, f"group_size={self.group_size}: GRPO needs >= 2 completions per prompt")
        need(self.clip_epsilon > 0, f"clip_epsilon={self.clip_epsilon} must be > 0")
        need(self.epsilon_high > 0, f"clip_epsilon_high={self.clip_epsilon_high} must be > 0")
        need(self.kl_beta >= 0, f"kl_beta={self.kl_beta} must be >= 0 (0 disables the KL term)")
        need(self.temperature > 0, f"temperature={self.temperature} must be > 0")
        need(self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be >= 1")
        need(self.learning_rate > 0, f"learning_rate={self.learning_rate} must be > 0")
        need(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
        need(self.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 disables clipping)")
        need(self.num_train_epochs >= 1 or self.max_steps > 0, "num_train_epochs must be >= 1")
        need(self.save_steps >= 0 and self.logging_steps >= 1, "save_steps >= 0 and logging_steps >= 1")
        need(self.prompts_per_step >= 1, f"prompts_per_step={self.prompts_per_step} must be >= 1")
        need(self.micro_batch_size >= 0, "micro_batch_size must be >= 0 (0 = whole rollout batch)")
        need(self.num_iterations >= 1, f"num_iterations={self.num_iterations} must be >= 1")
        need(self.loss_type in LOSS_TYPES,
             f"loss_type={self.loss_type!r} unknown; choose one of {sorted(LOSS_TYPES)}")
        need(self.importance_sampling_level in IMPORTANCE_LEVELS,
             f"importance_sampling_level={self.importance_sampling_level!r}; choose 'token' or 'sequence'")
        need(self.scale_rewards in ADVANTAGE_SCALES,
             f"scale_rewards={self.scale_rewards!r}; choose one of {sorted(ADVANTAGE_SCALES)}")
        need(self.reward_weights is None or all(math.isfinite(w) for w in self.reward_weights),
             "reward_weights must be finite numbers")
        clipped = LOSS_TYPES.get(self.loss_type, LossType("clip", "")).objective == "clip"
        need(self.delta is None or self.delta > 1 + self.epsilon_high,
             f"delta={self.delta} must be > 1 + clip_epsilon_high = {1 + self.epsilon_high} (e.g. 4.0), or None")
        need(self.clip_ratio_c is None or self.clip_ratio_c > 1,
             f"clip_ratio_c={self.clip_ratio_c} must be > 1 (verl uses 3.0), or None")
        need(clipped or (self.delta is None and self.clip_ratio_c is None),
             f"delta / clip_ratio_c cap the clipped objective; loss_type={self.loss_type!r} has none, unset them")
        need(self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0,
             "sapo_temperature_pos and sapo_temperature_neg must be > 0")
        need(self.kl_loss_type in KL_ESTIMATORS,
             f"kl_loss_type={self.kl_loss_type!r}; choose one of {sorted(KL_ESTIMATORS)}")
        need(self.multi_objective_aggregation in MULTI_REWARD_AGGREGATIONS,
             f"multi_objective_aggregation={self.multi_objective_aggregation!r}; choose one of "
             f"{sorted(MULTI_REWARD_AGGREGATIONS)}")
        need(self.multi_objective_aggregation != "normalize_then_sum" or self.scale_rewards == "group",
             f"multi_objective_aggregation='normalize_then_sum' normalises each reward by its group std and the sum "
             f"by the batch std itself; leave scale_rewards at 'group' (got {self.scale_rewards!r})")
        need(0 <= self.top_entropy_quantile <= 1,
             f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1] (1 = every token, 0.2 = paper)")
        need(math.isfinite(self.entropy_coef), f"entropy_coef={self.entropy_coef} must be a finite number")
        need(self.rollout_is in ROLLOUT_IS_MODES,
             f"rollout_is={self.rollout_is!r}; choose one of {sorted(ROLLOUT_IS_MODES)}")
        need(self.rollout_is_threshold >= 1,
             f"rollout_is_threshold={self.rollout_is_threshold} must be >= 1 (a cap below 1 cuts on-policy tokens)")
        need(0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]")
        need(self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 = off)")
        need(self.max_prompt_length is None or self.max_prompt_length >= 1, "max_prompt_length must be >= 1")
        need(self.truncate_prompts in ("error", "left"), "truncate_prompts must be 'error' or 'left'")
        need(self.lr_scheduler in ("cosine", "linear", "constant"),
             f"lr_scheduler={self.lr_scheduler!r}; choose 'cosine', 'linear' or 'constant'")
        need(0 <= self.warmup_ratio < 1, f"warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        need(self.weight_decay >= 0, "weight_decay must be >= 0")
        need(self.lora_r >= 1 and self.lora_alpha > 0, "lora_r must be >= 1 and lora_alpha > 0")
        need(0 <= self.lora_dropout < 1, "lora_dropout must be in [0, 1)")
        need(self.logprob_chunk_size >= 1, "logprob_chunk_size must be >= 1")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"dtype={self.dtype!r}; choose auto, float32, bfloat16 or float16")
        need(self.eval_steps >= 0, "eval_steps must be >= 0")
        need(self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit must be >= 1")
        need(self.on_reward_error in ("raise", "score"), "on_reward_error must be 'raise' or 'score'")
        need(self.reward_timeout is None or self.reward_timeout > 0, "reward_timeout must be > 0 seconds")
        need(self.max_consecutive_nonfinite >= 1, "max_consecutive_nonfinite must be >= 1")
        need(self.max_tool_calling_iterations >= 0, "max_tool_calling_iterations must be >= 0")
        need(self.tool_timeout > 0, "tool_timeout must be > 0 seconds")
        need(self.max_tool_output_chars >= 1, "max_tool_output_chars must be >= 1")
        need(self.tool_format in ("auto", "text", "template"), "tool_format must be 'auto', 'text' or 'template'")
        need(bool(self.output_dir), "output_dir must be a non-empty path")
        if problems:
            raise ValueError("invalid GRPOConfig:\n  - " + "\n  - ".join(problems))
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> GRPOConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown GRPOConfig fields {unknown}; see `forge train --help` for the list")
        return cls(**values)


def _fits(value: object, hint: object) -> bool:
    """Whether `value` has the type the annotation `hint` names. bool is not an int, an int is a float;
    numpy scalars count as the Python number they stand for."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_fits(item, args[0]) for item in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return not isinstance(hint, type) or isinstance(value, hint)  # an annotation not covered above passes


def _type_name(hint: object) -> str:
    """'an int', 'a float or None', 'a list of float values or None': an annotation as a message says it."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) in (list, tuple):
        item = typing.get_args(hint)[0]
        return f"a list of {getattr(item, '__name__', item)} values"
    names = {bool: "a bool (true or false)", int: "an int (a whole number)", float: "a float", str: "a string",
             type(None): "None"}
    return names.get(hint, f"a {getattr(hint, '__name__', hint)}")


def _is_nonfinite(value: object) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_is_nonfinite(item) for item in value)
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isfinite(value)


def _field_type_problems(config: GRPOConfig) -> list[str]:
    """One message per field whose value does not fit its annotation or is a NaN/inf number.

    Generic over `dataclasses.fields`, so a new field is checked without touching this."""
    hints = typing.get_type_hints(type(config))
    problems = []
    for field in fields(config):
        value = getattr(config, field.name)
        if not _fits(value, hints[field.name]):
            problems.append(f"{field.name}={value!r} ({type(value).__name__}) must be "
                            f"{_type_name(hints[field.name])}")
        elif _is_nonfinite(value):
            or_none = " (or None)" if _fits(None, hints[field.name]) else ""
            problems.append(f"{field.name}={value!r} must be a finite number{or_none}")
    return problems


# ----------------------------------------------------------------------------------------------------
# Advantages


# Each returns the divisor of the centred rewards r - group mean, (N,), from the float64 rewards, the centred
# rewards and the (N,) mask of the samples that enter the statistics; `eps` keeps a std of 0 from dividing by 0.


def _masked_std(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Bessel-corrected std of each row's valid entries, (rows, n) -> (rows,); exactly 0 where fewer than
    two are valid or all valid entries are equal."""
    weight = valid.to(values.dtype)  # (rows, n)
    count = weight.sum(dim=1)  # (rows,)
    mean = (values * weight).sum(dim=1, keepdim=True) / count.clamp(min=1)[:, None]  # (rows, 1)
    var = ((values - mean) ** 2 * weight).sum(dim=1) / (count - 1).clamp(min=1)  # (rows,)
    spread = (count >= 2) & ~_all_equal(values, valid)  # (rows,)
    return torch.where(spread, var.sqrt(), 0.0)


def _all_equal(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(rows, n) -> (rows,): True where every valid entry holds the same value (or none is valid). Exact, so a
    group of 0.7s or 1.1s, which no float type holds exactly, is recognised without rounding."""
    big = torch.finfo(values.dtype).max
    highest = torch.where(valid, values, -big).max(dim=1).values
    lowest = torch.where(valid, values, big).min(dim=1).values
    return highest <= lowest


def _group_scale(rewards, centred, valid, group_size: int, eps: float) -> torch.Tensor:
    std = _masked_std(rewards.view(-1, group_size), valid.view(-1, group_size))  # (groups,)
    return std.repeat_interleave(group_size) + eps


def _batch_scale(rewards, centred, valid, group_size: int, eps: float) -> torch.Tensor:
    return _masked_std(rewards[None], valid[None]).expand_as(rewards) + eps


def _no_scale(rewards, centred, valid, group_size: int, eps: float) -> torch.Tensor:
    return torch.ones_like(rewards)  # no eps: the advantage is exactly r - mean


def _leave_one_out_scale(rewards, centred, valid, group_size: int, eps: float) -> torch.Tensor:
    # RLOO (Ahmadian et al. 2024, arXiv 2402.14740, sec. 3): r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean),
    # n = valid samples of the group; so the divisor is (n - 1) / n (no eps: nothing can be 0 here).
    count = valid.view(-1, group_size).sum(dim=1).to(rewards.dtype)  # (groups,)
    return ((count - 1).clamp(min=1) / count.clamp(min=1)).repeat_interleave(group_size)


def _centred_batch_scale(rewards, centred, valid, group_size: int, eps: float) -> torch.Tensor:
    # REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262, sec. 3): the group mean is the baseline, then the
    # differences are normalised by their std over the batch (their batch mean is already 0). One value per
    # completion; verl whitens per token instead, which weighs long completions more.
    return _masked_std(centred[None], valid[None]).expand_as(rewards) + eps


ADVANTAGE_SCALES: dict[str, Callable[..., torch.Tensor]] = {
    "group": _group_scale,  # DeepSeekMath: std of the group (Bessel-corrected)
    "batch": _batch_scale,  # std over the whole batch (more robust for small groups)
    "none": _no_scale,  # Dr. GRPO (Liu et al. 2025): no std division, removes the difficulty bias
    "rloo": _leave_one_out_scale,  # RLOO: leave-one-out baseline
    "reinforce_plus_plus_baseline": _centred_batch_scale,  # REINFORCE++-baseline: group mean, batch std
}


def _check_rewards(rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    if valid is None:
        return torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)
    if valid.shape != rewards.shape:
        raise ValueError(f"valid must have the rewards' shape {tuple(rewards.shape)}, got {tuple(valid.shape)}")
    return valid.bool()


def compute_group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-relative advantages. rewards: (N,) laid out group by group, N = num_groups * group_size.

    A_i = (r_i - mean(group)) / (std + eps), or r_i - mean(group) for scale='none'.
    valid: (N,) bool, False for samples left out of the statistics (e.g. a reward returned NaN); they get
    advantage 0, and the mean and std are those of the group's valid samples.
    A group whose valid rewards are all equal gets exactly 0, whatever their value: the statistics run in
    float64 and an all-equal group is detected by max == min, not by a std that rounds to ~1e-8.
    """
    valid = _check_rewards(rewards, group_size, valid)
    values = torch.where(valid, rewards.double(), 0.0)  # (N,) float64
    grouped, grouped_valid = values.view(-1, group_size), valid.view(-1, group_size)  # (groups, G)
    count = grouped_valid.sum(dim=1, keepdim=True).clamp(min=1)  # (groups, 1)
    mean = grouped.sum(dim=1, keepdim=True) / count  # (groups, 1)
    flat = _all_equal(grouped, grouped_valid)[:, None]  # (groups, 1)
    centred = torch.where(flat | ~grouped_valid, 0.0, grouped - mean).reshape(-1)  # (N,)
    return (centred / ADVANTAGE_SCALES[scale](values, centred, valid, group_size, eps)).to(torch.float32)  # (N,)


# Several rewards: each fn(components (N, K), applies (N, K) bool, weights (K,), group_size, scale, eps, valid (N,))
# -> (N,) advantages. `applies` is False where a reward returned None ("does not apply" to that sample): the sample
# is scored by the rewards that apply, and when none applies it gets advantage 0 and leaves the statistics.
# `valid` is False for samples left out for another reason (a NaN reward).


def weighted_reward_sum(components: torch.Tensor, applies: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """sum_k w_k r_k over the rewards that apply, (N, K) -> (N,) float32, summed reward by reward in float32 (the
    order and precision of the scores Forge logs as `reward`, so both agree to the bit)."""
    total = torch.zeros(components.shape[0], dtype=torch.float32)
    for k, weight in enumerate(weights):
        total = total + float(weight) * torch.where(applies[:, k], components[:, k].float(), 0.0)
    return total


def _sum_then_normalize(components, applies, weights, group_size, scale, eps, valid) -> torch.Tensor:
    total = weighted_reward_sum(components, applies, weights)  # (N,)
    return compute_group_advantages(total, group_size, scale, eps, valid=valid & applies.any(dim=1))


def _normalize_then_sum(components, applies, weights, group_size, scale, eps, valid) -> torch.Tensor:
    # GDPO (Liu et al. 2026, arXiv 2601.05242, sec. 3): A = normalise_batch(sum_k w_k (r_k - mean_g) / std_g)
    per_reward = torch.stack([
        compute_group_advantages(components[:, k].float(), group_size, "group", eps, valid=valid & applies[:, k])
        for k in range(components.shape[1])], dim=1)  # (N, K), 0 where reward k does not apply
    summed = (per_reward.double() * torch.tensor(list(weights), dtype=torch.float64)).sum(dim=1)  # (N,)
    scored = valid & applies.any(dim=1)
    return compute_group_advantages(summed, summed.numel(), "group", eps, valid=scored)  # one group: the batch


MULTI_REWARD_AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "sum_then_normalize": _sum_then_normalize,  # GRPO: one scalar reward per completion, then scale_rewards
    "normalize_then_sum": _normalize_then_sum,  # GDPO: rewards decoupled, so a large-scale reward cannot drown others
}


def multi_reward_advantages(
    components: torch.Tensor, applies: torch.Tensor | None, weights: Sequence[float], group_size: int,
    scale: str = "group", eps: float = 1e-4, aggregation: str = "sum_then_normalize",
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages from K rewards per completion. components: (N, K) laid out group by group; applies: (N, K) bool
    (None = every reward applies everywhere); valid: (N,) bool (None = all). Returns (N,) float32."""
    if components.dim() != 2 or components.shape[1] != len(weights):
        raise ValueError(f"components must be (N, K={len(weights)}), got shape {tuple(components.shape)}")
    applies = torch.ones(components.shape, dtype=torch.bool) if applies is None else applies.bool()
    valid = _check_rewards(components[:, 0], group_size, valid)
    return MULTI_REWARD_AGGREGATIONS[aggregation](components, applies, weights, group_size, scale, eps, valid)


def group_reward_std(rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group std of the (valid) rewards, (num_groups,) float32; exactly 0 for a group of equal rewards."""
    valid = _check_rewards(rewards, group_size, valid)
    values = torch.where(valid, rewards.double(), 0.0).view(-1, group_size)  # (groups, G)
    return _masked_std(values, valid.view(-1, group_size)).to(torch.float32)


# ----------------------------------------------------------------------------------------------------
# Log-probabilities


def token_logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024,
    with_entropy: bool = False, entropy_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(target_t) for each position. logits: (B, T, V), targets: (B, T) -> (B, T) float32.

    The log-softmax runs over chunks of positions, so the float32 (B*T, V) matrix is never all alive.
    Logits are divided by the sampling temperature so the ratio is taken against the policy that sampled.
    with_entropy also returns each position's entropy H = logsumexp(z) - sum_v softmax(z)_v z_v, (B, T), from
    the same chunk (no second pass); it carries a gradient only with entropy_grad (for an entropy bonus), so
    logging it keeps no extra (c, V) tensor alive for backward.
    """
    batch, length, vocab = logits.shape
    flat_logits = logits.reshape(-1, vocab)  # (B*T, V)
    flat_targets = targets.reshape(-1)  # (B*T,)
    out = torch.empty(flat_targets.shape, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(flat_targets.shape, dtype=torch.float32, device=logits.device) if with_entropy else None
    for start in range(0, flat_targets.numel(), chunk_size):
        chunk = flat_logits[start:start + chunk_size].float() / temperature  # (c, V)
        picked = chunk.gather(1, flat_targets[start:start + chunk_size, None]).squeeze(1)  # (c,)
        normaliser = torch.logsumexp(chunk, dim=-1)  # (c,)
        out[start:start + chunk_size] = picked - normaliser
        if entropy is not None:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                probs = (chunk - normaliser[:, None]).exp_()  # (c, V), in place: one (c, V) buffer
                entropy[start:start + chunk_size] = normaliser - torch.linalg.vecdot(probs, chunk)  # no product kept
    if entropy is None:
        return out.view(batch, length)
    return out.view(batch, length), entropy.view(batch, length)


def compute_token_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token log-probs of the response tokens of prompt+response sequences, 0 elsewhere.

    logits: (B, L, V) from the model on input_ids (B, L); response_mask: (B, L), 1 on response tokens.
    Returns (B, L - 1): entry t is log p(input_ids[t + 1]) masked by response_mask[t + 1].
    """
    token_logprobs = token_logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature)  # (B, L-1)
    return token_logprobs * response_mask[:, 1:].to(token_logprobs.dtype)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def sequence_mean_log_probs(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The first Forge design's per-response score: mean log-prob over response tokens, (B, T) -> (B,)."""
    return masked_mean(token_logprobs, mask, dim=1)


# ----------------------------------------------------------------------------------------------------
# KL


# Each estimates KL(pi_theta || pi_ref) per sampled token (tokens drawn from the policy, d = logp - ref), from
# http://joschu.net/blog/kl-approx.html: k1 = d is unbiased but goes negative and has high variance; k2 = d^2 / 2
# is biased, >= 0, and its gradient is that of the reverse KL in expectation; k3 is unbiased and >= 0.


def k1_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi_theta || pi_ref): logp - ref (can be negative)."""
    return logprobs - ref_logprobs


def k2_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k2 estimate of KL(pi_theta || pi_ref): (logp - ref)^2 / 2, always >= 0."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): exp(d) - d - 1 with d = ref - logp; always >= 0.

    Unbiased, low-variance estimator from http://joschu.net/blog/kl-approx.html (used by DeepSeekMath eq. 4).
    """
    delta = ref_logprobs - logprobs
    # expm1(d) - d == exp(d) - 1 - d, but without the cancellation that makes exp(d) - d - 1 lose the
    # d**2 / 2 signal (and go slightly negative) in float32 when the policy is close to the reference.
    return torch.expm1(delta) - delta


KL_ESTIMATORS = {"k1": k1_kl, "k2": k2_kl, "k3": k3_kl}


# ----------------------------------------------------------------------------------------------------
# Importance ratio levels: each returns log(ratio) per token, (B, T)


def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logprobs - old_logprobs


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071, eq. 7): one length-normalised ratio per
    completion, exp(mean_t(logp - logp_old)), shared by all of its tokens."""
    per_sequence = masked_mean(logprobs - old_logprobs, mask, dim=1)  # (B,)
    return per_sequence[:, None].expand_as(logprobs)


IMPORTANCE_LEVELS = {"token": token_log_ratio, "sequence": sequence_log_ratio}


# ----------------------------------------------------------------------------------------------------
# Policy objectives: each fn(ratio (B, T), logprobs (B, T), adv (B, 1), settings) -> PolicyTerm, whose pg_loss is
# the per-token loss to minimise and whose flags say which tokens a bound held back (for the clip statistics).


class PolicyTerm(NamedTuple):
    pg_loss: torch.Tensor  # (B, T)
    clipped_low: torch.Tensor  # (B, T) bool: A < 0 and the lower clip bound holds the ratio
    clipped_high: torch.Tensor  # (B, T) bool: the upper bound holds the ratio (A > 0; cispo: any A)
    capped: torch.Tensor  # (B, T) bool: A < 0 and the ratio is over delta / clip_ratio_c


def _clipped_objective(ratio, logprobs, adv, settings: LossSettings) -> PolicyTerm:
    # PPO / GRPO (DeepSeekMath eq. 3): max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    low, high = settings.clip_eps_low, settings.epsilon_high
    pg_loss1 = -adv * ratio  # (B, T)
    pg_loss2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)  # (B, T)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # (B, T)
    capped = torch.zeros_like(ratio, dtype=torch.bool)
    cap = settings.negative_ratio_cap
    if cap is not None:
        # Dual-clip (Ye et al. 2020, arXiv 1912.09729) = two-sided clip (INTELLECT-2, arXiv 2505.07291):
        # for A < 0 the loss is min(max(-A r, -A clip(r)), -A c), so it stops growing once r > c.
        pg_loss3 = -adv * cap  # (B, 1)
        capped = (adv < 0) & (ratio > cap)
        pg_loss = torch.where(adv < 0, torch.minimum(pg_loss, pg_loss3), pg_loss)
    return PolicyTerm(pg_loss, (ratio < 1 - low) & (adv < 0), (ratio > 1 + high) & (adv > 0), capped)


def _cispo_objective(ratio, logprobs, adv, settings: LossSettings) -> PolicyTerm:
    # CISPO (MiniMax-M1, arXiv 2506.13585, the J_CISPO objective of sec. 3.1): -sg(min(r, 1 + eps_high)) * A * log pi_theta. The weight is
    # clipped, never the token: every token keeps its gradient -w A grad log pi. No lower bound, as in the paper.
    cap = 1 + settings.epsilon_high
    weight = torch.clamp(ratio, max=cap).detach()  # (B, T)
    over = ratio > cap
    return PolicyTerm(-weight * adv * logprobs, torch.zeros_like(over), over, torch.zeros_like(over))


def _sapo_objective(ratio, logprobs, adv, settings: LossSettings) -> PolicyTerm:
    # SAPO (Gao et al. 2025, arXiv 2511.20347, the soft gate of sec. 3): -f(r) A with the gate f(r) = sigmoid(tau (r - 1)) * 4 / tau,
    # tau = tau_pos for A > 0, tau_neg otherwise. f'(1) = 1, so on-policy it is the policy gradient; far off-policy
    # the gradient fades smoothly instead of stopping at a hard bound.
    tau = torch.where(adv > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)  # (B, 1)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau  # (B, T)
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyTerm(-gate * adv, none, none, none)


POLICY_OBJECTIVES: dict[str, Callable[..., PolicyTerm]] = {
    "clip": _clipped_objective,
    "cispo": _cispo_objective,
    "sapo": _sapo_objective,
}


# ----------------------------------------------------------------------------------------------------
# Aggregations: per-token loss (B, T) -> scalar. `num_sequences` / `num_tokens` are the counts over the
# whole optimizer batch (all micro-batches, all ranks), so summing micro-batch losses gives the same
# value as one big batch.


class LossNormaliser(NamedTuple):
    """What each aggregation divides by, counted over the whole optimizer batch.

    When samples are masked out of the loss (truncated completions, dropped zero-std groups, non-finite
    rewards), 'grpo' and 'bnpo'/'dapo' average over what is left, as if the masked samples had never been
    drawn (DAPO's dynamic sampling keeps only the informative groups too). 'dr_grpo' divides by a constant,
    as its paper does: every completion sampled, masked or not, times max_new_tokens.
    """

    num_sequences: float  # completions with at least one token in the loss
    num_tokens: float  # tokens in the loss
    max_completion_length: int  # max_new_tokens
    num_sampled: float | None = None  # every completion sampled for this optimizer step; None = num_sequences

    @classmethod
    def count(cls, loss_masks: list[torch.Tensor], max_completion_length: int,
              total: Callable[[list[float]], list[float]] = lambda counts: counts) -> LossNormaliser:
        """Count the optimizer batch's loss masks, each (N, T); `total` sums the counts over processes."""
        sequences, tokens, sampled = total([sum(float((m.sum(dim=1) > 0).sum()) for m in loss_masks),
                                            sum(float(m.sum()) for m in loss_masks),
                                            sum(float(m.shape[0]) for m in loss_masks)])
        return cls(max(sequences, 1.0), max(tokens, 1.0), max_completion_length, sampled)


def _sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormaliser) -> torch.Tensor:
    # DeepSeekMath eq. 3: 1/G sum_i 1/|o_i| sum_t
    lengths = mask.sum(dim=1).clamp(min=1)
    return ((per_token * mask).sum(dim=1) / lengths).sum() / norm.num_sequences


def _token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormaliser) -> torch.Tensor:
    # DAPO (Yu et al. 2025, https://arxiv.org/abs/2503.14476, eq. 8): every token weighs the same
    return (per_token * mask).sum() / max(norm.num_tokens, 1.0)


def _constant_normaliser(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormaliser) -> torch.Tensor:
    # Dr. GRPO (Liu et al. 2025, https://arxiv.org/abs/2503.20783): no length bias, constant denominator
    sampled = norm.num_sequences if norm.num_sampled is None else norm.num_sampled
    return (per_token * mask).sum() / (sampled * norm.max_completion_length)


LOSS_AGGREGATIONS = {
    "grpo": _sequence_mean,
    "bnpo": _token_mean,
    "dapo": _token_mean,
    "dr_grpo": _constant_normaliser,
}


class LossType(NamedTuple):
    objective: str  # key of POLICY_OBJECTIVES
    aggregation: str  # key of LOSS_AGGREGATIONS


LOSS_TYPES = {
    "grpo": LossType("clip", "grpo"),
    "bnpo": LossType("clip", "bnpo"),
    "dapo": LossType("clip", "dapo"),
    "dr_grpo": LossType("clip", "dr_grpo"),
    "cispo": LossType("cispo", "dapo"),  # J_CISPO divides by the total token count
    "sapo": LossType("sapo", "grpo"),  # per-sequence mean, as in TRL and verl
}


# ----------------------------------------------------------------------------------------------------
# Sampler/trainer mismatch: each fn(old_logprobs, sampler_logprobs, mask, threshold) -> (B, T) detached weight
# w = pi_old / pi_sampler, multiplying the policy term (Yao et al. 2025, "Your efficient RL framework secretly
# brings you off-policy RL training", https://fengyao.notion.site/off-policy-rl: truncated IS; masked IS drops
# the token or sequence instead). Sequence level: w = exp(sum_t (old_t - sampler_t)), one weight per completion.


def _token_log_weight(old, sampler, mask):
    return (old - sampler) * mask  # (B, T)


def _sequence_log_weight(old, sampler, mask):
    return ((old - sampler) * mask).sum(dim=1, keepdim=True).expand_as(old)  # (B, T)


def _truncated(log_weight: torch.Tensor, threshold: float) -> torch.Tensor:
    return torch.exp(torch.clamp(log_weight, max=math.log(threshold)))


def _masked(log_weight: torch.Tensor, threshold: float) -> torch.Tensor:
    limit = math.log(threshold)
    return torch.where(log_weight <= limit, torch.exp(torch.clamp(log_weight, max=limit)), 0.0)


ROLLOUT_IS_MODES: dict[str, Callable[..., torch.Tensor] | None] = {
    "none": None,
    "token_truncate": lambda old, sampler, mask, c: _truncated(_token_log_weight(old, sampler, mask), c),
    "token_mask": lambda old, sampler, mask, c: _masked(_token_log_weight(old, sampler, mask), c),
    "sequence_truncate": lambda old, sampler, mask, c: _truncated(_sequence_log_weight(old, sampler, mask), c),
    "sequence_mask": lambda old, sampler, mask, c: _masked(_sequence_log_weight(old, sampler, mask), c),
}


def rollout_importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                               mode: str, threshold: float) -> torch.Tensor | None:
    """(B, T) detached weights pi_old / pi_sampler under `mode` (None for 'none'); old and sampler: (B, T)."""
    weigh = ROLLOUT_IS_MODES[mode]
    if weigh is None:
        return None
    return weigh(old_logprobs.detach().float(), sampler_logprobs.float(), mask.float(), threshold).detach()


def logprob_gap(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean, max) of |trainer - sampler| log-prob over the masked tokens: ~0 when both are one computation."""
    gap = (logprobs.detach().float() - sampler_logprobs.float()).abs()[mask.bool()]
    return (float(gap.mean()), float(gap.max())) if gap.numel() else (0.0, 0.0)


# ----------------------------------------------------------------------------------------------------
# Entropy


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """(B, T) bool: the completion tokens whose entropy is in the top `quantile` fraction of this batch's tokens
    (Wang et al. 2025, "Beyond the 80/20 rule", arXiv 2506.01939: entropy >= the batch's (1 - q) quantile)."""
    keep = mask.bool()
    values = entropy.detach().float()[keep]
    if values.numel() == 0:
        return keep
    threshold = torch.quantile(values, 1 - quantile)
    return keep & (entropy.detach() >= threshold)


# ----------------------------------------------------------------------------------------------------
# The loss


@dataclass(frozen=True)
class LossSettings:
    """Everything grpo_loss needs besides tensors; `from_config` reads it off a GRPOConfig."""

    clip_eps_low: float = 0.2
    clip_eps_high: float | None = None  # None = clip_eps_low
    kl_beta: float = 0.0
    loss_type: str = "grpo"  # key of LOSS_TYPES
    importance_level: str = "token"  # key of IMPORTANCE_LEVELS
    kl_estimator: str = "k3"  # key of KL_ESTIMATORS
    negative_ratio_cap: float | None = None  # delta / clip_ratio_c (the smaller when both are set)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    rollout_is: str = "none"  # key of ROLLOUT_IS_MODES
    rollout_is_threshold: float = 3.0

    @property
    def epsilon_high(self) -> float:
        return self.clip_eps_low if self.clip_eps_high is None else self.clip_eps_high

    @property
    def needs_entropy(self) -> bool:
        return self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0

    @classmethod
    def from_config(cls, config: GRPOConfig) -> LossSettings:
        caps = [c for c in (config.delta, config.clip_ratio_c) if c is not None]
        return cls(clip_eps_low=config.clip_epsilon, clip_eps_high=config.epsilon_high, kl_beta=config.kl_beta,
                   loss_type=config.loss_type, importance_level=config.importance_sampling_level,
                   kl_estimator=config.kl_loss_type, negative_ratio_cap=min(caps) if caps else None,
                   sapo_temperature_pos=config.sapo_temperature_pos, sapo_temperature_neg=config.sapo_temperature_neg,
                   top_entropy_quantile=config.top_entropy_quantile, entropy_coef=config.entropy_coef,
                   rollout_is=config.rollout_is, rollout_is_threshold=config.rollout_is_threshold)


class LossStats(NamedTuple):
    """Statistics of one loss evaluation, all detached scalars (token means over the completion mask)."""

    policy_loss: torch.Tensor
    kl: torch.Tensor
    ratio_mean: torch.Tensor
    clip_frac_low: torch.Tensor
    clip_frac_high: torch.Tensor
    clip_frac: torch.Tensor
    clip_frac_capped: torch.Tensor | None = None  # A < 0 tokens held by delta / clip_ratio_c
    entropy: torch.Tensor | None = None  # mean token entropy; 0 when grpo_loss was given no entropy
    rollout_is_weight_mean: torch.Tensor | None = None  # mean pi_old / pi_sampler weight; 1 when rollout_is is off
    rollout_is_dropped_frac: torch.Tensor | None = None  # tokens a mask mode set to weight 0


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.0,
    loss_type: str = "grpo",
    importance_level: str = "token",
    normaliser: LossNormaliser | None = None,
    settings: LossSettings | None = None,
    entropy: torch.Tensor | None = None,
    sampler_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO objective (or a variant of it) for a batch of completions.

    logprobs:         (B, T) log pi_theta of each completion token (with grad)
    old_logprobs:     (B, T) log pi_old, the policy that sampled; None = logprobs.detach() (one update per
                      rollout: the ratio is 1, the loss value ~0, and its gradient is the policy gradient)
    ref_logprobs:     (B, T) log pi_ref, or None when kl_beta == 0
    advantages:       (B,)   group-relative advantage of each completion
    completion_mask:  (B, T) 1 on completion tokens up to and including EOS, 0 on padding
    settings:         the variant (LossSettings); when given it replaces clip_eps_low .. importance_level
    entropy:          (B, T) token entropies, needed for top_entropy_quantile < 1 and entropy_coef != 0 (with grad
                      for the bonus), logged otherwise
    sampler_logprobs: (B, T) log-probs recorded while sampling, needed for rollout_is != 'none'
    """
    if settings is None:
        settings = LossSettings(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, kl_beta=kl_beta,
                                loss_type=loss_type, importance_level=importance_level)
    mask = completion_mask.to(logprobs.dtype)  # (B, T)
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    if normaliser is None:
        normaliser = LossNormaliser(float(mask.shape[0]), float(mask.sum()), int(mask.shape[1]))
    if settings.needs_entropy and entropy is None:
        raise ValueError("top_entropy_quantile < 1 and entropy_coef != 0 need the token entropies (entropy=...)")
    objective, aggregation = LOSS_TYPES[settings.loss_type]

    log_ratio = IMPORTANCE_LEVELS[settings.importance_level](logprobs, old_logprobs, mask)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages[:, None].to(logprobs.dtype)  # (B, 1)
    term = POLICY_OBJECTIVES[objective](ratio, logprobs, adv, settings)
    pg_loss = term.pg_loss  # (B, T)
    if settings.top_entropy_quantile < 1.0:
        pg_loss = pg_loss * high_entropy_mask(entropy, mask, settings.top_entropy_quantile).to(pg_loss.dtype)
    is_weight = None
    if settings.rollout_is != "none":
        if sampler_logprobs is None:
            raise ValueError(f"rollout_is={settings.rollout_is!r} needs the sampler's log-probs (sampler_logprobs=...)")
        is_weight = rollout_importance_weights(old_logprobs, sampler_logprobs, mask, settings.rollout_is,
                                               settings.rollout_is_threshold)  # (B, T)
        pg_loss = pg_loss * is_weight

    per_token = pg_loss
    estimate_kl = KL_ESTIMATORS[settings.kl_estimator]
    if settings.kl_beta > 0:
        if ref_logprobs is None:
            raise ValueError("kl_beta > 0 needs ref_logprobs")
        kl = estimate_kl(logprobs, ref_logprobs)  # (B, T)
        per_token = pg_loss + settings.kl_beta * kl
    else:
        kl = torch.zeros_like(logprobs) if ref_logprobs is None else estimate_kl(logprobs, ref_logprobs)

    aggregate = LOSS_AGGREGATIONS[aggregation]
    loss = aggregate(per_token, mask, normaliser)
    if settings.entropy_coef != 0.0:
        # the bonus is the token mean over the whole optimizer batch, whatever the aggregation (as TRL does), so
        # entropy_coef means the same for every loss_type; micro-batch shares sum to it
        loss = loss - settings.entropy_coef * (entropy * mask).sum() / max(normaliser.num_tokens, 1.0)

    with torch.no_grad():
        low, high = term.clipped_low.to(mask.dtype), term.clipped_high.to(mask.dtype)
        nothing = torch.zeros((), device=mask.device)
        stats = LossStats(
            policy_loss=aggregate(pg_loss.detach(), mask, normaliser),
            kl=masked_mean(kl.detach(), mask),
            ratio_mean=masked_mean(ratio.detach(), mask),
            clip_frac_low=masked_mean(low, mask),
            clip_frac_high=masked_mean(high, mask),
            clip_frac=masked_mean(torch.clamp(low + high, max=1), mask),
            clip_frac_capped=masked_mean(term.capped.to(mask.dtype), mask),
            entropy=masked_mean(entropy.detach().float(), mask) if entropy is not None else nothing,
            rollout_is_weight_mean=masked_mean(is_weight, mask) if is_weight is not None else nothing.add(1.0),
            rollout_is_dropped_frac=masked_mean((is_weight == 0).to(mask.dtype), mask) if is_weight is not None
            else nothing,
        )
    return loss, stats


__all__ = [
    "ADVANTAGE_SCALES",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LOSS_TYPES",
    "MULTI_REWARD_AGGREGATIONS",
    "POLICY_OBJECTIVES",
    "ROLLOUT_IS_MODES",
    "GRPOConfig",
    "LossNormaliser",
    "LossSettings",
    "LossStats",
    "LossType",
    "PolicyTerm",
    "compute_group_advantages",
    "compute_token_log_probs",
    "group_reward_std",
    "grpo_loss",
    "high_entropy_mask",
    "k1_kl",
    "k2_kl",
    "k3_kl",
    "logprob_gap",
    "masked_mean",
    "multi_reward_advantages",
    "rollout_importance_weights",
    "sequence_mean_log_probs",
    "token_logprobs_from_logits",
    "weighted_reward_sum",
]
