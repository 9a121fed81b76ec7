"""Batch: what GRPOTrainer.collect hands GRPOTrainer.update, the rollouts of one optimizer step with
everything the loss needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forge.core.grpo import LossNormaliser
from forge.core.rollout import Rollout


@dataclass
class Batch:
    """The rollouts of one optimizer step, with everything the loss needs (one entry per rollout batch)."""

    rollouts: list[Rollout] = field(default_factory=list)  # each: P prompts x G completions
    rows: list[list[dict]] = field(default_factory=list)  # the dataset rows of each rollout
    advantages: list[torch.Tensor] = field(default_factory=list)  # (N,)
    loss_mask: list[torch.Tensor] = field(default_factory=list)  # (N, T): completion mask x kept samples
    loss_indices: list[torch.Tensor | None] = field(default_factory=list)  # (n,) the completions with a loss
    # token, the only ones the log-prob passes run (None: every completion, FSDP2)
    old_logprobs: list[torch.Tensor | None] = field(default_factory=list)  # (N, T); None: pi_old = sg(pi)
    ref_logprobs: list[torch.Tensor | None] = field(default_factory=list)  # (N, T); None when kl_beta == 0
    teacher_hidden: list[torch.Tensor | None] = field(default_factory=list)  # (N, T, H) the teacher's states
    # before each completion token, distill_loss='full' only (core/teacher.py)
    normaliser: LossNormaliser | None = None  # a slice's, counted when its rollout was cut (rollout_slices
    # > 1, core/rollout_slices.py), which its loss divides by; None: the one update() counts of the loss masks
