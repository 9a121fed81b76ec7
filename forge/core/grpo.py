"""GRPO as pure tensor math: the group-relative advantages, then the loss (per-token ratio, clipped objective,
KL penalty, aggregation), each with its published variants.

Forge implements GRPO as DeepSeekMath defines it (Shao et al. 2024, https://arxiv.org/abs/2402.03300,
sec. 4.1.2 and eq. 3): each completion is scored against the other completions of its prompt, and the policy
moves by a per-token ratio against the policy that sampled, clipped, plus a KL penalty against the reference:

    A         = (r - mean(r_group)) / std(r_group)             one advantage per completion
    ratio_t   = exp(logp_theta(o_t) - logp_old(o_t))          per token, against the sampling policy
    pg_t      = max(-A * ratio_t, -A * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    kl_t      = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     k3 estimator, >= 0
    loss      = aggregate(pg_t + beta * kl_t)

The published variants change one piece of this, each one small function plus one entry in a table below;
adding a variant touches no other code:

    ADVANTAGE_SCALES           group / batch / none / rloo / reinforce_plus_plus_baseline
    MULTI_REWARD_AGGREGATIONS  sum_then_normalize / normalize_then_sum (GDPO); None rewards do not apply
    IMPORTANCE_LEVELS          token / sequence (GSPO)
    POLICY_OBJECTIVES          clip (+ dual-clip / two-sided cap) / cispo / sapo
    LOSS_AGGREGATIONS          per-sequence mean / token mean / constant (Dr. GRPO); LOSS_TYPES pairs them
    KL_ESTIMATORS              k1 / k2 / k3

This file holds plain GRPO, the variants that reuse its pieces and the tables; the loss variants whose math
stands alone (CISPO, SAPO, the other aggregations and KL estimators) and what reshapes the policy term (the
off-policy sequence mask, the high-entropy tokens, the sampler's importance weights: ROLLOUT_IS_MODES) or adds
to the loss (the entropy bonus) are core/loss_variants.py's. In each half, `compute_group_advantages` and
`grpo_loss` come first and read as plain GRPO; grpo_loss takes the variant as one LossSettings
(LossSettings.from_config derives it from a run's config) and looks each piece up in the tables after it.

This module imports only torch, the standard library and core/loss_variants.py (pure tensor math too):
everything comes in as tensors and numbers, so every formula is tested with hand-built tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch

from forge.core.loss_variants import (
    PolicyTerm,
    adapted_entropy_coef,
    applied_entropy_coef,
    cispo_objective,
    constant_normaliser,
    entropy_bonus,
    k1_kl,
    k2_kl,
    reshaped_policy_term,
    sapo_objective,
    token_mean,
)

# ----------------------------------------------------------------------------------------------------
# Advantages: how a group's rewards become each completion's advantage A (DeepSeekMath sec. 4.1.2). The
# published variants change the divisor or the baseline, each one small function plus one entry in
# ADVANTAGE_SCALES; several rewards combine by MULTI_REWARD_AGGREGATIONS (a weighted sum first, or GDPO's
# per-reward normalisation).

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


# ----------------------------------------------------------------------------------------------------
# The loss: plain GRPO first; each variant is one entry in a table further down


@dataclass(frozen=True)
class LossSettings:
    """The loss variant in GRPOConfig's names: all grpo_loss needs besides tensors (`from_config`)."""

    clip_epsilon: float = 0.2
    clip_epsilon_high: float | None = None  # None = clip_epsilon
    kl_beta: float = 0.0
    loss_type: str = "grpo"  # key of LOSS_TYPES
    importance_sampling_level: str = "token"  # key of IMPORTANCE_LEVELS
    kl_loss_type: str = "k3"  # key of KL_ESTIMATORS
    negative_ratio_cap: float | None = None  # delta / clip_ratio_c (the smaller when both are set)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    rollout_is: str = "none"  # key of ROLLOUT_IS_MODES
    rollout_is_threshold: float = 3.0
    kl_bias_correction: bool = False  # the KL term weighted by the importance ratio (DeepSeek-V3.2)
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's off-policy sequence mask; None = off

    @classmethod
    def from_config(cls, config, entropy_coef: float | None = None) -> LossSettings:
        """The loss variant a run's GRPOConfig describes: its fields of the same names, and delta and
        clip_ratio_c as one cap (the smaller of those set); `entropy_coef`, where given, the coefficient the
        step applies (adaptive entropy control) instead of the config's."""
        caps = [c for c in (config.delta, config.clip_ratio_c) if c is not None]
        named = {f.name: getattr(config, f.name) for f in fields(cls) if f.name != "negative_ratio_cap"}
        if entropy_coef is not None:
            named["entropy_coef"] = entropy_coef
        return cls(**named, negative_ratio_cap=min(caps) if caps else None)

    @property
    def epsilon_high(self) -> float:
        """The upper clip range: clip_epsilon_high, or clip_epsilon when it is None."""
        return self.clip_epsilon if self.clip_epsilon_high is None else self.clip_epsilon_high

    @property
    def needs_entropy(self) -> bool:  # the token entropies, for the high-entropy mask or the bonus
        return self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0

    @property
    def reshapes_policy_term(self) -> bool:
        """Whether a variant masks or weighs the per-token policy term (plain GRPO does not)."""
        return (self.off_policy_mask_threshold is not None or self.top_entropy_quantile < 1.0
                or self.rollout_is != "none")


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
    rollout_is_weight_mean: torch.Tensor | None = None  # mean pi_old / pi_sampler weight; 1 when off
    # the smallest clip_frac_low of one completion (with tokens)
    clip_frac_low_min: torch.Tensor | None = None
    clip_frac_high_max: torch.Tensor | None = None  # the largest clip_frac_high of one completion


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    settings: LossSettings = LossSettings(),
    normaliser: LossNormaliser | None = None,
    entropy: torch.Tensor | None = None,
    sampler_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO objective (or a variant of it) for a batch of completions.

    logprobs:         (B, T) log pi_theta of each completion token (with grad)
    old_logprobs:     (B, T) log pi_old, the policy that sampled; None = logprobs.detach() (one update per
                      rollout: the ratio is 1, the loss value ~0, and its gradient is the policy gradient)
    ref_logprobs:     (B, T) log pi_ref, or None when kl_beta == 0
    advantages:       (B,)   group-relative advantage of each completion, or (B, >=T) one per token
    completion_mask:  (B, T) 1 on completion tokens up to and including EOS, 0 on padding
    settings:         the variant (LossSettings; the default is GRPO with clip 0.2 and no KL term)
    entropy:          (B, T) token entropies, needed for top_entropy_quantile < 1 and entropy_coef != 0 (with
                      grad for the bonus), logged otherwise
    sampler_logprobs: (B, T) log-probs recorded while sampling, needed for rollout_is != 'none'
    """
    mask = completion_mask.to(logprobs.dtype)  # (B, T)
    old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs
    if normaliser is None:  # this batch is the whole optimizer batch
        normaliser = LossNormaliser(float(mask.shape[0]), float(mask.sum()), int(mask.shape[1]))
    if settings.needs_entropy and entropy is None:
        raise ValueError("top_entropy_quantile < 1 and entropy_coef != 0 need the token entropies (entropy=)")
    objective, aggregation = LOSS_TYPES[settings.loss_type]  # plain GRPO: "clip", "grpo"

    # 1. the ratio against the policy that sampled, and the clipped policy term (DeepSeekMath eq. 3)
    log_ratio = IMPORTANCE_LEVELS[settings.importance_sampling_level](logprobs, old_logprobs, mask)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    per_row = advantages if advantages.dim() == 2 else advantages[:, None]  # (B, T') per token, or (B, 1)
    adv = per_row[:, :logprobs.shape[1]].to(logprobs.dtype)
    term = POLICY_OBJECTIVES[objective](ratio, logprobs, adv, settings)
    pg_loss, acting, is_weight = term.pg_loss, mask, None  # (B, T), (B, T): the tokens the gradient acts on
    if settings.reshapes_policy_term:
        pg_loss, acting, is_weight = reshaped_policy_term(pg_loss, adv, logprobs, old_logprobs, mask,
                                                          settings, entropy, sampler_logprobs)
    # 2. the KL penalty against the reference (k3 by default), per token
    kl = kl_term(logprobs, ref_logprobs, ratio, settings)  # (B, T)
    per_token = pg_loss + settings.kl_beta * kl if settings.kl_beta > 0 else pg_loss  # (B, T)
    # 3. aggregated over tokens and completions (per-completion mean for GRPO)
    aggregate = LOSS_AGGREGATIONS[aggregation]
    loss = aggregate(per_token, mask, normaliser)
    if settings.entropy_coef != 0.0:
        loss = loss - settings.entropy_coef * entropy_bonus(entropy, mask, acting, normaliser, settings)
    return loss, loss_stats(term, ratio, kl, pg_loss, aggregate, mask, normaliser, entropy, is_weight)


def kl_term(logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, ratio: torch.Tensor,
            settings: LossSettings) -> torch.Tensor:
    """(B, T) per-token KL estimate against the reference (zeros without one; kl_beta > 0 needs one)."""
    estimate_kl = KL_ESTIMATORS[settings.kl_loss_type]
    if settings.kl_beta <= 0:  # logged only
        return torch.zeros_like(logprobs) if ref_logprobs is None else estimate_kl(logprobs, ref_logprobs)
    if ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs")
    kl = estimate_kl(logprobs, ref_logprobs)  # (B, T)
    if settings.kl_bias_correction:  # DeepSeek-V3.2: the unbiased reverse-KL gradient off-policy
        kl = kl * ratio
    return kl


def loss_stats(term: PolicyTerm, ratio: torch.Tensor, kl: torch.Tensor, pg_loss: torch.Tensor, aggregate,
               mask: torch.Tensor, normaliser: LossNormaliser, entropy: torch.Tensor | None,
               is_weight: torch.Tensor | None) -> LossStats:
    """The loss's statistics (detached): token means over the completion mask."""
    with torch.no_grad():
        low, high = term.clipped_low.to(mask.dtype), term.clipped_high.to(mask.dtype)
        low, high = (torch.broadcast_to(t, mask.shape) for t in (low, high))  # (B, T): sequence-level too
        counted = mask.sum(dim=-1) > 0  # (B,) completions with loss tokens
        nothing = torch.zeros((), device=mask.device)
        return LossStats(
            policy_loss=aggregate(pg_loss.detach(), mask, normaliser),
            kl=masked_mean(kl.detach(), mask),
            ratio_mean=masked_mean(ratio.detach(), mask),
            clip_frac_low=masked_mean(low, mask),
            clip_frac_high=masked_mean(high, mask),
            clip_frac=masked_mean(torch.clamp(low + high, max=1), mask),
            clip_frac_capped=masked_mean(term.capped.to(mask.dtype), mask),
            entropy=masked_mean(entropy.detach().float(), mask) if entropy is not None else nothing,
            rollout_is_weight_mean=nothing.add(1.0) if is_weight is None else masked_mean(is_weight, mask),
            clip_frac_low_min=masked_mean(low, mask, dim=-1)[counted].min() if counted.any() else nothing,
            clip_frac_high_max=masked_mean(high, mask, dim=-1)[counted].max() if counted.any() else nothing,
        )


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# ----------------------------------------------------------------------------------------------------
# KL


