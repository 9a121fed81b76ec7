"""Group-relative advantages: how a group's rewards become each completion's advantage A (pure tensor math).

GRPO (DeepSeekMath, Shao et al. 2024, https://arxiv.org/abs/2402.03300, sec. 4.1.2) scores each completion
against the other completions of its prompt: A_i = (r_i - mean(r_group)) / std(r_group). The published
variants change the divisor or the baseline; each is one small function plus one entry in ADVANTAGE_SCALES.
Several rewards combine by MULTI_REWARD_AGGREGATIONS (a weighted sum first, or GDPO's per-reward
normalisation).

This module imports only torch: rewards come in as tensors, advantages go out as tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Each returns the divisor of the centred rewards r - group mean, (N,), from the float64 rewards, the centred
# rewards and the (N,) mask of the samples that enter the statistics; `eps` keeps a std of 0 from dividing.


def _masked_std(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Bessel-corrected std of each group's valid entries, (groups, n) -> (groups,) (the whole batch is one
    group of N); exactly 0 where fewer than two are valid or all valid entries are equal."""
    weight = valid.to(values.dtype)  # (groups, n)
    count = weight.sum(dim=1)  # (groups,)
    mean = (values * weight).sum(dim=1, keepdim=True) / count.clamp(min=1)[:, None]  # (groups, 1)
    var = ((values - mean) ** 2 * weight).sum(dim=1) / (count - 1).clamp(min=1)  # (groups,)
    spread = (count >= 2) & ~_all_equal(values, valid)  # (groups,)
    return torch.where(spread, var.sqrt(), 0.0)


def _all_equal(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(groups, n) -> (groups,): True where every valid entry holds the same value (or none is valid). Exact,
    so a group of 0.7s or 1.1s, which no float type holds exactly, is recognised without rounding."""
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
    # RLOO (Ahmadian et al. 2024, arXiv 2402.14740, sec. 3): r_i - mean_{j != i} r_j = n / (n - 1) * (r_i -
    # mean), n = valid samples of the group; so the divisor is (n - 1) / n (no eps: nothing can be 0 here).
    count = valid.view(-1, group_size).sum(dim=1).to(rewards.dtype)  # (groups,)
    return ((count - 1).clamp(min=1) / count.clamp(min=1)).repeat_interleave(group_size)


def _centred_batch_scale(rewards, centred, valid, group_size: int, eps: float) -> torch.Tensor:
    # REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262, sec. 3): the group mean is the baseline, then
    # the differences are normalised by their std over the batch (their batch mean is already 0). One value
    # per completion; verl whitens per token instead, which weighs long completions more.
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
        raise ValueError(f"valid must have the rewards' shape {tuple(rewards.shape)}, "
                         f"got {tuple(valid.shape)}")
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
    scale_by = ADVANTAGE_SCALES[scale](values, centred, valid, group_size, eps)  # (N,)
    return (centred / scale_by).to(torch.float32)  # (N,)


# Several rewards: each fn(components (N, K), applies (N, K) bool, weights (K,), group_size, scale, eps, valid
# (N,)) -> (N,) advantages. `applies` is False where a reward returned None ("does not apply" to that sample):
# the sample is scored by the rewards that apply, and when none applies it gets advantage 0 and leaves the
# statistics. `valid` is False for samples left out for another reason (a NaN reward).


def weighted_reward_sum(components: torch.Tensor, applies: torch.Tensor,
                        weights: Sequence[float]) -> torch.Tensor:
    """sum_k w_k r_k over the rewards that apply, (N, K) -> (N,) float32, summed reward by reward in float32:
    the one weighted sum, of the advantages and of the `reward` Forge logs (core/scoring.py Scores.total)."""
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
        compute_group_advantages(components[:, k].float(), group_size, "group", eps,
                                 valid=valid & applies[:, k])
        for k in range(components.shape[1])], dim=1)  # (N, K), 0 where reward k does not apply
    summed = (per_reward.double() * torch.tensor(list(weights), dtype=torch.float64)).sum(dim=1)  # (N,)
    scored = valid & applies.any(dim=1)
    return compute_group_advantages(summed, summed.numel(), "group", eps, valid=scored)  # one group: all


MULTI_REWARD_AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "sum_then_normalize": _sum_then_normalize,  # GRPO: one scalar reward per completion, then scale_rewards
    "normalize_then_sum": _normalize_then_sum,  # GDPO: decoupled, a large-scale reward cannot drown others
}


def multi_reward_advantages(
    components: torch.Tensor, applies: torch.Tensor | None, weights: Sequence[float], group_size: int,
    scale: str = "group", eps: float = 1e-4, aggregation: str = "sum_then_normalize",
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages from K rewards per completion. components: (N, K) laid out group by group; applies: (N, K)
    bool (None = every reward applies everywhere); valid: (N,) bool (None = all). Returns (N,) float32."""
    if components.dim() != 2 or components.shape[1] != len(weights):
        raise ValueError(f"components must be (N, K={len(weights)}), got shape {tuple(components.shape)}")
    applies = torch.ones(components.shape, dtype=torch.bool) if applies is None else applies.bool()
    valid = _check_rewards(components[:, 0], group_size, valid)
    return MULTI_REWARD_AGGREGATIONS[aggregation](components, applies, weights, group_size, scale, eps, valid)


def group_reward_std(rewards: torch.Tensor, group_size: int,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group std of the (valid) rewards, (num_groups,) float32; exactly 0 for a group of equal rewards."""
    valid = _check_rewards(rewards, group_size, valid)
    values = torch.where(valid, rewards.double(), 0.0).view(-1, group_size)  # (groups, G)
    return _masked_std(values, valid.view(-1, group_size)).to(torch.float32)
