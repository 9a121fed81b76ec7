"""One rollout, several optimizer steps (rollout_slices > 1): TRL's steps_per_generation above
gradient_accumulation_steps, where one generation feeds steps_per_generation / gradient_accumulation_steps
optimizer steps, each on a slice of it (TRL's "LoRA Without Regret" recipe trains two optimizer steps on 4 of
one prompt's 8 completions each).

What TRL 1.16 does (trl/trainer/grpo_trainer.py, GRPOTrainer):

    _prepare_inputs (l. 1538-1546): every steps_per_generation x num_iterations forward/backward passes,
        generate and score the generation batch (_generate_and_score_completions: advantages over the whole
        of it), shuffle it (shuffle_sequence_dict: one torch.randperm of its completions, trl/trainer/utils.py
        l. 1092) and cut it into steps_per_generation equal parts (split_tensor_dict, utils.py l. 1057); pass
        `_step` trains on part `_step % steps_per_generation`. So an optimizer step
        (gradient_accumulation_steps passes) trains on the parts of its slice, and with num_iterations > 1
        the slices come round again in the same order: slice 0, 1, ..., k-1, 0, 1, ..., k-1, ... (the
        sampler's figure, l. 1290-1307).
    pi_old (l. 2642-2657): computed at generation time unless gradient_accumulation_steps is a multiple of
        steps_per_generation x num_iterations, so a later slice's ratio is taken against the policy that
        sampled it (clipped, as with num_iterations).
    the loss's normaliser (_compute_loss, l. 3155-3175), per optimizer step:
        grpo, sapo   each pass's per-sequence mean / gradient_accumulation_steps: the mean over the slice's
                     completions
        dr_grpo      sum / (pass completions x max_completion_length) / gradient_accumulation_steps: the
                     slice's completions x max_completion_length
        dapo, cispo  sum / (num_items_in_batch / processes x gradient_accumulation_steps /
                     steps_per_generation), num_items_in_batch the loss tokens of the whole generation
                     (l. 2498): the generation's tokens / k, shared equally by its k slices, not each slice's
                     own count
    Forge counts its normaliser so: a slice's completions (with a loss token) for the sequence mean, its
    sampled completions for dr_grpo, and the rollout's loss tokens / k for the token mean (bnpo, dapo, cispo,
    and a teacher's full-distribution term); as in one optimizer step, counted over every process.

What Forge does differently, and why:

    the shuffle is drawn from a generator seeded by (seed, the rollout's first optimizer step), not from
        torch's global random state as TRL's randperm: the same seed cuts the same slices, a resumed run cuts
        them as the uninterrupted one did, and the global state every other draw of the run uses is left as
        it was.
    each rollout batch of the step (gradient_accumulation_steps > 1) is cut on its own, k equal slices each,
        and slice j of the step is slice j of every one of them (TRL's mapping has one rollout batch a
        generation).
    the permutation is of the whole rollout batch, every process's completions, and each process keeps its
        own share of each slice: 1 and N processes train the same slices (TRL shuffles each process's part
        alone); the shares of a slice then differ in size from process to process, so FSDP2 is refused.
    the whole rollout's metrics (rewards, lengths) are logged with its first optimizer step; every step logs
        its own loss, gradient norm and learning rate (TRL logs the generation's reward metrics once too).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import torch

from forge.core.batch import Batch
from forge.core.grpo import LossNormaliser


def slice_seed(seed: int, step: int) -> int:
    """The seed of the shuffle of a rollout whose first optimizer step is step + 1: a hash of (seed, step)."""
    return int.from_bytes(hashlib.sha256(f"forge-slices:{seed}:{step}".encode()).digest()[:8], "little")


def slice_numbers(num_completions: int, slices: int, generator: torch.Generator) -> torch.Tensor:
    """(num_completions,) the slice of each completion of a rollout batch, 0 .. slices-1: a random permutation
    cut into `slices` equal runs, as TRL's shuffle_sequence_dict then split_tensor_dict."""
    order = torch.randperm(num_completions, generator=generator)  # (N,)
    numbers = torch.empty(num_completions, dtype=torch.long)  # (N,)
    numbers[order] = torch.arange(num_completions) // (num_completions // slices)
    return numbers


def cut_rollout(batch: Batch, slices: int, generator: torch.Generator, max_completion_length: int,
                mine: Callable[[torch.Tensor], torch.Tensor],
                total: Callable[[list[float]], list[float]] = lambda counts: counts,
                recompute_old: Callable | None = None) -> list[Batch]:
    """The batch's `slices` optimizer steps: each a Batch of the same rollouts, advantages and log-probs whose
    loss passes run over its slice's completions only, with its own LossNormaliser (the module docstring).

    `mine(numbers)`: this process's share of a whole rollout batch's (N_all,) per-completion values; `total`
    sums counts over the processes (both identities in one process). `recompute_old(rollout, indices)`: the
    policy's log-probs (N, T) of a rollout's completions `indices`, the later slices' pi_old (the policy that
    sampled them), where the step has not computed it (num_iterations = 1)."""
    if recompute_old is not None:
        with torch.no_grad():
            batch.old_logprobs = [recompute_old(rollout, indices)
                                  for rollout, indices in zip(batch.rollouts, batch.loss_indices)]
    everyone = [int(total([float(len(mask))])[0]) for mask in batch.loss_mask]  # N_all of each rollout batch
    numbers = [mine(slice_numbers(n, slices, generator)) for n in everyone]  # (N,) each: this process's
    tokens = sum(float(mask.sum()) for mask in batch.loss_mask)  # the rollout's loss tokens
    parts = []
    for part in range(slices):
        rows = [(number == part).nonzero().squeeze(1) for number in numbers]  # (n,) each
        in_part = [number[indices] == part for number, indices in zip(numbers, batch.loss_indices)]
        sequences, part_tokens, sampled = total([
            sum(float((mask[r].sum(dim=1) > 0).sum()) for mask, r in zip(batch.loss_mask, rows)),
            tokens / slices,
            float(sum(len(r) for r in rows)),
        ])
        normaliser = LossNormaliser(max(sequences, 1.0), max(part_tokens, 1.0), max_completion_length,
                                    sampled)
        parts.append(dataclasses.replace(
            batch, loss_indices=[indices[kept] for indices, kept in zip(batch.loss_indices, in_part)],
            normaliser=normaliser))
    return parts


__all__ = ["cut_rollout", "slice_numbers", "slice_seed"]
