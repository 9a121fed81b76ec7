"""The pure-tensor GRPO loss: per-token log-probs, KL, and the clipped objective with its variants.

Forge implements GRPO as DeepSeekMath defines it (Shao et al. 2024, https://arxiv.org/abs/2402.03300,
eq. 3): a per-token ratio against the policy that sampled, clipped, plus a KL penalty against the reference:

    ratio_t   = exp(logp_theta(o_t) - logp_old(o_t))          per token, against the sampling policy
    pg_t      = max(-A * ratio_t, -A * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    kl_t      = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     k3 estimator, >= 0
    loss      = aggregate(pg_t + beta * kl_t)

`A` is the group-relative advantage of the completion (core/advantages.py). The published variants change one
piece of this, each one small function plus one entry in a dict below; adding a variant touches no other code:

    ADVANTAGE_SCALES           group / batch / none / rloo / reinforce_plus_plus_baseline
    MULTI_REWARD_AGGREGATIONS  sum_then_normalize / normalize_then_sum (GDPO); None rewards do not apply
    IMPORTANCE_LEVELS          token / sequence (GSPO)
    POLICY_OBJECTIVES          clip (+ dual-clip / two-sided cap) / cispo / sapo
    LOSS_AGGREGATIONS          per-sequence mean / token mean / constant (Dr. GRPO); LOSS_TYPES pairs them
    KL_ESTIMATORS              k1 / k2 / k3
    ROLLOUT_IS_MODES           none / token or sequence, truncated or masked sampler importance weights

plus the token entropy (from the same chunked log-softmax as the log-probs), its top-quantile mask and bonus.
grpo_loss comes first and reads as plain GRPO; it takes the variant as one LossSettings
(LossSettings.from_config derives it from a run's config) and looks each piece up in the tables after it.

This module imports only torch, the standard library and core/advantages.py (pure tensor math too): everything
comes in as tensors and numbers, so every formula is tested with hand-built tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch

# re-exported: the original API had them here
from forge.core.advantages import (
    ADVANTAGE_SCALES,
    MULTI_REWARD_AGGREGATIONS,
    compute_group_advantages,
    group_reward_std,
    multi_reward_advantages,
    weighted_reward_sum,
)

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
# Variants that multiply the policy term: off-policy sequence mask, high-entropy tokens, sampler IS weights


def reshaped_policy_term(pg_loss: torch.Tensor, adv: torch.Tensor, logprobs: torch.Tensor,
                         old_logprobs: torch.Tensor, mask: torch.Tensor, settings: LossSettings,
                         entropy: torch.Tensor | None, sampler_logprobs: torch.Tensor | None):
    """(pg_loss (B, T), acting (B, T): the tokens the policy gradient and the entropy bonus act on, is_weight
    (B, T) or None) after the variants that mask or weigh the policy term."""
    acting, is_weight = mask, None
    if settings.off_policy_mask_threshold is not None:
        sampled = old_logprobs if sampler_logprobs is None else sampler_logprobs
        pg_loss = pg_loss * off_policy_sequence_mask(adv, logprobs, sampled, mask,
                                                     settings.off_policy_mask_threshold)
    if settings.top_entropy_quantile < 1.0:
        acting = mask * high_entropy_mask(entropy, mask, settings.top_entropy_quantile).to(mask.dtype)
        pg_loss = pg_loss * (acting > 0).to(pg_loss.dtype)
    if settings.rollout_is != "none":
        if sampler_logprobs is None:
            raise ValueError(f"rollout_is={settings.rollout_is!r} needs the sampler's log-probs "
                             f"(sampler_logprobs=...)")
        is_weight = rollout_importance_weights(old_logprobs, sampler_logprobs, mask, settings.rollout_is,
                                               settings.rollout_is_threshold)  # (B, T)
        pg_loss = pg_loss * is_weight
    return pg_loss, acting, is_weight


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, acting: torch.Tensor, normaliser: LossNormaliser,
                  settings: LossSettings) -> torch.Tensor:
    """The mean entropy of the tokens the policy gradient acts on (all completion tokens; with
    top_entropy_quantile < 1 the high-entropy ones, as TRL does), whatever the aggregation, so entropy_coef
    means the same for every loss_type. Each micro-batch's mean is weighted by its share of the optimizer
    batch's tokens, so the shares sum to the batch's (exactly the token mean when every token acts)."""
    if settings.top_entropy_quantile < 1.0:
        share = float(mask.sum()) / max(normaliser.num_tokens, 1.0)
        return (entropy * acting).sum() / acting.sum().clamp(min=1) * share
    return (entropy * mask).sum() / max(normaliser.num_tokens, 1.0)


# ----------------------------------------------------------------------------------------------------
# KL


# Each estimates KL(pi_theta || pi_ref) per sampled token (tokens drawn from the policy, d = logp - ref), from
# http://joschu.net/blog/kl-approx.html: k1 = d is unbiased but goes negative and has high variance;
# k2 = d^2 / 2 is biased, >= 0, its gradient that of the reverse KL in expectation; k3 is unbiased, >= 0.


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


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071, eq. 7): one length-normalised ratio per
    completion, exp(mean_t(logp - logp_old)), shared by all of its tokens."""
    per_sequence = masked_mean(logprobs - old_logprobs, mask, dim=1)  # (B,)
    return per_sequence[:, None].expand_as(logprobs)


IMPORTANCE_LEVELS = {"token": token_log_ratio, "sequence": sequence_log_ratio}


# ----------------------------------------------------------------------------------------------------
# Policy objectives: each fn(ratio (B, T), logprobs (B, T), adv (B, 1), settings) -> PolicyTerm, whose pg_loss
# is the per-token loss to minimise and whose flags say which tokens a bound held back (clip statistics).


