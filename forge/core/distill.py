"""On-policy distillation as per-token advantages: pure tensor math, imports only torch.

The student samples its own completions; a teacher scores the sampled tokens. The per-token reverse KL

    reverse_kl_t = log p_student(y_t | y_<t) - log p_teacher(y_t | y_<t)

is a one-sample estimate of KL(student || teacher) at position t (its mean over the student's own samples is
the reverse KL; Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD), arXiv 2306.13649, with lambda = 1 and the reverse KL as divergence). Thinking Machines 2025,
"On-Policy Distillation" (https://thinkingmachines.ai/blog/on-policy-distillation/, the tinker cookbook) makes
its negative the advantage of each token and trains with the ordinary policy-gradient loss:

    A_t = reward_coef * A_group + distill_coef * -(log p_student - log p_teacher)

where A_group is the completion's group-relative reward advantage (core/grpo.py), the same on each of
its tokens. With reward_coef = 0 this is pure distillation; then a token the teacher finds likelier than the
student did is pushed up, one it finds less likely pushed down, and the policy gradient of sum_t A_t log
p_student(y_t) is (in expectation over the student's samples) the negative gradient of the reverse KL at each
position, its prefix held fixed (a token's effect on later positions' KL is left out: a discount of 0, as in
tinker). The student's log-probs here are those that sampled (no gradient flows through the advantage).

That is distill_loss='sampled'. With distill_loss='full' the divergence is taken over the whole vocabulary at
each position of the student's samples instead of at the sampled token, and is itself a loss term (GKD's
on-policy objective, lambda = 1):

    loss += distill_coef x mean over loss tokens of JSD_beta(p_student(. | y_<t), p_teacher(. | y_<t))

with GKD's generalized Jensen-Shannon divergence, M = beta p_teacher + (1 - beta) p_student,

    JSD_beta = beta KL(p_teacher || M) + (1 - beta) KL(p_student || M),

taken at its limits as TRL's GKDTrainer does: beta = 1 is the reverse KL(p_student || p_teacher) itself,
beta = 0 the forward KL(p_teacher || p_student). Its gradient at a position is exact where the sampled form
estimates it from one token, at the cost of the teacher's next-token distribution at every loss position
(made chunk by chunk from the teacher's last hidden states, never the whole (B, T, V) at once).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

DISTILL_LOSSES = {  # GRPOConfig.distill_loss: how the teacher's signal enters the loss
    "sampled": "the reverse KL at each sampled token as its advantage (distillation_advantages)",
    "full": "GKD's generalized JSD over the whole vocabulary at every loss position (token_divergence)",
}


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


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 1.0,
                     temperature: float = 1.0) -> torch.Tensor:
    """(c,) GKD's generalized JSD_beta between the student's and the teacher's next-token distributions at c
    positions, from their logits (c, V), both divided by the sampling temperature; differentiable in the
    student's logits. beta = 1: KL(student || teacher); beta = 0: KL(teacher || student)."""
    student = torch.log_softmax(student_logits.float() / temperature, dim=-1)  # (c, V)
    teacher = torch.log_softmax(teacher_logits.float() / temperature, dim=-1).detach()  # (c, V)
    if beta == 1:
        return _kl(student, teacher)
    if beta == 0:
        return _kl(teacher, student)
    mixture = torch.logaddexp(teacher + math.log(beta), student + math.log(1 - beta))  # (c, V) log M
    return beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """(c,) KL(p || q) = sum_v p_v (log p_v - log q_v) from log-probabilities (c, V)."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def divergence_loss(divergence: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """The distillation loss term of a micro-batch: its divergence (n, T) summed over its loss tokens (mask
    (n, T)) over num_tokens, the optimizer batch's loss tokens, so the micro-batches' terms sum to the mean
    over every loss token of the step."""
    return (divergence * mask.float()).sum() / num_tokens


class ReverseKL(NamedTuple):
    """Sums of the reverse-KL estimate over one rollout, for the metrics (forge/run/step_stats.py)."""

    per_sequence: torch.Tensor  # (B,) sum over each completion's tokens of log p_student - log p_teacher
    tokens: torch.Tensor  # (B,) the completion's tokens counted (its mask's sum)


def reverse_kl_sums(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                    mask: torch.Tensor) -> ReverseKL:
    """The reverse KL of each completion (the sum over its masked tokens) and its token count. The per-token
    figure of a batch is sum(per_sequence) / sum(tokens); the per-sequence figure is the mean of per_sequence
    over the completions with tokens."""
    mask = mask.float()  # (B, T)
    return ReverseKL((reverse_kl(student_logprobs, teacher_logprobs) * mask).sum(dim=1), mask.sum(dim=1))
