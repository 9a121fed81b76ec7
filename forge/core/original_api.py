"""Helpers of Forge's earlier API that the engine no longer calls, kept so code that imports them still runs.

`forge/_moved.py` finds them at their old homes: `forge.core.grpo.compute_token_log_probs` and
`sequence_mean_log_probs` (the first Forge's loss took the ratio on each completion's mean log-prob),
`forge.core.reward.wants_trainer_state` (now `names_parameter(reward, "trainer_state")`).
"""

from __future__ import annotations

from typing import Any

import torch

from forge.core.grpo import masked_mean
from forge.core.logprobs import token_logprobs_from_logits
from forge.core.reward import FunctionReward, names_parameter


def compute_token_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token log-probs of the response tokens of prompt+response sequences, 0 elsewhere.

    logits: (B, L, V) from the model on input_ids (B, L); response_mask: (B, L), 1 on response tokens.
    Returns (B, L - 1): entry t is log p(input_ids[t + 1]) masked by response_mask[t + 1].
    """
    token_logprobs = token_logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature)  # (B, L-1)
    return token_logprobs * response_mask[:, 1:].to(token_logprobs.dtype)


def sequence_mean_log_probs(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-response mean log-prob over the response tokens, (B, T) -> (B,)."""
    return masked_mean(token_logprobs, mask, dim=1)


def wants_trainer_state(reward: Any) -> bool:
    """True when the reward's signature names a ``trainer_state`` parameter (only such rewards receive it)."""
    return names_parameter(reward.fn if isinstance(reward, FunctionReward) else reward, "trainer_state")


__all__ = ["compute_token_log_probs", "sequence_mean_log_probs", "wants_trainer_state"]
