"""The policy's log-probs of sampled completions: the forward pass under the loss (and pi_old, the reference).

The `group_size` completions of a prompt share the prompt, so each distinct prompt is run through the model
once and its key/value cache expanded to its completions; gradients flow back through the expansion into the
one prompt computation. Where that computes fewer positions (`PaddingFree`), a prompt's completions instead
run end to end in one row after its cache, so no position of padding is computed. The same chunked
log-softmax also gives each position's entropy.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import cached_property, partial

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from forge.core.distill import token_divergence
from forge.core.rollout import Rollout
from forge.model.decode_plan import padded_positions, prefill
from forge.model.kv_cache import CACHE_ARG, holds_full_attention, shared_attention_configs


def token_logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024,
    with_entropy: bool = False, entropy_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(target_t) for each position. logits: (B, T, V), targets: (B, T) -> (B, T) float32.

    The log-softmax runs over chunks of positions, so the float32 (B*T, V) matrix is never all alive.
    Logits are divided by the sampling temperature so the ratio is taken against the policy that sampled.
    with_entropy also returns each position's entropy H = logsumexp(z) - sum_v softmax(z)_v z_v, (B, T), from
    the same chunk (no second pass); it carries a gradient only with entropy_grad (for an entropy bonus), so
    logging it keeps no extra (c, V) tensor alive for backward.
    """
    batch, length, vocab = logits.shape
    flat_logits = logits.reshape(-1, vocab)  # (B*T, V)
    flat_targets = targets.reshape(-1)  # (B*T,)
    out = torch.empty(flat_targets.shape, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(out) if with_entropy else None
    for start in range(0, flat_targets.numel(), chunk_size):
        chunk = flat_logits[start:start + chunk_size].float() / temperature  # (c, V)
        picked = chunk.gather(1, flat_targets[start:start + chunk_size, None]).squeeze(1)  # (c,)
        normaliser = torch.logsumexp(chunk, dim=-1)  # (c,)
        out[start:start + chunk_size] = picked - normaliser
        if entropy is not None:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                probs = (chunk - normaliser[:, None]).exp_()  # (c, V), in place: one (c, V) buffer
                entropy[start:start + chunk_size] = normaliser - torch.linalg.vecdot(probs, chunk)
    if entropy is None:
        return out.view(batch, length)
    return out.view(batch, length), entropy.view(batch, length)


class PolicyLogprobs:
    """The trainer's log-prob passes (mixed into GRPOTrainer, whose model, reference, processes and config
    they read, and `loss_autocast`: its precision's autocast, built once, Precision.reusable_autocast): the
    policy's under the loss (`logprobs`), pi_old and the reference's before the update, micro-batch by
    micro-batch."""

    def logprobs(self, model, rollout: Rollout, indices: torch.Tensor, **extras):
        """log-probs (n, T') of the completions `indices` of a rollout, T' = their longest completion, and the
        extras asked for (completion_logprobs)."""
        completions, index = completions_of(rollout, indices)
        with self.loss_autocast:  # the trainer's precision, as generation's: pi_old = stopgrad(pi) holds
            return completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, completions,
                                       index, self.config.temperature, self.config.logprob_chunk_size,
                                       self.config.share_prompt_prefix, share_template=not self.dist.fsdp,
                                       lengths=rollout.completion_lengths[indices], **extras)

    @torch.no_grad()
    def old_logprobs(self, rollout: Rollout, indices=None) -> torch.Tensor | None:
        """pi_old (docs/algorithm.md): None = stopgrad(pi_theta); a stale (async) rollout's sampler's; or
        recomputed."""
        stale = rollout.policy_version is not None and rollout.policy_version < self.global_step
        if self.config.num_iterations > 1 or (stale and self.config.rollout_is != "none"):
            return self.rollout_logprobs(self.model, rollout, indices)
        return rollout.sampler_logprobs if stale else None

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout, indices=None) -> torch.Tensor | None:
        if self.config.kl_beta == 0:
            return None
        if self.is_lora:  # the reference is the adapter-disabled model
            with self.model.disable_adapter():
                return self.rollout_logprobs(self.model, rollout, indices)
        return self.rollout_logprobs(self.reference_model, rollout, indices)

    def rollout_logprobs(self, model, rollout: Rollout, indices: torch.Tensor | None = None) -> torch.Tensor:
        """(N, T) log-probs of a rollout's completions under `model`, micro-batch by micro-batch, on CPU: of
        the completions `indices` only (0 elsewhere) when given."""
        with self.dist.whole_weights(model):  # FSDP2: gathered once per rollout, not per micro-batch
            batches = micro_batches(rollout, self.micro_batch_size, indices)
            parts = [self.logprobs(model, rollout, batch) for batch in batches]
        return padded_rows(parts, rollout.completion_ids, batches)


