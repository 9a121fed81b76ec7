"""On-policy distillation as per-token advantages: pure tensor math, imports only torch.

The student samples its own completions; a teacher scores the sampled tokens. The per-token reverse KL

    reverse_kl_t = log p_student(y_t | y_<t) - log p_teacher(y_t | y_<t)

is a one-sample estimate of KL(student || teacher) at position t (its mean over the student's own samples is
the reverse KL; Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD), arXiv 2306.13649, with lambda = 1 and the reverse KL as divergence). Thinking Machines 2025,
"On-Policy Distillation" (https://thinkingmachines.ai/blog/on-policy-distillation/, the tinker cookbook) makes
its negative the advantage of each token and trains with the ordinary policy-gradient loss:

    A_t = reward_coef * A_group + distill_coef * -(log p_student - log p_teacher)

where A_group is the completion's group-relative reward advantage (core/advantages.py), the same on each of
its tokens. With reward_coef = 0 this is pure distillation; then a token the teacher finds likelier than the
student did is pushed up, one it finds less likely pushed down, and the policy gradient of sum_t A_t log
p_student(y_t) is (in expectation over the student's samples) the negative gradient of the reverse KL at each
position, its prefix held fixed (a token's effect on later positions' KL is left out: a discount of 0, as in
tinker). The student's log-probs here are those that sampled (no gradient flows through the advantage).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) log p_student - log p_teacher of each sampled token: the per-token reverse-KL estimate."""
    return student_logprobs.float() - teacher_logprobs.float()


def distillation_advantages(reward_advantages: torch.Tensor, student_logprobs: torch.Tensor,
                            teacher_logprobs: torch.Tensor, mask: torch.Tensor, *, distill_coef: float = 1.0,
                            reward_coef: float = 1.0) -> torch.Tensor:
    """(B, T) per-token advantages: reward_coef x the completion's reward advantage (B,) on each of its
    tokens, plus distill_coef x -(log p_student - log p_teacher); 0 where mask (B, T) is 0 (padding, tool
    results)."""
    per_token_reward = reward_coef * reward_advantages.float()[:, None]  # (B, 1)
    teacher_signal = -distill_coef * reverse_kl(student_logprobs, teacher_logprobs)  # (B, T)
    return (per_token_reward + teacher_signal) * mask.float()  # (B, T)


class ReverseKL(NamedTuple):
    """Sums of the reverse-KL estimate over one rollout, for the metrics (forge/run/metrics.py)."""

    per_sequence: torch.Tensor  # (B,) sum over each completion's tokens of log p_student - log p_teacher
    tokens: torch.Tensor  # (B,) the completion's tokens counted (its mask's sum)


def reverse_kl_sums(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                    mask: torch.Tensor) -> ReverseKL:
    """The reverse KL of each completion (the sum over its masked tokens) and its token count. The per-token
    figure of a batch is sum(per_sequence) / sum(tokens); the per-sequence figure is the mean of per_sequence
    over the completions with tokens."""
    mask = mask.float()  # (B, T)
    return ReverseKL((reverse_kl(student_logprobs, teacher_logprobs) * mask).sum(dim=1), mask.sum(dim=1))
