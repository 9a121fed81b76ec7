"""What one optimizer step logs: reward, loss and rollout statistics, and the sample completions.

Two statistics containers fill up during a step, one per phase: `RolloutStats` (collect: rewards, lengths,
tool use of every rollout) and `UpdateTotals` (update: the loss and its statistics, micro-batch by
micro-batch). Each field says in its metadata how it combines over the processes (`over_ranks`: "cat" tensors
in rank order, "sum" counts, "max" durations), and the trainer combines them (forge/parallel/distributed.py
`DataParallel.combined`). The functions here then only compute: they see the statistics of the whole batch,
never a process group, so every rank logs the same numbers and none of this code knows how many there are.
Every key is explained in docs/metrics.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

CAT, SUM, MAX = ({"over_ranks": how} for how in ("cat", "sum", "max"))  # how a field combines over the ranks


@dataclass
class RolloutStats:
    """What collecting one optimizer step's rollouts measured."""

    # one (N,) tensor per rollout batch:
    scores: list[torch.Tensor] = field(default_factory=list, metadata=CAT)  # total reward
    valid: list[torch.Tensor] = field(default_factory=list, metadata=CAT)  # bool: a finite reward applied
    lengths: list[torch.Tensor] = field(default_factory=list, metadata=CAT)  # tokens (model's, tool results)
    truncated: list[torch.Tensor] = field(default_factory=list, metadata=CAT)  # 1.0: no EOS in max_new_tokens
    # reward name -> one (N,) tensor per rollout batch: its scores, and where it returned a number (bool)
    components: dict[str, list[torch.Tensor]] = field(default_factory=dict, metadata=CAT)
    applies: dict[str, list[torch.Tensor]] = field(default_factory=dict, metadata=CAT)
    # runs with tools: calls made and result tokens fed, per completion
    tool_calls: list[torch.Tensor] = field(default_factory=list, metadata=CAT)
    tool_result_tokens: list[torch.Tensor] = field(default_factory=list, metadata=CAT)
    errors: int = field(default=0, metadata=SUM)  # reward calls that raised (on_reward_error='score')
    timeouts: int = field(default=0, metadata=SUM)
    nonfinite: int = field(default=0, metadata=SUM)
    tool_errors: int = field(default=0, metadata=SUM)
    tool_timeouts: int = field(default=0, metadata=SUM)
    tool_malformed: int = field(default=0, metadata=SUM)  # unparseable calls and unknown tools
    tool_truncated: int = field(default=0, metadata=SUM)  # outputs cut at max_tool_output_chars
    env_episodes: int = field(default=0, metadata=SUM)  # runs with an environment: episodes run
    env_failed: int = field(default=0, metadata=SUM)  # ... that failed (Episode.failure)
    env_timed_out: int = field(default=0, metadata=SUM)  # ... because building or resetting timed out
    gen_seconds: float = field(default=0.0, metadata=MAX)  # the ranks generate side by side
    # on-policy distillation (core/teacher.py): one (N,) tensor per rollout batch, the reverse KL summed over
    # each completion's loss tokens and their count; the seconds of the teacher's pass
    distill_kl: list[torch.Tensor] = field(default_factory=list, metadata=CAT)
    distill_tokens: list[torch.Tensor] = field(default_factory=list, metadata=CAT)
    teacher_seconds: float = field(default=0.0, metadata=MAX)
    # what the rewards logged with TRL's log_metric: name -> one tensor of values per rollout batch
    reward_logged: dict[str, list[torch.Tensor]] = field(default_factory=dict, metadata=CAT)
    # dynamic_sampling/*: the step's rounds (the same on every rank; core/dynamic_sampling.py)
    sampling: dict[str, float] = field(default_factory=dict, metadata=MAX)
    prompt_tokens: float = field(default=0.0, metadata=SUM)  # each completion's prompt tokens, summed
    samples: list[dict] = field(default_factory=list)  # one logged sample per prompt (this rank's)

    def add(self, rollout, scores, rows: list[dict]) -> None:
        """One rollout batch (core/rollout.py Rollout) of these dataset rows and its scores
        (core/scoring.py)."""
        self.samples += rollout_samples(rows, rollout, scores.total, rollout.group_size, scores.extra)
        for name, values in scores.logged.items():
            self.reward_logged.setdefault(name, []).append(torch.tensor(values))
        self.scores.append(scores.total)
        self.valid.append(scores.valid & scores.scored)
        self.lengths.append(rollout.completion_lengths.float())
        self.prompt_tokens += float(rollout.prompt_mask.sum()) * rollout.group_size  # once per completion
        self.truncated.append(rollout.truncated.float())
        for name, values in scores.components.items():
            self.components.setdefault(name, []).append(values)
            self.applies.setdefault(name, []).append(scores.applies.get(name, torch.ones_like(scores.valid)))
        self.errors += scores.errors
        self.timeouts += scores.timeouts
        self.nonfinite += scores.nonfinite
        if rollout.episodes is not None:
            self.add_episodes(rollout)
        if rollout.tool_calls is not None:
            self.add_tool_calls(rollout)

    def add_episodes(self, rollout) -> None:
        """A rollout with an environment: its episodes, those that failed and those that timed out."""
        self.env_episodes += len(rollout.episodes)
        self.env_failed += sum(episode.failure is not None for episode in rollout.episodes)
        self.env_timed_out += sum(episode.timed_out for episode in rollout.episodes)

    def add_tool_calls(self, rollout) -> None:
        """A rollout with tools: calls and fed result tokens per completion, failures by kind."""
        results = [result for calls in rollout.tool_calls for result in calls]
        failures = [result.failure for result in results]
        calls_made = torch.tensor([len(calls) for calls in rollout.tool_calls], dtype=torch.float32)  # (N,)
        self.tool_calls.append(calls_made)
        result_tokens = rollout.completion_mask * (1 - rollout.action_mask)  # (N, T)
        self.tool_result_tokens.append(result_tokens.sum(dim=1).float())
        self.tool_errors += failures.count("error")
        self.tool_timeouts += failures.count("timeout")
        self.tool_malformed += failures.count("malformed") + failures.count("unknown_tool")
        self.tool_truncated += sum(result.truncated for result in results)