def completions_of(rollout: Rollout, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(completion ids (n, T'), their prompts' rows (n,)) of a rollout's completions `indices`, T' their
    longest: completion n is of prompt n // group_size."""
    length = int(rollout.completion_lengths[indices].max().clamp(min=1))
    return rollout.completion_ids[indices, :length], indices // rollout.group_size


def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    prompt_index: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 0,
    share_prompt_prefix: bool = True,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    share_template: bool = True,
    teacher: TeacherStates | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """log pi(completion token) for each completion token, (n, T); differentiable when grad is enabled. Then,
    when asked for and in this order, each position's entropy (n, T) from the same log-softmax pass
    (with_entropy) and its divergence from the teacher (n, T) (core/distill.py token_divergence).
    share_template=False: no separate pass over the prompts' common leading tokens (see prefill), so every
    call runs the model the same number of times whatever the prompts (FSDP2).

    prompt_ids/mask: (P, Lp) the prompts; completion_ids: (n, T); prompt_index: (n,) the prompt of each
    completion; lengths: (n,) each completion's real tokens (None: all T), 0 after them. With
    share_prompt_prefix, each distinct prompt is run once and its cache expanded (or its completions laid end
    to end after it, PaddingFree). The logits are made chunk_size positions at a time from the last hidden
    states (logprobs_from_hidden; 0 = CHUNK_LOGITS logits at a time).
    """
    device = next(model.parameters()).device
    chunk_size = chunk_size or max(1, CHUNK_LOGITS // model.get_output_embeddings().weight.shape[0])
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, prompt_index = completion_ids.to(device), prompt_index.to(device)
    scoring = {"temperature": temperature, "chunk_size": chunk_size, "with_entropy": with_entropy,
               "entropy_grad": entropy_grad}
    if not share_prompt_prefix:
        ids = torch.cat([prompt_ids[prompt_index], completion_ids], dim=1)  # (n, Lp + T)
        mask = torch.cat([prompt_mask[prompt_index], torch.ones_like(completion_ids)], dim=1)
        hidden = last_hidden(model, input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask),
                             use_cache=False)  # (n, Lp + T, H)
        view = None if teacher is None else teacher.positions(0, completion_ids.shape[1])
        return scored(model, hidden[:, prompt_ids.shape[1] - 1:-1], completion_ids, view, **scoring)

    ids, mask, expand = used_prompts(prompt_ids, prompt_mask, prompt_index)  # (u, Lp) each, (n,)
    cache, last_logits = prefill(model, ids, mask, share_template)  # (u, V)
    # The first completion token is predicted by the prompt's last position, the others by the one before.
    first_logits = last_logits[expand]  # (n, V)
    first_token = _outputs(token_logprobs_from_logits(first_logits[:, None], completion_ids[:, :1],
                                                      **scoring))
    if teacher is not None:  # (n, 1)
        first_token.append(teacher.divergence(first_logits, teacher.hidden[:, 0], temperature)[:, None])
    later = None if teacher is None else teacher.positions(1, completion_ids.shape[1])
    rest = later_tokens(model, cache, mask, expand, completion_ids, lengths, later, scoring)  # (n, T - 1)
    joined = [torch.cat(pair, dim=1) for pair in zip(first_token, rest)]  # (n, T) each
    return joined[0] if len(joined) == 1 else tuple(joined)


def later_tokens(model, cache, mask: torch.Tensor, expand: torch.Tensor, completion_ids: torch.Tensor,
                 lengths: torch.Tensor | None, teacher: TeacherStates | None,
                 scoring: dict) -> list[torch.Tensor]:
    """The scores (n, T - 1) of completion tokens 1.. after the prompts' cache (u rows, mask (u, Lp)): each
    completion a row of its own with its prompt's cache expanded to it, or, where that computes fewer
    positions, a prompt's completions end to end in its one row (PaddingFree), 0 after each one's length."""
    free = lengths is not None and PADDING_FREE and PaddingFree.pays(expand, lengths, completion_ids.shape,
                                                                       mask.shape[1])
    if not free or not takes_own_mask(model, cache):
        cache.batch_select_indices(expand)  # (n, ...) each completion sees its prompt's keys and values
        full_mask = torch.cat([mask[expand], torch.ones_like(completion_ids)], dim=1)  # (n, Lp + T)
        positions = mask[expand].sum(dim=1, keepdim=True) + torch.arange(completion_ids.shape[1],
                                                                         device=mask.device)
        hidden = last_hidden(model, input_ids=completion_ids, attention_mask=full_mask,
                             position_ids=positions, use_cache=True, **{CACHE_ARG: cache})  # (n, T, H)
        return _outputs(scored(model, hidden[:, :-1], completion_ids[:, 1:], teacher, **scoring))
    layout = PaddingFree.of(expand, lengths.to(expand.device))
    tokens, positions, own_mask = layout.inputs(completion_ids, mask)  # (u, S) each, (u, 1, S, Lp + S)
    hidden = last_hidden(model, input_ids=tokens, attention_mask=own_mask, position_ids=positions,
                         use_cache=True, **{CACHE_ARG: cache})  # (u, S, H)
    view = None if teacher is None else replace(teacher, hidden=layout.of_targets(teacher.hidden)[None])
    targets = layout.of_targets(completion_ids[:, 1:])[None]  # (1, R): every real token t >= 1
    scores = scored(model, layout.before_targets(hidden)[None], targets, view, **scoring)  # (1, R) each
    return [layout.spread(row, completion_ids.shape[1] - 1) for (row,) in _outputs(scores)]  # (n, T - 1)


PADDING_FREE = True  # False: every completion in a padded row of its own (for A/B runs)


@dataclass(frozen=True)
class PaddingFree:
    """The completions of each distinct prompt end to end in one row after the prompt's cache: completion
    i's tokens fill row `row[i]` from column `start[i]` for `length[i]` columns, at the positions after its
    prompt, and attend to the prompt and to their own completion's earlier tokens only (a (u, 1, S, Lp + S)
    mask that SDPA takes as given). Completions of different lengths then cost their own tokens, not the
    longest one's."""

    row: torch.Tensor  # (n,) each completion's row: its prompt among the distinct ones
    start: torch.Tensor  # (n,) its first column in that row
    length: torch.Tensor  # (n,) its real tokens
    width: int  # S: the longest row

    @classmethod
    def of(cls, expand: torch.Tensor, lengths: torch.Tensor) -> PaddingFree:
        starts, filled = [], {}
        for row, length in zip(expand.tolist(), lengths.tolist()):
            starts.append(filled.get(row, 0))
            filled[row] = starts[-1] + length
        starts = torch.tensor(starts, device=expand.device)
        return cls(expand, starts, lengths, max(filled.values(), default=0))

    @staticmethod
    def pays(expand: torch.Tensor, lengths: torch.Tensor, padded: tuple[int, int],
             prompt_length: int) -> bool:
        """Whether the completions of the prompts `expand` (n,), of `lengths` (n,), laid end to end compute
        fewer positions than the padded rows (n, T), and no more attention pairs (each position attends over
        the prompt and its whole row, masked): asked before the layout is built."""
        filled = torch.bincount(expand, weights=lengths.to(expand.device).double(), minlength=1)  # (u,)
        width = int(filled.max())  # S: the longest row
        rows, (n, length) = len(set(expand.tolist())), padded
        return 0 < rows * width < n * length and rows * width * (prompt_length + width) <= n * length * (
            prompt_length + length)

    @cached_property
    def _tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K,) each, K = the real tokens: which completion each is of, and its index t in it."""
        count = torch.arange(len(self.length), device=self.row.device)
        completion = torch.repeat_interleave(count, self.length)
        first = torch.repeat_interleave(self.length.cumsum(0) - self.length, self.length)  # (K,)
        return completion, torch.arange(len(completion), device=self.row.device) - first

    def inputs(self, completion_ids: torch.Tensor,
               prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' tokens and positions (u, S), and the mask (u, 1, S, Lp + S), from the completions (n, T)
        and the prompts' mask (u, Lp). A column after a row's last completion attends to itself only."""
        completion, t = self._tokens  # (K,) each
        rows, columns = self.row[completion], self.start[completion] + t  # (K,) each
        shape = (prompt_mask.shape[0], self.width)
        tokens = completion_ids.new_zeros(shape)
        tokens[rows, columns] = completion_ids[completion, t]  # (u, S)
        positions = prompt_mask.sum(dim=1, keepdim=True).expand(shape).clone()  # (u, S) after each prompt
        positions[rows, columns] += t
        owner = torch.full(shape, -1, dtype=torch.long, device=prompt_mask.device)
        owner[rows, columns] = completion  # (u, S), -1 after the last completion
        column = torch.arange(self.width, device=prompt_mask.device)
        own = (owner[:, :, None] == owner[:, None, :]) & (owner[:, :, None] >= 0) & (
            column[None, None, :] <= column[None, :, None])  # (u, S, S) causal within each completion
        own |= torch.eye(self.width, dtype=torch.bool, device=prompt_mask.device)
        prompt = prompt_mask.bool()[:, None, :].expand(-1, self.width, -1)  # (u, S, Lp)
        return tokens, positions, torch.cat([prompt, own], dim=2)[:, None]

    @cached_property
    def _targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(R,) each: the completion and index t - 1 of every token t >= 1 (what a position predicts)."""
        completion, t = self._tokens
        later = t >= 1
        return completion[later], t[later] - 1

    def of_targets(self, per_completion: torch.Tensor) -> torch.Tensor:
        """(n, T - 1, ...) values per completion token 1.. -> (R, ...) those of the real tokens."""
        completion, t = self._targets
        return per_completion[completion, t]

    def before_targets(self, rows: torch.Tensor) -> torch.Tensor:
        """(u, S, ...) per column -> (R, ...) at the column before each token t >= 1: what predicts it."""
        completion, t = self._targets
        return rows[self.row[completion], self.start[completion] + t]

    def spread(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """(R,) -> (n, width), 0 where a completion has no token."""
        completion, t = self._targets
        out = values.new_zeros((len(self.length), width))
        out[completion, t] = values
        return out


def takes_own_mask(model, cache) -> bool:
    """Whether the model's attention runs a 4D mask as given: SDPA full attention over a full-attention
    cache (no sliding window, no soft-capping)."""
    configs = shared_attention_configs(model)
    return bool(configs) and all(getattr(c, "_attn_implementation", None) == "sdpa" for c in configs) and (
        holds_full_attention(cache))


def used_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 prompt_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct prompts the completions use, (u, Lp) ids and mask without the columns that are padding in
    every one of them, and each completion's place among them (n,)."""
    used, expand = torch.unique(prompt_index, return_inverse=True)  # (u,), (n,)
    ids, mask = prompt_ids[used], prompt_mask[used]  # (u, Lp)
    first = int((mask.sum(dim=0) > 0).nonzero()[0])
    return ids[:, first:], mask[:, first:], expand


def _outputs(scores) -> list[torch.Tensor]:
    """The log-probs and the extras of a scoring call as a list (one tensor when no extra was asked for)."""
    return list(scores) if isinstance(scores, tuple) else [scores]


@dataclass(frozen=True)
class TeacherStates:
    """A teacher's view of completions for the full-vocabulary distillation term (core/distill.py): its last
    hidden states before each completion token and its output layer, so each chunk of the loss pass makes the
    teacher's logits there without the (n, T, V) logits ever existing."""

    hidden: torch.Tensor  # (n, T, H): position t's predicts completion token t
    head: torch.nn.Module  # the teacher's output layer: logits = head(hidden)
    beta: float  # GKD's JSD interpolation: 1 = KL(student || teacher), 0 = KL(teacher || student)

    def positions(self, start: int, stop: int) -> TeacherStates:
        """The states of positions start..stop-1 (the teacher's pass pads them to the rollout's length)."""
        return replace(self, hidden=self.hidden[:, start:stop])

    def divergence(self, student_logits: torch.Tensor, hidden: torch.Tensor,
                   temperature: float) -> torch.Tensor:
        """(c,) the divergence at c positions from the student's logits (c, V) and the teacher's hidden
        states (c, H) there."""
        with torch.no_grad():
            teacher_logits = self.head(hidden)  # (c, V)
        return token_divergence(student_logits, teacher_logits, self.beta, temperature)


def completion_states(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      completion_ids: torch.Tensor, prompt_index: torch.Tensor) -> torch.Tensor:
    """The last hidden states (n, T, H) before each completion token: position t's predicts token t (the
    prompt's last position predicts the first). Each distinct prompt but its last token runs once, its cache
    expanded to its completions; then each completion runs from that last prompt token on. For a model whose
    logits are a plain head of its hidden states (logit_head)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, prompt_index = completion_ids.to(device), prompt_index.to(device)
    ids, mask, expand = used_prompts(prompt_ids, prompt_mask, prompt_index)  # left-padded: last column real
    inputs = torch.cat([ids[expand, -1:], completion_ids[:, :-1]], dim=1)  # (n, T)
    full_mask = torch.cat([mask[expand], torch.ones_like(completion_ids[:, :-1])], dim=1)  # (n, Lp + T - 1)
    positions = mask[expand, :-1].sum(dim=1, keepdim=True) + torch.arange(inputs.shape[1], device=device)
    if ids.shape[1] == 1:  # nothing before the last prompt token
        return model.get_decoder()(input_ids=inputs, attention_mask=full_mask, position_ids=positions,
                                   use_cache=False).last_hidden_state
    cache, _ = prefill(model, ids[:, :-1], mask[:, :-1])
    cache.batch_select_indices(expand)  # (n, ...)
    return model.get_decoder()(input_ids=inputs, attention_mask=full_mask, position_ids=positions,
                               use_cache=True, **{CACHE_ARG: cache}).last_hidden_state  # (n, T, H)


def last_hidden(model, **inputs) -> torch.Tensor:
    """The model's last hidden states (B, L, H) where its logits are a plain head of them (logit_head), else
    its logits (B, L, V): scored() takes either."""
    head = logit_head(model)
    if head is None:
        return model(**inputs).logits
    return model.get_decoder()(**inputs).last_hidden_state


def scored(model, states: torch.Tensor, targets: torch.Tensor, teacher: TeacherStates | None = None,
           **scoring):
    """log p(targets) (and entropies, and divergences from the teacher) from what last_hidden returned for
    these positions."""
    head = logit_head(model)
    if head is None:
        if teacher is not None:
            raise ValueError(f"distill_loss='full' makes the student's logits chunk by chunk from its hidden "
                             f"states, but {type(model).__name__} scales or caps its logits after its output "
                             f"layer; use distill_loss='sampled'")
        return token_logprobs_from_logits(states, targets, **scoring)
    return logprobs_from_hidden(states, head, targets, teacher=teacher, **scoring)


CHUNK_LOGITS = 2**22  # logits per chunk (16 MB in fp32): 0.7-0.9x the time of whole logits on an EPYC CPU

_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def logit_head(model) -> torch.nn.Module | None:
    """The output layer when the model's logits are exactly `head(decoder(x).last_hidden_state)`, so the loss
    pass can make the logits chunk by chunk from the hidden states; None for a model that scales or caps its
    logits after the head (then its full logits are used), and under FSDP2, whose root module gathers the
    head. Checked once per model, by one forward over three tokens compared bit for bit."""
    if model not in _HEADS:
        _HEADS[model] = _plain_head(model)
    return _HEADS[model]


def _plain_head(model) -> torch.nn.Module | None:
    if isinstance(model, FSDPModule) or not hasattr(model, "get_decoder"):
        return None
    head = model.get_output_embeddings()
    if head is None:
        return None
    device = next(model.parameters()).device
    ids = torch.arange(3, device=device)[None] % head.weight.shape[0]  # (1, 3)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits  # (1, 3, V)
        again = head(model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state)
    return head if logits.shape == again.shape and torch.equal(logits, again) else None


def logprobs_from_hidden(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0,
    chunk_size: int = 1024, with_entropy: bool = False, entropy_grad: bool = False,
    teacher: TeacherStates | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """log p(target_t) (B, T) from the last hidden states (B, T, H) and the output layer `head`, whose logits
    are made chunk_size positions at a time: the (B, T, V) logits never exist. Under autograd each chunk is
    checkpointed, so its backward makes that chunk's logits again instead of keeping them; the values are
    those of token_logprobs_from_logits on the chunk's logits (and its entropies with with_entropy, and its
    divergences from the teacher's logits at the same positions with teacher)."""
    batch, length, width = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(-1, width), targets.reshape(-1)  # (B*T, H), (B*T,)
    flat_teacher = None if teacher is None else teacher.hidden.reshape(batch * length, -1)  # (B*T, H')
    chunk = partial(_chunk_logprobs, head, teacher, temperature=temperature, with_entropy=with_entropy,
                    entropy_grad=entropy_grad)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad
                                             or any(p.requires_grad for p in head.parameters()))
    pieces = []
    for i in range(0, flat_targets.numel(), chunk_size):
        part = (flat_hidden[i:i + chunk_size], flat_targets[i:i + chunk_size],
                None if flat_teacher is None else flat_teacher[i:i + chunk_size])
        pieces.append(checkpoint(chunk, *part, use_reentrant=False) if recompute else chunk(*part))
    outputs = 1 + with_entropy + (teacher is not None)
    if not pieces:  # no positions
        empty = [hidden.new_zeros((batch, length), dtype=torch.float32) for _ in range(outputs)]
        return empty[0] if outputs == 1 else tuple(empty)
    joined = [torch.cat([p[k] for p in pieces]).view(batch, length) for k in range(outputs)]
    return joined[0] if outputs == 1 else tuple(joined)


