"""What one optimizer step logs: reward, loss and rollout statistics, and the sample completions.

Pure functions of the step's rollouts and statistics. The only distributed work is the gathers each caller
passes in (`dist`: anything with gather / gather_objects / sum / max, see core/distributed.py), so every rank
computes the same numbers over the whole batch, not over its own share.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from forge.core.grpo import group_reward_std
from forge.core.rollout import Rollout


@dataclass
class RolloutStats:
    """What collecting one optimizer step's rollouts measured on this rank (one entry per rollout batch)."""

    scores: list[torch.Tensor] = field(default_factory=list)  # each (N,) total reward
    valid: list[torch.Tensor] = field(default_factory=list)  # each (N,) bool, False where a reward was NaN/inf
    # or where no reward applied (every one returned None)
    components: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # reward name -> each (N,)
    applies: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # reward name -> each (N,) bool
    errors: int = 0
    timeouts: int = 0
    nonfinite: int = 0
    gen_seconds: float = 0.0
    samples: list[dict] = field(default_factory=list)  # one logged sample per prompt


def step_metrics(rollouts: list[Rollout], stats: RolloutStats, update: dict, *, group_size: int, dist,
                 seconds: float, skipped_steps: int, param_delta_norm: float) -> dict:
    """The logged metrics of one optimizer step, over every rank's share of the batch."""
    rewards = dist.gather(torch.cat(stats.scores))  # (N_total,)
    valid = dist.gather(torch.cat(stats.valid))  # (N_total,)
    group_std = group_reward_std(rewards, group_size, valid)  # (groups,)
    lengths = dist.gather(torch.cat([r.completion_lengths for r in rollouts]).float())  # (N_total,)
    truncated = dist.gather(torch.cat([r.truncated for r in rollouts]).float())  # (N_total,)
    terminated = lengths[truncated == 0]  # (n_eos,) completions that ended with EOS
    errors, timeouts, nonfinite = dist.sum([stats.errors, stats.timeouts, stats.nonfinite])
    gen_seconds = dist.max(stats.gen_seconds)  # the ranks generate side by side
    metrics = {
        "loss": update["loss"],
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        **{key: update[key] for key in ("kl", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean",
                                        "grad_norm", "learning_rate")},
        # added with the algorithm catalogue; .get keeps callers that pass only the keys above working
        **{key: update[key] for key in ("entropy", "clip_frac_capped", "rollout_is_weight_mean",
                                        "sampling/logp_diff_mean", "sampling/logp_diff_max") if key in update},
        "group_reward_std_mean": float(group_std.mean()),
        "frac_zero_std_groups": float((group_std == 0).float().mean()),
        "frac_reward_zero_std": float((group_std == 0).float().mean()),  # TRL's name for frac_zero_std_groups
        "completion_length/mean": float(lengths.mean()),
        "completion_length/min": float(lengths.min()),
        "completion_length/max": float(lengths.max()),
        "completion_length/mean_terminated": float(terminated.mean()) if terminated.numel() else 0.0,
        "frac_truncated": float(truncated.mean()),
        "tokens_per_second": float(lengths.sum()) / max(gen_seconds, 1e-9),
        "step_seconds": seconds,
        "generation_share": gen_seconds / max(seconds, 1e-9),
        "rewards/errors": int(errors),
        "rewards/timeouts": int(timeouts),
        "rewards/nonfinite": int(nonfinite),
        "skipped_steps": skipped_steps,
        "param_delta_norm": param_delta_norm,
    }
    metrics.update(tool_metrics(rollouts, dist))
    for name, parts in stats.components.items():
        values = dist.gather(torch.cat(parts))  # (N_total,)
        if name in stats.applies:  # over the samples the reward applies to (it returned a number)
            values = values[dist.gather(torch.cat(stats.applies[name]))]
        metrics[f"rewards/{name}"] = float(values.mean()) if values.numel() else 0.0
        metrics[f"rewards/{name}/std"] = float(values.std()) if values.numel() > 1 else 0.0
    return metrics


