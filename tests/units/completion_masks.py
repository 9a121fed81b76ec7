"""A helper of the rollout tests: a completion mask built from token ids, as a test writes its rollouts by hand."""

from collections.abc import Sequence

import torch


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> torch.Tensor:
    """(N, T) mask: 1 up to and including the first EOS. Built from positions, never by comparing with the
    pad id, because the pad token is often the EOS token."""
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), device=completion_ids.device))
    eos_seen_before = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0  # (N, T)
    return (~eos_seen_before).long()