def _chunk_logprobs(head, teacher: TeacherStates | None, hidden: torch.Tensor, targets: torch.Tensor,
                    teacher_hidden: torch.Tensor | None, **scoring) -> tuple[torch.Tensor, ...]:
    """One chunk: (c, H) hidden states -> (c,) log-probs (and (c,) entropies, and (c,) divergences from the
    teacher, whose hidden states there are teacher_hidden (c, H'))."""
    logits = head(hidden)  # (c, V)
    out = _outputs(token_logprobs_from_logits(logits[None], targets[None], chunk_size=hidden.shape[0],
                                              **scoring))
    if teacher is not None:
        out.append(teacher.divergence(logits, teacher_hidden, scoring["temperature"])[None])
    return tuple(t[0] for t in out)


def checkpointed_layers(model, enabled: bool = True) -> AbstractContextManager[None]:
    """Recompute each decoder layer in backward instead of keeping its activations (torch.utils.checkpoint,
    per layer), with the KV cache kept: the loss pass still computes each group's prompt once.

    transformers' own gradient checkpointing drops the cache. Here each layer's forward remembers what its
    cache layer held when it ran, and its recomputation in backward starts from that again, so it appends the
    same keys and values to the same prompt and gives the same activations. Dropout stays as the model has it
    (off).
    """
    return _checkpointing(model) if enabled else nullcontext()