def tool_metrics(rollouts: list[Rollout], dist) -> dict:
    """tools/*: calls per completion (TRL's call_frequency), the share of completions with a call, failures by
    kind, turns (model segments) and fed result tokens per completion; {} for rollouts without tools."""
    if not rollouts or rollouts[0].tool_calls is None:
        return {}
    calls = [c for r in rollouts for c in r.tool_calls]  # (N,) each completion's results
    failures = [x.failure for c in calls for x in c]
    counts = dist.gather(torch.tensor([len(c) for c in calls], dtype=torch.float32))  # (N_total,)
    fed = dist.gather(torch.cat([(r.completion_mask * (1 - r.action_mask)).sum(dim=1) for r in rollouts]).float())
    errors, timeouts, malformed, truncated = dist.sum([
        failures.count("error"), failures.count("timeout"),
        failures.count("malformed") + failures.count("unknown_tool"), sum(x.truncated for c in calls for x in c)])
    total_calls = float(counts.sum())
    return {
        "tools/call_frequency": float(counts.mean()),
        "tools/frac_completions_with_call": float((counts > 0).float().mean()),
        "tools/failure_frequency": (errors + timeouts + malformed) / total_calls if total_calls else 0.0,
        "tools/errors": int(errors),
        "tools/timeouts": int(timeouts),
        "tools/malformed": int(malformed),
        "tools/truncated_outputs": int(truncated),
        "tools/turns_mean": float(counts.mean()) + 1.0,
        "tools/result_tokens_mean": float(fed.mean()),
    }


def warn_if_mostly_flat(metrics: dict) -> bool:
    """Warn (once per run: the caller keeps the flag) when most groups carry no GRPO signal; True if it warned."""
    if metrics["frac_zero_std_groups"] <= 0.75:
        return False
    warnings.warn(
        f"{metrics['frac_zero_std_groups']:.0%} of groups have identical rewards, so they carry no "
        "learning signal. Likely causes: the task is too hard or too easy for the model (screen the "
        "prompts: `forge screen`), max_new_tokens cuts answers off, or the reward is too coarse.",
        stacklevel=3)
    return True