# Each estimates KL(pi_theta || pi_ref) per sampled token (tokens drawn from the policy, d = logp - ref), from
# http://joschu.net/blog/kl-approx.html: k1 = d is unbiased but goes negative and has high variance;
# k2 = d^2 / 2 is biased, >= 0, its gradient that of the reverse KL in expectation; k3 is unbiased, >= 0.
# k1 and k2 are core/loss_variants.py's.


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


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071, eq. 7): one length-normalised ratio per
    completion, exp(mean_t(logp - logp_old)), shared by all of its tokens."""
    per_sequence = masked_mean(logprobs - old_logprobs, mask, dim=1)  # (B,)
    return per_sequence[:, None].expand_as(logprobs)


IMPORTANCE_LEVELS = {"token": token_log_ratio, "sequence": sequence_log_ratio}


# ----------------------------------------------------------------------------------------------------
# Policy objectives: each fn(ratio (B, T), logprobs (B, T), adv (B, 1), settings) -> PolicyTerm (core/
# loss_variants.py), whose pg_loss is the per-token loss to minimise and whose flags say which tokens a bound
# held back (clip statistics). CISPO's and SAPO's are core/loss_variants.py's.


def _clipped_objective(ratio, logprobs, adv, settings: LossSettings) -> PolicyTerm:
    # PPO / GRPO (DeepSeekMath eq. 3): max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    low, high = settings.clip_epsilon, settings.epsilon_high
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


POLICY_OBJECTIVES: dict[str, Callable[..., PolicyTerm]] = {
    "clip": _clipped_objective,
    "cispo": cispo_objective,
    "sapo": sapo_objective,
}


# ----------------------------------------------------------------------------------------------------
# Aggregations: per-token loss (B, T) -> scalar. `num_sequences` / `num_tokens` are the counts over the
# whole optimizer batch (all micro-batches, all ranks), so summing micro-batch losses gives the same
# value as one big batch. The token mean and the constant normaliser are core/loss_variants.py's.


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

    @staticmethod
    def counts(loss_masks: list[torch.Tensor]) -> list[float]:
        """[completions with a loss token, loss tokens, completions sampled] of loss masks, each (N, T)."""
        return [sum(float((m.sum(dim=1) > 0).sum()) for m in loss_masks),
                sum(float(m.sum()) for m in loss_masks),
                sum(float(m.shape[0]) for m in loss_masks)]

    @classmethod
    def of(cls, counts: list[float], max_completion_length: int) -> LossNormaliser:
        """The normaliser of `counts` (LossNormaliser.counts, summed over the processes by the trainer)."""
        sequences, tokens, sampled = counts
        return cls(max(sequences, 1.0), max(tokens, 1.0), max_completion_length, sampled)

    @classmethod
    def count(cls, loss_masks: list[torch.Tensor], max_completion_length: int) -> LossNormaliser:
        """The normaliser of one process's loss masks, each (N, T)."""
        return cls.of(cls.counts(loss_masks), max_completion_length)