@contextmanager
def _checkpointing(model) -> Iterator[None]:
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise RuntimeError(f"gradient checkpointing was requested but {type(model).__name__} has no decoder "
                           "layers transformers can checkpoint (GradientCheckpointingLayer)")
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        layer.forward = partial(_recomputable, layer.forward, getattr(attention, "layer_idx", index))
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again


def _recomputable(forward, cache_index: int, *args, **kwargs):
    """One decoder layer's forward under activation checkpointing, its cache layer put back as it was for the
    recomputation (which runs in backward, when the cache has moved on)."""
    cache = kwargs.get(CACHE_ARG)
    cache_layers = getattr(cache, "layers", [])
    held = dict(vars(cache_layers[cache_index])) if cache_index < len(cache_layers) else None

    def run(*args, **kwargs):
        if held is not None:
            vars(cache_layers[cache_index]).update(held)
        return forward(*args, **kwargs)

    return checkpoint(run, *args, use_reentrant=False, **kwargs)


def micro_batches(rollout, size: int, indices: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The completions `indices` (default: all of the rollout's, in order) in chunks of `size` (0 = one
    chunk)."""
    indices = torch.arange(rollout.completion_ids.shape[0]) if indices is None else indices
    return list(indices.split(size or len(indices))) if len(indices) else []


def padded_rows(parts: list[torch.Tensor], like: torch.Tensor, batches: list[torch.Tensor]) -> torch.Tensor:
    """Per-micro-batch (n_i, T_i, ...) results, of the completions `batches[i]` (n_i,), in a float32 zero
    tensor shaped like `like` (N, T) (and the results' trailing dimensions), on CPU."""
    trailing = parts[0].shape[2:] if parts else ()
    full = torch.zeros((*like.shape, *trailing), dtype=torch.float32)  # (N, T, ...)
    for part, indices in zip(parts, batches):
        full[indices, :part.shape[1]] = part.cpu().float()
    return full