GAP = "sampling/sampling_logp_difference"  # TRL's name for the sampler's and the trainer's log-prob gap
LOSS_STATS = {"kl": "kl", "clip_frac": "clip_ratio/region_mean", "clip_frac_low": "clip_ratio/low_mean",
              "clip_frac_high": "clip_ratio/high_mean", "ratio_mean": "ratio_mean",
              "clip_frac_capped": "clip_frac_capped", "entropy": "entropy",
              "rollout_is_weight_mean": "sampling/importance_sampling_ratio/mean"}
"""LossStats field -> its logged name (TRL's, where TRL logs the same number)."""


@dataclass
class UpdateTotals:
    """The statistics of one update, accumulated over its micro-batches: the loss is the sum of the shares;
    every other statistic a token-weighted mean (`as_metrics`)."""

    loss: float = field(default=0.0, metadata=SUM)
    tokens: float = field(default=0.0, metadata=SUM)
    weighted: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys((*LOSS_STATS.values(), f"{GAP}/mean"), 0.0), metadata=SUM)
    gap_max: float = field(default=0.0, metadata=MAX)
    # each micro-batch's smallest / largest share of one completion's tokens held by the lower / upper bound
    clip_low_min: list[torch.Tensor] = field(default_factory=list, metadata=CAT)
    clip_high_max: list[torch.Tensor] = field(default_factory=list, metadata=CAT)

    def add(self, loss: torch.Tensor, stats, tokens: float, gap: tuple[float, float] | None = None) -> None:
        """One micro-batch: its loss, LossStats, token count and (mean, max) sampler/trainer log-prob gap."""
        self.loss += float(loss.detach())
        self.tokens += tokens
        for field_name, key in LOSS_STATS.items():
            self.weighted[key] += float(getattr(stats, field_name)) * tokens
        gap_mean, gap_max = gap or (0.0, 0.0)
        self.weighted[f"{GAP}/mean"] += gap_mean * tokens
        self.gap_max = max(self.gap_max, gap_max)
        if stats.clip_frac_low_min is not None:
            self.clip_low_min.append(stats.clip_frac_low_min.detach().float().cpu().reshape(1))
            self.clip_high_max.append(stats.clip_frac_high_max.detach().float().cpu().reshape(1))

    def add_divergence(self, divergence: torch.Tensor, mask: torch.Tensor) -> None:
        """One micro-batch's full-vocabulary distillation divergence (n, T) over its loss tokens (mask
        (n, T)), logged as distill/divergence: the mean over the step's loss tokens."""
        key = "distill/divergence"
        self.weighted[key] = self.weighted.get(key, 0.0) + float((divergence.detach() * mask).sum())

    def as_metrics(self, with_rollout_is: bool = True) -> dict:
        """The update's metrics; clip_ratio/low_min and /high_max (TRL's) are the smallest and the largest
        share of one completion's tokens held by each bound."""
        totals = {"loss": self.loss, **{k: v / max(self.tokens, 1.0) for k, v in self.weighted.items()},
                  f"{GAP}/max": self.gap_max}
        low, high = (torch.cat(parts) if parts else torch.zeros(1)
                     for parts in (self.clip_low_min, self.clip_high_max))
        totals |= {"clip_ratio/low_min": float(low.min()), "clip_ratio/high_max": float(high.max())}
        if not with_rollout_is:
            del totals[LOSS_STATS["rollout_is_weight_mean"]]
        return totals