def rollout_samples(rows: list[dict], rollout: Rollout, rewards: torch.Tensor, group_size: int) -> list[dict]:
    """One logged sample per prompt of a rollout: its prompt (last chat message), reference, completion, reward."""
    out = []
    for i in range(0, len(rollout.completions), group_size):
        row = rows[i // group_size]
        prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
        sample = {"prompt": prompt, "reference": row.get("reference"), "completion": rollout.completions[i],
                  "reward": float(rewards[i])}
        if rollout.tool_calls is not None:  # the calls and the results fed back, in order
            sample["tool_calls"] = [result.as_dict() for result in rollout.tool_calls[i]]
        out.append(sample)
    return out


def gathered_samples(samples: list[dict], num_rollouts: int, limit: int, dist) -> list[dict]:
    """The first `limit` samples of the step in prompt order, taken from every rank's share."""
    every_rank = dist.gather_objects(samples)  # each: `share` samples per rollout batch
    share = len(samples) // max(num_rollouts, 1)
    ordered = [sample for r in range(num_rollouts) for rank_samples in every_rank
               for sample in rank_samples[r * share:(r + 1) * share]]
    return ordered[:limit]


class UpdateTotals:
    """The statistics of one update, accumulated over its micro-batches and then over every rank: the loss is
    the sum of the ranks' shares; every other statistic is a token-weighted mean over the whole batch."""

    KEYS = ("kl", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "clip_frac_capped", "entropy",
            "rollout_is_weight_mean")

    def __init__(self):
        self.loss, self.tokens, self.gap_max = 0.0, 0.0, 0.0
        self.weighted = dict.fromkeys((*self.KEYS, "sampling/logp_diff_mean"), 0.0)

    def add(self, loss: torch.Tensor, stats, tokens: float, gap: tuple[float, float] | None = None) -> None:
        """One micro-batch: its loss, LossStats, token count and (mean, max) sampler/trainer log-prob gap."""
        self.loss += float(loss.detach())
        self.tokens += tokens
        for key in self.KEYS:
            self.weighted[key] += float(getattr(stats, key)) * tokens
        gap_mean, gap_max = gap or (0.0, 0.0)
        self.weighted["sampling/logp_diff_mean"] += gap_mean * tokens
        self.gap_max = max(self.gap_max, gap_max)

    def over_every_rank(self, dist, with_rollout_is: bool = True) -> dict:
        loss, tokens, *weighted = dist.sum([self.loss, self.tokens, *self.weighted.values()])
        totals = {"loss": loss, **{k: v / max(tokens, 1.0) for k, v in zip(self.weighted, weighted)},
                  "sampling/logp_diff_max": dist.max(self.gap_max)}
        if not with_rollout_is:
            del totals["rollout_is_weight_mean"]
        return totals


def greedy_reward_evaluator(rewards: list, config, tools=None):
    """The trainer's default evaluator: one greedy completion per held-out row, scored by the run's own rewards
    (eval/reward, eval/rewards/<name>, eval/n), with the run's tools when it has them (`tools`: ToolSettings).
    The global RNG state is restored afterwards, so evaluating mid-run does not change later samples."""
    from forge.core.rollout import SamplingSettings, generate
    from forge.core.scoring import score_completions
    from forge.core.tool_rollout import generate_with_tools
    from forge.data.dataset import reward_kwargs
    from forge.run import checkpoint as ckpt

    @torch.no_grad()
    def evaluate(model, tokenizer, rows: list[dict], *, max_new_tokens: int, max_prompt_length: int) -> dict:
        rng_state, was_training = ckpt.capture_rng_state(), model.training
        model.eval()
        settings, prompts = SamplingSettings(max_new_tokens, do_sample=False), [row["prompt"] for row in rows]
        completions, calls = [], []
        for start in range(0, len(rows), 32):
            chunk = prompts[start:start + 32]
            if tools is None:
                rollout = generate(model, tokenizer, chunk, 1, settings, max_prompt_length, config.truncate_prompts,
                                   config.share_prompt_prefix)
            else:
                rollout = generate_with_tools(model, tokenizer, chunk, 1, settings, tools, max_prompt_length,
                                              config.truncate_prompts, config.share_prompt_prefix)
                calls += [[result.as_dict() for result in row] for row in rollout.tool_calls]
            completions += rollout.completions
        kwargs = reward_kwargs(rows) | ({"tool_calls": calls} if tools is not None else {})
        scores = score_completions(rewards, prompts, completions, kwargs,
                                   on_error=config.on_reward_error, error_value=config.reward_error_value,
                                   timeout=config.reward_timeout)
        ckpt.restore_rng_state(rng_state)
        model.train(was_training)
        kept = scores.valid
        if not kept.any():
            return {"reward": float("nan"), "n": len(rows)}
        return {"reward": float(scores.total[kept].mean()), "n": len(rows),
                **{f"rewards/{name}": float(v[kept].mean()) for name, v in scores.components.items()}}

    return evaluate


@torch.no_grad()
def param_delta_norm(parameters: list[torch.Tensor], initial: list[torch.Tensor],
                     total=lambda values: values) -> float:
    """||theta - theta_0||: how far training has moved the trainable weights. Under FSDP2 `parameters` and
    `initial` are this rank's shards and `total` sums the squares over the ranks (DataParallel.sum_shards)."""
    squares = sum(float((p.detach().cpu().float() - p0.float()).pow(2).sum()) for p, p0 in zip(parameters, initial))
    return math.sqrt(total([squares])[0])


__all__ = [
    "RolloutStats",
    "UpdateTotals",
    "gathered_samples",
    "greedy_reward_evaluator",
    "param_delta_norm",
    "rollout_samples",
    "step_metrics",
    "tool_metrics",
    "warn_if_mostly_flat",
]