class PolicyTerm(NamedTuple):
    pg_loss: torch.Tensor  # (B, T)
    clipped_low: torch.Tensor  # (B, T) bool: A < 0 and the lower clip bound holds the ratio
    clipped_high: torch.Tensor  # (B, T) bool: the upper bound holds the ratio (A > 0; cispo: any A)
    capped: torch.Tensor  # (B, T) bool: A < 0 and the ratio is over delta / clip_ratio_c


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


def _cispo_objective(ratio, logprobs, adv, settings: LossSettings) -> PolicyTerm:
    # CISPO (MiniMax-M1, arXiv 2506.13585, the J_CISPO objective of sec. 3.1): -sg(min(r, 1 + eps_high)) * A *
    # log pi_theta. The weight is clipped, never the token: every token keeps its gradient -w A grad log pi.
    # No lower bound, as in the paper.
    cap = 1 + settings.epsilon_high
    weight = torch.clamp(ratio, max=cap).detach()  # (B, T)
    over = ratio > cap
    return PolicyTerm(-weight * adv * logprobs, torch.zeros_like(over), over, torch.zeros_like(over))


def _sapo_objective(ratio, logprobs, adv, settings: LossSettings) -> PolicyTerm:
    # SAPO (Gao et al. 2025, arXiv 2511.20347, the soft gate of sec. 3): -f(r) A with the gate f(r) =
    # sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos for A > 0, tau_neg otherwise. f'(1) = 1, so on-policy it
    # is the policy gradient; far off-policy the gradient fades smoothly instead of stopping at a hard bound.
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
# the token or sequence instead). Sequence level: one weight a completion, w = exp(sum_t (old_t - sampler_t)).


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
    "sequence_truncate":
        lambda old, sampler, mask, c: _truncated(_sequence_log_weight(old, sampler, mask), c),
    "sequence_mask": lambda old, sampler, mask, c: _masked(_sequence_log_weight(old, sampler, mask), c),
}


def rollout_importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                               mode: str, threshold: float) -> torch.Tensor | None:
    """(B, T) detached weights pi_old / pi_sampler under `mode` (None for 'none'); old and sampler: (B, T)."""
    weigh = ROLLOUT_IS_MODES[mode]
    if weigh is None:
        return None
    return weigh(old_logprobs.detach().float(), sampler_logprobs.float(), mask.float(), threshold).detach()


def logprob_gap(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                mask: torch.Tensor) -> tuple[float, float]:
    """(mean, max) of |trainer - sampler| log-prob over the masked tokens: ~0 when one computation."""
    gap = (logprobs.detach().float() - sampler_logprobs.float()).abs()[mask.bool()]
    return (float(gap.mean()), float(gap.max())) if gap.numel() else (0.0, 0.0)


# ----------------------------------------------------------------------------------------------------
# DeepSeek-V3.2's off-policy sequence mask


def off_policy_sequence_mask(adv: torch.Tensor, logprobs: torch.Tensor, sampled_logprobs: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B, 1) 1.0 = keep, 0.0 = drop the sequence's policy term: DeepSeek-V3.2's off-policy sequence mask
    (https://arxiv.org/abs/2512.02556; TRL's off_policy_mask_threshold). A completion with negative advantage
    (adv, (B, 1)) is dropped when its mean per-token gap log pi_sampled - log pi_theta over the completion
    mask exceeds `threshold`: a bad sample the current policy has already moved away from teaches little."""
    gap = (sampled_logprobs.float() - logprobs.detach().float()) * mask  # (B, T)
    mean_gap = gap.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    return ((adv >= 0) | (mean_gap <= threshold)).to(logprobs.dtype)


# ----------------------------------------------------------------------------------------------------
# Entropy


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """(B, T) bool: the completion tokens whose entropy is in the top `quantile` fraction of this batch's
    tokens (Wang et al. 2025, "Beyond the 80/20 rule", arXiv 2506.01939: entropy >= the (1 - q) quantile)."""
    keep = mask.bool()
    values = entropy.detach().float()[keep]
    if values.numel() == 0:
        return keep
    threshold = torch.quantile(values, 1 - quantile)
    return keep & (entropy.detach() >= threshold)


def adapted_entropy_coef(coef: float, entropy: float, target: float, delta: float, low: float,
                         high: float) -> float:
    """Adaptive entropy control (Skywork-OR1, He et al. 2025, arXiv 2505.22312), the coefficient for the next
    optimizer step: up by delta while the step's mean token entropy is at or below the target, down by delta
    above it, held within [low, high]."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


def applied_entropy_coef(coef: float, last_entropy: float | None, target: float) -> float:
    """The entropy coefficient a step's loss uses under adaptive control: the bonus acts only while the
    previous step's entropy was at or below the target (0 before the first step: no entropy known yet)."""
    return coef if last_entropy is not None and last_entropy <= target else 0.0


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
    "ROLLOUT_IS_MODES",
    "EntropyControl",
    "LossNormaliser",
    "LossSettings",
    "LossStats",
    "LossType",
    "PolicyTerm",
    "adapted_entropy_coef",
    "applied_entropy_coef",
    "compute_group_advantages",
    "group_reward_std",
    "grpo_loss",
    "high_entropy_mask",
    "k1_kl",
    "k2_kl",
    "k3_kl",
    "logprob_gap",
    "masked_mean",
    "multi_reward_advantages",
    "off_policy_sequence_mask",
    "rollout_importance_weights",
    "weighted_reward_sum",
]