def step_metrics(stats: RolloutStats, update: dict, *, group_std: torch.Tensor, seconds: float,
                 skipped_steps: int, param_delta_norm: float, engine=None, ahead=None) -> dict:
    """The logged metrics of one optimizer step from the statistics of the whole batch (every rank's share);
    with a vLLM engine (forge/model/vllm_engine.py) also the seconds this step spent pushing weights to it;
    with async GRPO's rollout worker running (`ahead`, forge/core/rollout_worker.py) its async/* metrics, and
    tokens_per_second is the worker's (generation_share: the share of the step the trainer waited for it)."""
    rewards = torch.cat(stats.scores)  # (N_total,)
    lengths, truncated = torch.cat(stats.lengths), torch.cat(stats.truncated)  # (N_total,) each
    worker = {} if ahead is None or not ahead.running else ahead.stats.as_metrics()
    sampling_seconds = worker.get("async/sampler_s", stats.gen_seconds)
    metrics = {
        "loss": update["loss"],
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        **update,  # the update's (core/trainer.py): kl, clip ratios, grad_norm, learning_rate, entropy, ...
        "group_reward_std_mean": float(group_std.mean()),
        "frac_reward_zero_std": float((group_std == 0).float().mean()),
        **completion_metrics(lengths, truncated),
        "_tokens": stats.prompt_tokens + float(lengths.sum()),  # the run's loop sums them as num_tokens
        "tokens_per_second": float(lengths.sum()) / max(sampling_seconds, 1e-9),
        "step_time": seconds,
        "generation_share": stats.gen_seconds / max(seconds, 1e-9),
        "rewards/errors": int(stats.errors),
        "rewards/timeouts": int(stats.timeouts),
        "rewards/nonfinite": int(stats.nonfinite),
        "skipped_steps": skipped_steps,
        "param_delta_norm": param_delta_norm,
        **({} if engine is None else {"vllm/push_seconds": engine.take_push_seconds()}),
        **worker,
    }
    if stats.tool_calls:  # a run with tools
        metrics.update(tool_metrics(stats))
    if stats.distill_tokens or stats.teacher_seconds:  # a run with a teacher
        metrics.update(distill_metrics(stats))
    metrics.update(stats.sampling)
    if stats.env_episodes:  # a run with an environment
        metrics.update(env_metrics(stats))
    for name, parts in stats.components.items():
        values = torch.cat(parts)  # (N_total,)
        if name in stats.applies:  # over the samples the reward applies to (it returned a number)
            values = values[torch.cat(stats.applies[name])]
        metrics[f"rewards/{name}/mean"] = float(values.mean()) if values.numel() else 0.0
        metrics[f"rewards/{name}/std"] = float(values.std()) if values.numel() > 1 else 0.0
    for name, parts in stats.reward_logged.items():  # TRL's log_metric: the mean of the step's values
        metrics[name] = float(torch.cat(parts).mean())
    return metrics


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    """completions/*, TRL's names: lengths (N,) in tokens, over every completion and over those that ended
    with EOS (0 when none did), and the share truncated (N,) at max_new_tokens."""
    terminated = lengths[truncated == 0]  # (n_eos,)
    terminated = terminated if terminated.numel() else torch.zeros(1)
    return {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.mean()),
            "completions/mean_terminated_length": float(terminated.mean()),
            "completions/min_terminated_length": float(terminated.min()),
            "completions/max_terminated_length": float(terminated.max())}


