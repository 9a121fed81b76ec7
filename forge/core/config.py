"""GRPOConfig: every knob of a Forge run, one flat dataclass.

Each field's docstring is its documentation everywhere: `forge train --help` and docs/config.md are generated
from it (`python -m forge.core.config_docs > docs/config.md`; tests/math/test_config.py fails when they
drift).
`validate()` turns every bad value or combination into one clear error before any model is loaded;
`LossSettings.from_config` (core/grpo.py) derives from it the loss variant that the pure math takes.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, field

from forge.core.config_checks import VLLM_INSTALL, range_problems
from forge.core.config_types import field_type_problems
from forge.core.grpo import EntropyControl
from forge.core.trl_attributes import TRLAttributes, with_trl_fields


def require_vllm() -> None:
    """Raise ImportError with VLLM_INSTALL when vLLM is not importable."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(VLLM_INSTALL)


@with_trl_fields
@dataclass(init=False)
class GRPOConfig(TRLAttributes):
    """Every knob of a Forge run, in blocks: the run's core, batching, the algorithm, sampling, the
    optimizer, LoRA, the engine, logging, tools and failure handling.

    Keyword arguments are the fields below. TRL's GRPOConfig names are accepted where they mean the same thing
    (`TRL_NAMES`, `TRL_CONVERTED`; docs/from-trl.md) and refused, naming Forge's equivalent, where they do not
    (`TRL_REFUSED`); any other unknown name is an error with the closest field names. TRL's names read back as
    attributes and can be assigned (core/trl_attributes.py, which holds __init__)."""

    # --- the run's core: group, clip, KL, lengths, learning rate, steps, saves, logs, seed ---
    group_size: int = 8
    """Completions sampled per prompt (G); 1 only in pure distillation. Multiplies the generation cost."""
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
    """Write a checkpoint to {output_dir}/checkpoint-{step}/ every N optimizer steps (0 disables)."""
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
    micro_batch_size: int | str = 0
    """Completions per forward/backward pass when computing the loss; 0 = the whole rollout batch; 'auto' =
    the largest that fits max_memory_mb, measured by the preflight (one group per pass when the preflight is
    off)."""
    max_steps: int = -1
    """Stop after this many optimizer steps; -1 = run num_train_epochs."""
    shuffle: bool = True
    """Shuffle the dataset each epoch (seeded)."""

    # --- algorithm variant ---
    num_iterations: int = 1
    """Optimizer passes over each rollout (mu). >1 computes pi_old once and reuses it."""
    rollout_slices: int = 1
    """Optimizer steps one rollout feeds, each on its own slice of the rollout's completions (TRL's
    steps_per_generation / gradient_accumulation_steps; forge/core/rollout_slices.py): advantages over the
    whole rollout, then each rollout batch's completions shuffled (seeded by seed and step) and cut into this
    many equal slices, each slice one optimizer step with its own log row and learning-rate tick. With
    num_iterations > 1 the slices are trained in order, num_iterations times over. Checkpoints land after a
    rollout's last slice; max_steps must be a multiple of num_iterations x rollout_slices. 1 = every
    completion in one optimizer step."""
    loss_type: str = "grpo"
    """grpo (per-sequence mean), bnpo / dapo (token mean), dr_grpo (sum / (B * max_new_tokens)): the clipped
    objective; cispo (MiniMax-M1: stop-gradient weight min(ratio, 1 + clip_epsilon_high) x A x logp, token
    mean; TRL's epsilon_high=5.0 is clip_epsilon_high=4.0 here); sapo (soft gate instead of the clip,
    per-sequence mean)."""
    importance_sampling_level: str = "token"
    """'token' (GRPO) or 'sequence' (GSPO: one length-normalised ratio per completion)."""
    clip_epsilon_high: float | None = None
    """Upper clip range (DAPO clip-higher, e.g. 0.28); None = clip_epsilon."""
    scale_rewards: str = "group"
    """Advantage: r - group mean divided by the 'group' std, the 'batch' std, or nothing ('none', Dr. GRPO);
    'rloo' (r minus the mean of the other G-1 rewards); 'reinforce_plus_plus_baseline' (r - group mean,
    divided by the batch std of those differences)."""
    reward_weights: list[float] | None = None
    """Weights when reward_fn is a list of rewards; None = all 1.0."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_new_tokens without EOS from the loss (DAPO)."""
    drop_zero_std_groups: bool = False
    """Leave groups whose rewards are all equal out of the loss (DAPO's filter; dynamic_sampling samples more
    too): they cost no loss, reference, pi_old or teacher forward."""
    advantage_epsilon: float = 1e-4
    """Added to the std when scaling advantages."""

    # --- algorithm catalogue: objective caps, KL estimator, several rewards, entropy, sampler correction ---
    # Every default below leaves the GRPO of the block above unchanged. Names follow TRL (delta, sapo_*,
    # multi_objective_aggregation, top_entropy_quantile, entropy_coef) or verl (clip_ratio_c, kl_loss_type,
    # rollout_is, rollout_is_threshold); docs/algorithm.md cites each paper and equation.
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): the ratio of a token with negative advantage is capped at delta, so
    its loss stays bounded however far the policy moved. Must be > 1 + clip_epsilon_high; None = off."""
    clip_ratio_c: float | None = None
    """Dual-clip PPO (Ye et al. 2020): negative-advantage loss capped at -A x clip_ratio_c, the same bound as
    delta under verl's name. verl applies 3.0 always; Forge keeps it off (None) so default runs are unchanged.
    Must be > 1."""
    sapo_temperature_pos: float = 1.0
    """loss_type='sapo': temperature of the soft gate for tokens with positive advantage."""
    sapo_temperature_neg: float = 1.05
    """loss_type='sapo': temperature of the soft gate for tokens with zero or negative advantage."""
    kl_loss_type: str = "k3"
    """Per-token estimator of KL(pi_theta || pi_ref) on sampled tokens, d = logp - ref: k1 = d, k2 = d^2 / 2,
    k3 = exp(-d) + d - 1 (>= 0, the GRPO default)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """Several rewards: 'sum_then_normalize' (weighted sum, then scale_rewards), or 'normalize_then_sum'
    (GDPO: each reward normalised within its group, weighted sum, then normalised over the batch)."""
    top_entropy_quantile: float = 1.0
    """The policy gradient flows only through this top fraction of completion tokens by entropy (Wang et al.
    2025 use 0.2); 1.0 = every token."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef x the mean entropy of the completion tokens (0 = off);
    with adaptive_entropy, the coefficient to start from."""
    adaptive_entropy: bool = False
    """Adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy): after each optimizer step the
    coefficient rises by entropy_coef_delta while the step's mean token entropy is at or below entropy_target
    and falls by it above, within [entropy_coef_min, entropy_coef_max]; the bonus acts only while the entropy
    is at or below the target. Logged as entropy_coef (the coefficient the step used)."""
    entropy_target: float = 0.2
    """adaptive_entropy: the mean token entropy (nats) to hold."""
    entropy_coef_delta: float = 0.005
    """adaptive_entropy: how much the coefficient moves per optimizer step."""
    entropy_coef_min: float = 0.0
    """adaptive_entropy: the lowest coefficient."""
    entropy_coef_max: float = 1.0
    """adaptive_entropy: the highest coefficient."""
    rollout_is: str = "none"
    """Sampler/trainer mismatch correction with the sampler's log-probs: 'token_truncate' /
    'sequence_truncate' (weight min(w, C)), 'token_mask' / 'sequence_mask' (weight 0 where w > C), or
    'none'."""
    rollout_is_threshold: float = 3.0
    """C for rollout_is: the largest importance weight pi_old / pi_sampler kept (TRL's default 3.0)."""
    kl_bias_correction: bool = False
    """Weight the KL term by the importance ratio pi_theta / pi_old (DeepSeek-V3.2): the unbiased reverse-KL
    gradient off-policy. TRL's use_bias_correction_kl (on by default there; off here, so runs stay as they
    were)."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask (TRL's name): a completion with negative advantage whose mean
    log-prob gap, sampler minus current policy, is over this loses its policy term; None = off."""

    # --- on-policy distillation (a teacher scores the student's samples) and dynamic sampling (DAPO) ---
    teacher_model: str | None = None
    """On-policy distillation: a model id or folder whose log-probs of the student's sampled tokens give each
    token the advantage distill_coef x -(log p_student - log p_teacher) (docs/algorithm.md); a LoRA adapter
    folder of the student's base becomes its second adapter; tokenizers must match. None = no teacher."""
    distill_coef: float = 1.0
    """With a teacher: the weight of its per-token advantage -(log p_student - log p_teacher)."""
    reward_coef: float = 1.0
    """With a teacher: the weight of the group reward advantage on every token (0 = pure distillation, which
    allows group_size=1; the rewards are still computed and logged)."""
    distill_loss: str = "sampled"
    """With a teacher: 'sampled' = the reverse KL at each sampled token as its advantage; 'full' = GKD's
    divergence (distill_beta) of the whole next-token distributions at each loss position, a loss term of
    weight distill_coef (docs/algorithm.md; both models' logits a plain output layer of their states)."""
    distill_beta: float = 1.0
    """distill_loss='full': GKD's (TRL GKDConfig's) beta: 1 = KL(student || teacher), 0 = the forward KL."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: more rounds of prompts_per_step prompts (from the training rows, the step's
    seed) until the step holds as many groups whose rewards differ as it has prompts, or max_sampling_rounds;
    flat groups stay out of the loss (verl: algorithm.filter_groups)."""
    max_sampling_rounds: int = 4
    """With dynamic_sampling: the most rounds of generation in one step, its own rows counted as the first
    (verl's max_num_gen_batches); at the cap the step trains on the groups with a signal it found."""

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
    # init=False (lora_*, dtype): TRL's ModelConfig has these names too, and TRL's scripts parse it with the
    # GRPOConfig in one HfArgumentParser, which takes only init fields. The constructor takes them all the
    # same.
    use_lora: bool = False
    """Train LoRA adapters (peft) instead of all weights; the reference is the adapter-disabled base."""
    lora_r: int = field(default=16, init=False)
    """LoRA rank."""
    lora_alpha: int = field(default=32, init=False)
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_dropout: float = field(default=0.0, init=False)
    """Saved in the adapter's config for use elsewhere. Forge itself trains with dropout off (sampling, pi_old
    and pi_theta must be one network), so it does not change a Forge run."""
    lora_target_modules: list[str] | str | None = field(default=None, init=False)
    """Module names to adapt; a string is what peft makes of it ('all-linear', or a regex the whole module
    name matches); None = the attention projections of the architecture (q/k/v/o for Llama)."""

    # --- engine ---
    share_prompt_prefix: bool = True
    """Compute each prompt once per group (in generation and in the loss) instead of G times."""
    generation_backend: str = "auto"
    """The decode step (forge/model/decode_plan.py): 'eager' (the model's forward per token), 'compiled' (a
    static KV cache and torch.compile, once per batch/length bucket: inductor's C++ kernels on a CPU, CUDA
    graphs on a GPU; the first steps pay the compile), or 'auto': what measured faster on this device and
    dtype, eager where unmeasured (logged with its reason). On an AMX Xeon the compiled step is 1.28x slower
    (bench/compiled_decode.py), so auto decodes eagerly there. Tool and environment rollouts always decode
    eagerly. 'vllm': sample on vLLM (TRL's use_vllm; forge/model/vllm_engine.py), an engine in this process or
    a server (vllm_mode), with the policy's weights pushed after every optimizer step; needs vLLM installed
    (docs/scaling.md)."""
    vllm_mode: str = "colocate"
    """With generation_backend='vllm': 'colocate' (an engine inside the training process, started from the
    policy's weights) or 'server' (a `forge vllm-serve` process, on another GPU or the same machine)."""
    vllm_enforce_eager: bool = False
    """Colocate: run vLLM's model eagerly instead of compiling it. On a CPU it started in seconds instead of
    over a minute and sampled as fast (docs/performance.md); on a GPU the compiled model's CUDA graphs sample
    faster."""
    vllm_gpu_memory_utilization: float = 0.3
    """Colocate on a GPU: the fraction of its memory vLLM may take (weights and KV cache); the rest trains. On
    a CPU the KV cache is sized for the run instead (VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it)."""
    vllm_server_base_url: str | None = None
    """Server: the address of `forge vllm-serve` (e.g. http://10.0.0.2:8000); None = vllm_server_host and
    _port."""
    vllm_server_host: str = "127.0.0.1"
    """Server: its host, when vllm_server_base_url is None."""
    vllm_server_port: int = 8000
    """Server: its port, when vllm_server_base_url is None."""
    vllm_server_timeout: float = 240.0
    """Server: seconds to wait for it to answer before the run fails."""
    max_staleness: int | None = None
    """Sample and learn at once (async GRPO; TRL's AsyncGRPOTrainer): a rollout worker samples the next steps'
    groups while this process trains. Step s trains on groups sampled by the weights of step
    s - max_staleness (of the run's first step until then): 1 = one step off (AsyncGRPOConfig's default),
    0 = the worker waits for every update (the synchronous run's numbers, sampled in another process); None =
    sample, then learn, in this process. The schedule is fixed, so a seeded run repeats. A stale group's ratio
    is taken against the log-probs its sampler recorded (docs/algorithm.md). A second process holds a copy of
    the policy, its weights updated through shared memory after every optimizer step, and samples with the own
    decode loop (sampler_threads, sampler_device) or on a `forge vllm-serve` server (vllm_mode='server'),
    which it gives each step's weights (docs/scaling.md)."""
    sampler_threads: int = 0
    """With max_staleness set, sampling on a CPU: the sampling process's threads (0 = half of this process's
    torch threads, at least 1); while it runs this process trains on the rest (one core each of two)."""
    sampler_device: str | None = None
    """With max_staleness set: the device of the sampling process's copy of the policy (e.g. 'cuda:1', to
    sample on one GPU and train on another); None = the trainer's."""
    rollout_timeout: float = 900.0
    """With max_staleness set: seconds the trainer waits for one step's groups before it stops the run, naming
    the rollout worker (TRL's heartbeat_stale_after_s); a worker that dies is noticed within a second."""
    merge_lora_for_generation: bool = True
    """With LoRA, generate and evaluate with the adapters folded into a temporary copy of the adapted weights
    (decode_plan.merged_adapters): one matmul per layer instead of three, 0.85-0.90x the generation time on a
    CPU (bench/merged_generation.py). The training weights are untouched (put back bit for bit); the sampler
    then differs from the trainer by fp32 rounding. In bf16/fp16 training's sampling keeps the adapters
    (rounding W + s B A once to bf16 doubles the sampler/trainer log-prob gap), while evaluation merges
    (bench/merged_bf16.py). Needs memory for one copy of the adapted weights during generation, and is skipped
    when that does not fit on the GPU, under FSDP2, and for DoRA or quantised layers."""
    logprob_chunk_size: int = 0
    """Positions whose logits exist at once in the loss pass and the log-probs: the logits are made from the
    last hidden states chunk by chunk (recomputed in backward), so the (tokens x vocabulary) logits never
    exist. 0 = as many positions as make 2^22 logits (16 MB in fp32), whatever the vocabulary
    (bench/logprob_chunks.py)."""
    gradient_checkpointing: bool = False
    """Keep only each decoder layer's input in the loss pass and recompute the rest in backward: less
    activation memory for one more forward of the layers. The prompt's keys and values are kept, so each
    group's prompt still runs once. Generation is unchanged."""
    fsdp: bool = False
    """Shard the weights, gradients and AdamW state over the processes with PyTorch's FSDP2 (`fully_shard` per
    decoder layer), instead of a whole copy on every process: for a model too big to train data-parallel.
    Needs several processes (`forge train --nproc N --fsdp`, torchrun, or `accelerate launch` with an FSDP2
    config); rollouts gather the whole weights (forge/parallel/sharding.py). With one process it changes
    nothing."""
    dtype: str = field(default="auto", init=False)  # init=False: as lora_r
    """Compute precision; trainable weights are always float32 masters. 'bfloat16'/'float16' = forward,
    backward and generation under autocast (fp16 adds a dynamic loss scale); 'auto' = bf16 on a GPU that
    supports it or a CPU with bf16 matrix units (AMX / AVX512-BF16; FORGE_CPU_BF16=0/1 overrides that
    detection), else fp32 (logged, with the reason); 'float32' forces fp32."""

    # --- logging, eval, checkpoints ---
    use_tensorboard: bool = False
    """Write TensorBoard events under {output_dir}/tensorboard."""
    use_trackio: bool = False
    """Mirror metrics to trackio, stored locally under TRACKIO_DIR (falls back with a warning when trackio is
    missing)."""
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
    """Checkpoint directory to resume from (e.g. out/checkpoint-40), or 'latest' for the newest one in
    output_dir."""
    overwrite_output_dir: bool = False
    """Let a new run (not resuming) delete the checkpoints and logs another run left in output_dir; without it
    such a directory is refused."""

    # --- tools and environments (multi-turn: tools=[...] or environment_factory=, docs/environments.md) ---
    max_tool_calling_iterations: int | None = 4
    """Most tool calls per completion (TRL's name), an environment's turn limit; a further call ends the
    completion there, unanswered. None: no limit but max_new_tokens (TRL's default)."""
    tool_timeout: float = 10.0
    """Seconds one tool call may take; a slower call is answered with an error text and counted."""
    max_tool_output_chars: int = 1000
    """Longest tool output given back to the model; a longer one keeps its start and says it was truncated."""
    max_episode_tokens: int | None = None
    """Most tokens of one completion with tools or an environment, sampled and fed results together (None: the
    model's context, which always bounds prompt + completion). A result that does not fit is cut, ends with a
    '[truncated: ...]' marker, and ends the completion."""
    tool_format: str = "auto"
    """How calls are written: 'text' (<calc>expr</calc> -> <result>v</result>, shown by the prompt's worked
    examples), 'template' (the chat template's <tool_call>{json}</tool_call> and tool messages) or 'auto'
    (template when the tokenizer's chat template supports tools, else text)."""
    tool_isolation: str = "thread"
    """Where tool calls run: 'thread' (a thread of the trainer: fastest, any callable; a timed-out call keeps
    running) or 'process' (worker processes: a call past tool_timeout is killed, memory is capped by
    tool_memory_mb; tools must be module-level functions or picklable; docs/tools.md, Isolation)."""
    tool_memory_mb: int = 1024
    """With tool_isolation='process': the most memory (MB) a tool worker may allocate; past it the call
    fails."""

    # --- failure handling ---
    on_reward_error: str = "raise"
    """'raise' stops with the failing sample named; 'score' gives it reward_error_value and counts it."""
    reward_error_value: float = 0.0
    """Score given to a sample whose reward failed, when on_reward_error == 'score'."""
    reward_timeout: float | None = None
    """Seconds one reward call may take; None = no limit."""
    max_consecutive_nonfinite: int = 3
    """Abort after this many optimizer steps in a row skipped for a NaN/inf loss or gradient."""
    preflight: str = "warn"
    """Before step 1, sample preflight_prompts prompts x group_size with the run's own model and rewards and
    print what they show (truncation, each reward's failures, flat groups, projected time): 'warn' prints and
    trains, 'strict' also stops when no group carries signal, most completions are cut, or a reward fails on
    most samples, 'off' skips it. It leaves the run's weights and random state unchanged."""
    preflight_prompts: int = 4
    """Prompts the preflight samples (each with group_size completions)."""
    max_memory_mb: float | None = None
    """The memory the run may use (the resident set on a CPU, allocated memory on a GPU); None = what the
    process holds plus what the machine has free when the preflight runs. The preflight projects the run's
    peak from its own samples and stops a run that would not fit, naming what to turn (micro_batch_size='auto'
    fits the loss pass to it). Refused with preflight='off', which would leave it unchecked."""
    health_window: int = 5
    """Steps the run-health rules look back over; an alarm is said once per episode (docs/reliability.md)."""
    health_thresholds: list[str] | None = None
    """Run-health thresholds that differ from the defaults, as 'rule=value', e.g. ['kl_spike=5']."""
    stop_on_health: list[str] | None = None
    """Run-health rules whose alarm stops the run, the last finished step saved; ['any'] = all; None =
    none."""

    @property
    def completions_per_step(self) -> int:
        """Completions generated in one rollout batch."""
        return self.prompts_per_step * self.group_size

    @property
    def prompts_per_optimizer_step(self) -> int:
        return self.prompts_per_step * self.gradient_accumulation_steps

    @property
    def updates_per_rollout(self) -> int:
        """Optimizer steps one rollout feeds: num_iterations passes over its rollout_slices slices."""
        return self.num_iterations * self.rollout_slices

    @property
    def entropy_control(self) -> EntropyControl:
        return EntropyControl(self.entropy_coef, self.adaptive_entropy, self.entropy_target,
                              self.entropy_coef_delta, self.entropy_coef_min, self.entropy_coef_max)

    def validate(self) -> GRPOConfig:
        """Raise a ValueError that says what to change for every bad setting; returns self.

        First every field's type is checked against its annotation and every number for being finite
        (core/config_types.py), so the range checks (core/config_checks.py) only ever see numbers of the
        right kind."""
        problems = field_type_problems(self)
        if problems:
            raise ValueError("invalid GRPOConfig:\n  - " + "\n  - ".join(problems))

        problems = range_problems(self)
        if problems:
            raise ValueError("invalid GRPOConfig:\n  - " + "\n  - ".join(problems))
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> GRPOConfig:
        """From a mapping of field names (TRL's names too, as for the constructor); unknown names raise
        ValueError."""
        try:
            return cls(**values)
        except TypeError as error:
            raise ValueError(str(error)) from None
