"""The policy's log-probs of sampled completions: the forward pass under the loss (and pi_old, the reference).

The `group_size` completions of a prompt share the prompt, so each distinct prompt is run through the model
once and its key/value cache expanded to its completions; gradients flow back through the expansion into the
one prompt computation. The same chunked log-softmax also gives each position's entropy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from forge.core.grpo import token_logprobs_from_logits
from forge.core.rollout import padded_positions, prefill
from forge.model.kv_cache import CACHE_ARG


def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    prompt_index: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    share_prompt_prefix: bool = True,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    share_template: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(completion token) for each completion token, (n, T); differentiable when grad is enabled.
    with_entropy: also each position's entropy (n, T), from the same log-softmax pass (token_logprobs_from_logits).
    share_template=False: no separate pass over the prompts' common leading tokens (see prefill), so every
    call runs the model the same number of times whatever the prompts (FSDP2).

    prompt_ids/mask: (P, Lp) the prompts; completion_ids: (n, T); prompt_index: (n,) the prompt of each
    completion. With share_prompt_prefix, each distinct prompt is run once and its cache expanded.
    """
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, prompt_index = completion_ids.to(device), prompt_index.to(device)
    if not share_prompt_prefix:
        return _full_sequence_logprobs(model, prompt_ids[prompt_index], prompt_mask[prompt_index],
                                       completion_ids, temperature, chunk_size, with_entropy, entropy_grad)

    used, expand = torch.unique(prompt_index, return_inverse=True)  # (u,), (n,)
    ids, mask = prompt_ids[used], prompt_mask[used]  # (u, Lp)
    # Drop columns that are padding in every used prompt.
    first = int((mask.sum(dim=0) > 0).nonzero()[0])
    ids, mask = ids[:, first:], mask[:, first:]
    cache, last_logits = prefill(model, ids, mask, share_template)  # (u, V)
    cache.batch_select_indices(expand)  # (n, ...) each completion sees its prompt's keys and values
    first_logits = last_logits[expand]  # (n, V) predicts the first completion token

    full_mask = torch.cat([mask[expand], torch.ones_like(completion_ids)], dim=1)  # (n, Lp + T)
    positions = mask[expand].sum(dim=1, keepdim=True) + torch.arange(completion_ids.shape[1], device=device)
    logits = model(input_ids=completion_ids, attention_mask=full_mask, position_ids=positions,
                   use_cache=True, **{CACHE_ARG: cache}).logits  # (n, T, V)
    logits = torch.cat([first_logits[:, None], logits[:, :-1]], dim=1)  # (n, T, V) aligned with targets
    return token_logprobs_from_logits(logits, completion_ids, temperature, chunk_size, with_entropy,
                                      entropy_grad)  # (n, T), and (n, T) entropies with_entropy


def _full_sequence_logprobs(model, prompt_ids, prompt_mask, completion_ids, temperature, chunk_size,
                            with_entropy=False, entropy_grad=False):
    """The straightforward path: every completion re-reads its own copy of the prompt."""
    prompt_len = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (n, Lp + T)
    mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=padded_positions(mask), use_cache=False).logits
    logits = logits[:, prompt_len - 1:-1]  # (n, T, V): position t predicts completion token t
    return token_logprobs_from_logits(logits, completion_ids, temperature, chunk_size, with_entropy, entropy_grad)


@contextmanager
def checkpointed_layers(model, enabled: bool = True) -> Iterator[None]:
    """Recompute each decoder layer in backward instead of keeping its activations (transformers' gradient
    checkpointing, enabled on the model beforehand), while dropout stays off.

    transformers checkpoints a layer only while that layer is in training mode; Forge keeps the model in eval
    mode so that sampling, pi_old and pi_theta are one network. So only the checkpointing layers themselves are
    switched to training mode here (their submodules, dropout included, are not). A checkpointed layer drops
    any KV cache, so use it with the full-sequence log-prob path (share_prompt_prefix=False).
    """
    if not enabled:
        yield
        return
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    if not layers:
        raise RuntimeError("gradient checkpointing was requested but the model has no checkpointing layers; "
                           "enable it first (forge.model.enable_checkpointing)")
    modes = [layer.training for layer in layers]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer, mode in zip(layers, modes):
            layer.training = mode


def micro_batches(rollout, size: int, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """`rows` (default: all of the rollout's, in order) in chunks of `size` (0 = one chunk)."""
    rows = torch.arange(rollout.completion_ids.shape[0]) if rows is None else rows
    return list(rows.split(size or len(rows))) if len(rows) else []


def padded_rows(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Stack per-micro-batch (n_i, T_i) results into a float32 zero tensor shaped like `like` (N, T), on CPU."""
    full = torch.zeros(like.shape, dtype=torch.float32)  # (N, T)
    row = 0
    for part in parts:
        full[row:row + part.shape[0], :part.shape[1]] = part.cpu()
        row += part.shape[0]
    return full