def env_metrics(stats: RolloutStats) -> dict:
    """env/*: the episodes that failed, those that timed out, and the failed share."""
    return {"env/failed_episodes": int(stats.env_failed), "env/timed_out_episodes": int(stats.env_timed_out),
            "env/frac_failed_episodes": stats.env_failed / stats.env_episodes}


def distill_metrics(stats: RolloutStats) -> dict:
    """distill/*: the reverse KL log p_student - log p_teacher of the sampled tokens, per token (over every
    loss token of the step) and per sequence (summed over a completion's tokens, averaged over the completions
    with loss tokens), and the teacher pass's seconds."""
    if not stats.distill_tokens:  # distill_loss='full': its divergence is the loss pass's (UpdateTotals)
        return {"distill/teacher_seconds": stats.teacher_seconds}
    per_sequence, tokens = torch.cat(stats.distill_kl), torch.cat(stats.distill_tokens)  # (N_total,) each
    counted = tokens > 0
    return {"distill/reverse_kl": float(per_sequence.sum() / tokens.sum().clamp(min=1)),
            "distill/reverse_kl_sequence": float(per_sequence[counted].mean()) if counted.any() else 0.0,
            "distill/teacher_seconds": stats.teacher_seconds}


def tool_metrics(stats: RolloutStats) -> dict:
    """tools/*: calls per completion (TRL's call_frequency), the share of completions with a call, failures by
    kind, turns (model segments) and fed result tokens per completion."""
    counts, fed = torch.cat(stats.tool_calls), torch.cat(stats.tool_result_tokens)  # (N_total,) each
    total_calls = float(counts.sum())
    failed = stats.tool_errors + stats.tool_timeouts + stats.tool_malformed
    return {
        "tools/call_frequency": float(counts.mean()),
        "tools/frac_completions_with_call": float((counts > 0).float().mean()),
        "tools/failure_frequency": failed / total_calls if total_calls else 0.0,
        "tools/errors": int(stats.tool_errors),
        "tools/timeouts": int(stats.tool_timeouts),
        "tools/malformed": int(stats.tool_malformed),
        "tools/truncated_outputs": int(stats.tool_truncated),
        "tools/turns_mean": float(counts.mean()) + 1.0,
        "tools/result_tokens_mean": float(fed.mean()),
    }


