"""The loss variants beside plain GRPO whose math stands on its own: core/grpo.py holds plain GRPO and the
tables that name a variant (KL_ESTIMATORS, POLICY_OBJECTIVES, LOSS_AGGREGATIONS), and these are the entries it
imports, with what the variants add to grpo_loss's plain terms. Plain GRPO runs none of them: grpo_loss calls
`reshaped_policy_term` only when a variant masks or weighs the policy term
(`LossSettings.reshapes_policy_term`), and `entropy_bonus` only with entropy_coef != 0.

    k1_kl, k2_kl               the other KL estimators
    cispo_objective            CISPO (MiniMax-M1): the clipped ratio as a stopped weight on log pi
    sapo_objective             SAPO: a soft gate instead of a hard clip
    token_mean                 DAPO's token mean (loss_type bnpo / dapo / cispo)
    constant_normaliser        Dr. GRPO's constant denominator
    off_policy_sequence_mask   DeepSeek-V3.2: drop a negative-advantage completion the policy moved away from
    high_entropy_mask          the tokens of top-quantile entropy (Wang et al. 2025), where the gradient acts
    ROLLOUT_IS_MODES           none / token or sequence, truncated or masked sampler importance weights
    entropy_bonus              the mean entropy of the tokens the gradient acts on
    adapted_entropy_coef       Skywork-OR1's adaptive entropy coefficient (core/grpo.py EntropyControl)

The variants that reuse plain GRPO's own pieces stay beside them in core/grpo.py: the advantage scales and
GDPO (the group statistics), GSPO's sequence-level ratio (`masked_mean`).

This module imports only torch and the standard library: everything comes in as tensors and numbers (a
LossSettings and a LossNormaliser of core/grpo.py are read by their fields).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

# ----------------------------------------------------------------------------------------------------
# KL estimators besides GRPO's k3 (core/grpo.py KL_ESTIMATORS, where the three are compared)


def k1_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi_theta || pi_ref): logp - ref (can be negative)."""
    return logprobs - ref_logprobs


def k2_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k2 estimate of KL(pi_theta || pi_ref): (logp - ref)^2 / 2, always >= 0."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


# ----------------------------------------------------------------------------------------------------
# Policy objectives besides GRPO's clip (core/grpo.py POLICY_OBJECTIVES): each fn(ratio (B, T), logprobs
# (B, T), adv (B, 1), settings) -> PolicyTerm, whose pg_loss is the per-token loss to minimise and whose flags
# say which tokens a bound held back (clip statistics).


class PolicyTerm(NamedTuple):
    pg_loss: torch.Tensor  # (B, T)
    clipped_low: torch.Tensor  # (B, T) bool: A < 0 and the lower clip bound holds the ratio
    clipped_high: torch.Tensor  # (B, T) bool: the upper bound holds the ratio (A > 0; cispo: any A)
    capped: torch.Tensor  # (B, T) bool: A < 0 and the ratio is over delta / clip_ratio_c


def cispo_objective(ratio, logprobs, adv, settings) -> PolicyTerm:
    # CISPO (MiniMax-M1, arXiv 2506.13585, the J_CISPO objective of sec. 3.1): -sg(min(r, 1 + eps_high)) * A *
    # log pi_theta. The weight is clipped, never the token: every token keeps its gradient -w A grad log pi.
    # No lower bound, as in the paper.
    cap = 1 + settings.epsilon_high
    weight = torch.clamp(ratio, max=cap).detach()  # (B, T)
    over = ratio > cap
    return PolicyTerm(-weight * adv * logprobs, torch.zeros_like(over), over, torch.zeros_like(over))


def sapo_objective(ratio, logprobs, adv, settings) -> PolicyTerm:
    # SAPO (Gao et al. 2025, arXiv 2511.20347, the soft gate of sec. 3): -f(r) A with the gate f(r) =
    # sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos for A > 0, tau_neg otherwise. f'(1) = 1, so on-policy it
    # is the policy gradient; far off-policy the gradient fades smoothly instead of stopping at a hard bound.
    tau = torch.where(adv > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)  # (B, 1)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau  # (B, T)
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyTerm(-gate * adv, none, none, none)


# ----------------------------------------------------------------------------------------------------
# Aggregations besides GRPO's per-sequence mean (LOSS_AGGREGATIONS): per-token loss (B, T) -> scalar, over the
# counts of the whole optimizer batch (a LossNormaliser)


def token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm) -> torch.Tensor:
    # DAPO (Yu et al. 2025, https://arxiv.org/abs/2503.14476, eq. 8): every token weighs the same
    return (per_token * mask).sum() / max(norm.num_tokens, 1.0)


def constant_normaliser(per_token: torch.Tensor, mask: torch.Tensor, norm) -> torch.Tensor:
    # Dr. GRPO (Liu et al. 2025, https://arxiv.org/abs/2503.20783): no length bias, constant denominator
    sampled = norm.num_sequences if norm.num_sampled is None else norm.num_sampled
    return (per_token * mask).sum() / (sampled * norm.max_completion_length)


# ----------------------------------------------------------------------------------------------------
# Variants that multiply the policy term: off-policy sequence mask, high-entropy tokens, sampler IS weights


def reshaped_policy_term(pg_loss: torch.Tensor, adv: torch.Tensor, logprobs: torch.Tensor,
                         old_logprobs: torch.Tensor, mask: torch.Tensor, settings,
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


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, acting: torch.Tensor, normaliser,
                  settings) -> torch.Tensor:
    """The mean entropy of the tokens the policy gradient acts on (all completion tokens; with
    top_entropy_quantile < 1 the high-entropy ones, as TRL does), whatever the aggregation, so entropy_coef
    means the same for every loss_type. Each micro-batch's mean is weighted by its share of the optimizer
    batch's tokens, so the shares sum to the batch's (exactly the token mean when every token acts)."""
    if settings.top_entropy_quantile < 1.0:
        share = float(mask.sum()) / max(normaliser.num_tokens, 1.0)
        return (entropy * acting).sum() / acting.sum().clamp(min=1) * share
    return (entropy * mask).sum() / max(normaliser.num_tokens, 1.0)


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


__all__ = [
    "ROLLOUT_IS_MODES",
    "PolicyTerm",
    "adapted_entropy_coef",
    "applied_entropy_coef",
    "cispo_objective",
    "constant_normaliser",
    "entropy_bonus",
    "high_entropy_mask",
    "k1_kl",
    "k2_kl",
    "off_policy_sequence_mask",
    "reshaped_policy_term",
    "rollout_importance_weights",
    "sapo_objective",
    "token_mean",
]