def _sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormaliser) -> torch.Tensor:
    # DeepSeekMath eq. 3: 1/G sum_i 1/|o_i| sum_t
    lengths = mask.sum(dim=1).clamp(min=1)
    return ((per_token * mask).sum(dim=1) / lengths).sum() / norm.num_sequences


LOSS_AGGREGATIONS = {
    "grpo": _sequence_mean,
    "bnpo": token_mean,
    "dapo": token_mean,
    "dr_grpo": constant_normaliser,
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
# The entropy coefficient of a run: fixed, or adapted after each step (loss_variants.adapted_entropy_coef)


@dataclass(frozen=True)
class EntropyControl:
    """A run's entropy coefficient: fixed (adaptive=False: coef throughout), or adapted after every optimizer
    step to hold `target` (GRPOConfig.entropy_control derives it; checkpoints keep coef and last_entropy)."""

    coef: float = 0.0  # the controller's coefficient (entropy_coef to start with)
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    low: float = 0.0
    high: float = 1.0
    last_entropy: float | None = None  # mean token entropy of the last optimizer step; None before the first

    @property
    def applied(self) -> float:
        """The coefficient the next step's loss uses."""
        return applied_entropy_coef(self.coef, self.last_entropy, self.target) if self.adaptive else self.coef

    def observed(self, entropy: float | None) -> EntropyControl:
        """The control after an optimizer step whose mean token entropy (over every process) was `entropy`; a
        step without a finite entropy (skipped, or no completion token) leaves it as it was."""
        if not self.adaptive or entropy is None or not math.isfinite(entropy):
            return self
        return replace(self, coef=adapted_entropy_coef(self.coef, entropy, self.target, self.delta, self.low,
                                                       self.high), last_entropy=entropy)


__all__ = [
    "ADVANTAGE_SCALES",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LOSS_TYPES",
    "MULTI_REWARD_AGGREGATIONS",
    "POLICY_OBJECTIVES",
    "EntropyControl",
    "LossNormaliser",
    "LossSettings",
    "LossStats",
    "LossType",
    "compute_group_advantages",
    "group_reward_std",
    "grpo_loss",
    "k3_kl",
    "masked_mean",
    "multi_reward_advantages",
    "weighted_reward_sum",
]