def warn_if_mostly_flat(metrics: dict) -> bool:
    """Warn (once per run: the caller keeps the flag) when most groups carry no GRPO signal; True if it
    warned."""
    if metrics["frac_reward_zero_std"] <= 0.75:
        return False
    warnings.warn(
        f"{metrics['frac_reward_zero_std']:.0%} of groups have identical rewards, so they carry no "
        "learning signal. Likely causes: the task is too hard or too easy for the model (screen the "
        "prompts: `forge screen`), max_new_tokens cuts answers off, or the reward is too coarse.",
        stacklevel=3)
    return True


TOOL_STEPS_BEFORE_WARNING = 3


def warn_if_tools_unused(steps_without_calls: int, announce: bool = True) -> bool:
    """Warn when the run has tools but no completion of its first TOOL_STEPS_BEFORE_WARNING steps called one;
    True once that many steps went by (the caller then stops counting), whether this process announced it or
    not."""
    if steps_without_calls < TOOL_STEPS_BEFORE_WARNING:
        return False
    if announce:
        warnings.warn(
            f"no completion called a tool in the first {steps_without_calls} steps (tools/call_frequency 0): "
            "the prompts likely do not teach the call format. Show it in the prompt, e.g. a worked example "
            "with one call in the format the run uses (tool_format), and check samples.jsonl; see "
            "docs/tools.md.",
            stacklevel=3)
    return True


def rollout_samples(rows: list[dict], rollout, rewards: torch.Tensor, group_size: int,
                    extra: dict[str, list] | None = None) -> list[dict]:
    """One logged sample per prompt of a rollout: its prompt (last chat message), reference, completion,
    reward, and the columns rewards logged for it (TRL's log_extra: `extra`, column -> (N,) values)."""
    out = []
    for i in range(0, len(rollout.completions), group_size):
        row = rows[i // group_size]
        prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
        sample = {"prompt": prompt, "reference": row.get("reference"), "completion": rollout.completions[i],
                  "reward": float(rewards[i])}
        sample |= {column: values[i] for column, values in (extra or {}).items() if i < len(values)}
        if rollout.tool_calls is not None:  # the calls and the results fed back, in order
            sample["tool_calls"] = [result.as_dict() for result in rollout.tool_calls[i]]
        if rollout.episodes is not None and rollout.episodes[i].failure is not None:
            sample["episode_failure"] = rollout.episodes[i].failure  # it sampled nothing; this is why
        out.append(sample)
    return out


def ordered_samples(every_rank: list[list[dict]], num_rollouts: int, limit: int) -> list[dict]:
    """The first `limit` samples of the step in prompt order, from every rank's share (rank order)."""
    share = len(every_rank[0]) // max(num_rollouts, 1)
    ordered = [sample for r in range(num_rollouts) for rank_samples in every_rank
               for sample in rank_samples[r * share:(r + 1) * share]]
    return ordered[:limit]


def logprob_gap(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                mask: torch.Tensor) -> tuple[float, float]:
    """(mean, max) of |trainer - sampler| log-prob over the masked tokens (n, T) each: ~0 when one computation
    (logged as sampling/sampling_logp_difference, `UpdateTotals.add`)."""
    gap = (logprobs.detach().float() - sampler_logprobs.float()).abs()[mask.bool()]
    return (float(gap.mean()), float(gap.max())) if gap.numel() else (0.0, 0.0)


@torch.no_grad()
def squared_param_delta(parameters: list[torch.Tensor], initial: list[torch.Tensor]) -> float:
    """||theta - theta_0||^2 over these tensors (FSDP2: this rank's shards, which the trainer sums)."""
    return sum(float((p.detach().cpu().float() - p0.float()).pow(2).sum())
               for p, p0 in zip(parameters, initial))


__all__ = [
    "RolloutStats",
    "UpdateTotals",
    "completion_metrics",
    "distill_metrics",
    "env_metrics",
    "logprob_gap",
    "ordered_samples",
    "rollout_samples",
    "squared_param_delta",
    "step_metrics",
    "tool_metrics",
    "warn_if_mostly_flat",
    "warn_if_tools_unused",
]
