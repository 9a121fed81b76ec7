"""Batched generation for many prompts at once, and the per-token log-probs of what was generated.

Both halves share one idea: the `group_size` completions of a prompt all start from the same prompt,
so the prompt is run through the model once per group and its key/value cache is expanded to the
group. In generation that is one prefill per prompt; in the loss, gradients flow back through the
expanded cache into the single prompt computation. Finished sequences leave the decode batch, so the
tail of generation costs only what the still-running completions need. The decode cache is allocated
once for prompt + max_new_tokens and written in place, so a decode step does not copy the whole cache.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import LlamaForCausalLM

from forge.core.grpo import token_logprobs_from_logits

Prompt = str | list[dict]  # plain text, or chat messages rendered with the tokenizer's chat template

# transformers 5 renamed the `past_key_values` argument to `cache`; speak whichever this version knows.
_CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def _returned_cache(output):
    cache = getattr(output, "cache", None)
    return output.past_key_values if cache is None else cache


try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # transformers < 4.56 keeps per-layer lists instead of layer objects
    DynamicLayer = None

if DynamicLayer is not None:

    class _PreallocatedLayer(DynamicLayer):
        """A DynamicLayer whose keys/values live in a buffer sized for the whole generation.

        DynamicLayer.update concatenates, which copies the layer's entire cache at every decode step: for a
        500-token prompt that copy, not the model, was ~20% of generation time on CPU. Here a step writes
        its new column in place and the layer exposes views of the filled part: the same values, so the
        same attention results.
        """

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
            super().__init__()
            batch, heads, length, dim = keys.shape
            self.key_buffer = keys.new_empty(batch, heads, capacity, dim)  # (n, H, capacity, D)
            self.value_buffer = values.new_empty(batch, heads, capacity, values.shape[-1])
            self.key_buffer[:, :, :length] = keys
            self.value_buffer[:, :, :length] = values
            self.length = length
            self.device, self.is_initialized = keys.device, True
            self._expose()

        def _expose(self) -> None:
            self.keys = self.key_buffer[:, :, :self.length]  # (n, H, length, D) views
            self.values = self.value_buffer[:, :, :self.length]

        def update(self, key_states, value_states, *args, **kwargs):
            new = key_states.shape[-2]
            if self.length + new > self.key_buffer.shape[-2]:
                raise RuntimeError(f"preallocated cache of {self.key_buffer.shape[-2]} positions is full")
            self.key_buffer[:, :, self.length:self.length + new] = key_states
            self.value_buffer[:, :, self.length:self.length + new] = value_states
            self.length += new
            self._expose()
            return self.keys, self.values

        def batch_repeat_interleave(self, repeats: int) -> None:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._expose()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self._expose()

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            self.batch_select_indices(beam_idx.to(self.key_buffer.device))


def _preallocated(cache, capacity: int):
    """Move a filled DynamicCache into buffers of `capacity` positions (see _PreallocatedLayer). Caches of
    other kinds (sliding windows, older transformers) are returned unchanged."""
    layers = getattr(cache, "layers", None)
    if DynamicLayer is None or not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized
                                                 for layer in layers):
        return cache
    cache.layers = [_PreallocatedLayer(layer.keys, layer.values, capacity) for layer in layers]
    return cache


@dataclass
class SamplingSettings:
    max_new_tokens: int = 512
    temperature: float = 0.9
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True


@dataclass
class Rollout:
    """The completions of one batch of prompts, laid out prompt by prompt (group i = rows i*G..(i+1)*G-1)."""

    prompt_ids: torch.Tensor  # (P, Lp) left-padded prompt tokens, one row per prompt
    prompt_mask: torch.Tensor  # (P, Lp) 1 on real prompt tokens
    completion_ids: torch.Tensor  # (N, T) completion tokens, N = P * G, padded after EOS
    completion_mask: torch.Tensor  # (N, T) 1 up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool, True when no EOS within max_new_tokens
    group_size: int
    completions: list[str] = field(default_factory=list)  # (N,) decoded text, special tokens removed
    sampler_logprobs: torch.Tensor | None = None  # (N, T) log-prob of each sampled token under the sampling
    # softmax (logits / temperature, before top-k / top-p), 0 on padding: what the trainer's log-probs should equal
    action_mask: torch.Tensor | None = None  # (N, T) 1 on tokens the model sampled, 0 on tool results fed to it
    # (core/tool_rollout.py); None = every completion token was sampled
    tool_calls: list[list] | None = None  # (N,) each completion's calls, in order (core/tools.py ToolResult)

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_index(self) -> torch.Tensor:
        """(N,) which prompt row each completion belongs to."""
        return torch.arange(self.num_prompts).repeat_interleave(self.group_size)

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)  # (N,)

    @property
    def sampled_mask(self) -> torch.Tensor:
        """(N, T) 1 on the completion tokens the model sampled: the tokens that are actions in the loss."""
        return self.completion_mask if self.action_mask is None else self.completion_mask * self.action_mask


# ----------------------------------------------------------------------------------------------------
# Prompts -> token ids


def render_prompt(tokenizer, prompt: Prompt, tools: list[dict] | None = None) -> str:
    """Plain prompts pass through; chat prompts are rendered with the tokenizer's chat template (given the
    tools' JSON schemas when `tools` is set, for templates that describe tools)."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a chat prompt (list of messages) needs a tokenizer with a chat template; "
                         "set tokenizer.chat_template or pass the prompt as a plain string")
    if tools:
        return tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def tokenize_prompts(
    tokenizer, prompts: Sequence[Prompt], max_prompt_length: int, truncate: str = "error",
    tools: list[dict] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask, (P, Lp). Over-long prompts raise or keep their last tokens.
    tools: JSON schemas given to chat templates (render_prompt)."""
    texts = [render_prompt(tokenizer, p, tools) for p in prompts]
    # chat templates already hold the BOS token when the model wants one
    encoded = [tokenizer(t, add_special_tokens=isinstance(p, str))["input_ids"] for t, p in zip(texts, prompts)]
    for i, ids in enumerate(encoded):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty after tokenization")
        if len(ids) > max_prompt_length:
            if truncate != "left":
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens, over max_prompt_length={max_prompt_length} "
                    f"(starts {texts[i][:60]!r}); shorten it, raise max_prompt_length (the model's context "
                    f"must hold prompt + max_new_tokens), or set truncate_prompts='left'")
            encoded[i] = ids[-max_prompt_length:]
    # Layout: [shared prefix][left padding][own suffix]. Prompts built from one template (system prompt,
    # worked examples) share most of their tokens; the prefix columns are then computed once (_prefill).
    shared = _common_prefix_length(encoded)
    length = shared + max(len(ids) - shared for ids in encoded)
    prompt_ids = torch.full((len(encoded), length), tokenizer.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(encoded), length), dtype=torch.long)
    prompt_ids[:, :shared] = torch.tensor(encoded[0][:shared], dtype=torch.long)
    prompt_mask[:, :shared] = 1
    for i, ids in enumerate(encoded):
        suffix = ids[shared:]
        prompt_ids[i, length - len(suffix):] = torch.tensor(suffix, dtype=torch.long)
        prompt_mask[i, length - len(suffix):] = 1
    return prompt_ids, prompt_mask


def prompt_budget(context_length: int | None, max_new_tokens: int, max_prompt_length: int | None) -> int:
    """The longest prompt a run may pass: max_prompt_length, or the model's context minus max_new_tokens."""
    limit = context_length or 10**9
    room = limit - max_new_tokens
    if max_prompt_length is not None:
        if max_prompt_length > room:
            raise ValueError(f"max_prompt_length={max_prompt_length} + max_new_tokens={max_new_tokens} exceeds "
                             f"the model's context of {limit} tokens; lower one of them")
        return max_prompt_length
    if room < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context "
                         f"of {limit} tokens")
    return room


def check_prompt_lengths(tokenizer, rows: Sequence[dict], max_prompt_length: int, truncate: str = "error") -> None:
    """Tokenize every row's prompt once up front, so an over-long one fails before any training."""
    for start in range(0, len(rows), 64):
        chunk = rows[start:start + 64]
        try:
            tokenize_prompts(tokenizer, [r["prompt"] for r in chunk], max_prompt_length, truncate)
        except ValueError as error:
            raise ValueError(f"dataset rows {start}..{start + len(chunk) - 1}: {error}") from None


def _common_prefix_length(encoded: list[list[int]]) -> int:
    """Tokens every prompt starts with, keeping at least one own token per prompt (0 for a single prompt)."""
    if len(encoded) < 2:
        return 0
    limit = min(len(ids) for ids in encoded) - 1
    first = encoded[0]
    for n in range(limit):
        if any(ids[n] != first[n] for ids in encoded[1:]):
            return n
    return max(limit, 0)


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> torch.Tensor:
    """(N, T) mask: 1 up to and including the first EOS. Built from positions, never by comparing with the
    pad id, because the pad token is often the EOS token."""
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), device=completion_ids.device))
    eos_seen_before = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0  # (N, T)
    return (~eos_seen_before).long()


def eos_ids(tokenizer, model=None) -> list[int]:
    ids = {tokenizer.eos_token_id}
    generation_config = getattr(model, "generation_config", None)
    extra = getattr(generation_config, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(extra)
    return sorted(i for i in ids if i is not None)


# ----------------------------------------------------------------------------------------------------
# Sampling


def sample_next_token(
    logits: torch.Tensor, settings: SamplingSettings, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """logits: (n, V) -> (n,) next token ids, greedy or with temperature / top-k / top-p.

    uniforms: (n,) draws in [0, 1), one per row, to sample by inverse CDF instead of torch's global
    generator: a row's token then depends only on its own logits and its own draw, not on the other rows.
    """
    if not settings.do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float() / settings.temperature  # (n, V)
    if settings.top_k > 0:
        kth = torch.topk(logits, min(settings.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= settings.top_p  # keep the first over p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if uniforms is None:
        return torch.multinomial(probs, 1).squeeze(1)
    cdf = probs.double().cumsum(dim=-1)  # (n, V)
    target = uniforms.to(cdf)[:, None] * cdf[:, -1:]  # (n, 1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # (n,) first token whose cdf exceeds it
    last_possible = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1)  # (n,) guards a draw rounded up to 1
    return torch.minimum(tokens, last_possible)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: (n, L) -> (n, L)."""
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


MIN_SHARED_PREFIX = 8  # below this many tokens, a separate prefix pass costs more than it saves


def _prefill(model, ids: torch.Tensor, mask: torch.Tensor, share_template: bool = True):
    """Run prompts (n, L) through the model; return (cache, logits of the last position (n, V)).

    Leading columns that are the same real token in every row (a shared template) are computed once and
    their cache expanded to all rows; gradients, when enabled, flow back through the expansion. That takes a
    second forward only for some batches; share_template=False always runs one (a sharded model needs the
    same number of forwards on every rank).
    """
    same = (ids == ids[:1]).all(dim=0) & mask.bool().all(dim=0)  # (L,)
    shared = int(same.long().cumprod(0).sum()) if ids.shape[0] > 1 else 0
    shared = min(shared, ids.shape[1] - 1)
    if shared < MIN_SHARED_PREFIX or not share_template:
        out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True,
                    logits_to_keep=1)
        return _returned_cache(out), out.logits[:, -1]
    prefix = model(input_ids=ids[:1, :shared], attention_mask=mask[:1, :shared], use_cache=True, logits_to_keep=1)
    cache = _returned_cache(prefix)
    cache.batch_repeat_interleave(ids.shape[0])
    out = model(input_ids=ids[:, shared:], attention_mask=mask, position_ids=_positions(mask)[:, shared:],
                use_cache=True, logits_to_keep=1, **{_CACHE_ARG: cache})
    return _returned_cache(out), out.logits[:, -1]


def prefill_groups(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                   share_prompt_prefix: bool, max_new_tokens: int):
    """Prefill P prompts (P, Lp) for P * group_size completions, ready to decode: the prompt runs once and its
    cache is expanded to the group (share_prompt_prefix), or runs once per completion.
    Returns (a cache with room for max_new_tokens more, next-token logits (N, V), the attention mask (N, Lp))."""
    device = next(model.parameters()).device
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)  # (P, Lp)
    if not share_prompt_prefix:
        ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)  # (N, Lp)
    cache, next_logits = _prefill(model, ids, mask)  # (P or N, V)
    if share_prompt_prefix:
        cache.batch_repeat_interleave(group_size)
        next_logits = next_logits.repeat_interleave(group_size, 0)  # (N, V)
        mask = mask.repeat_interleave(group_size, 0)  # (N, Lp)
    return _preallocated(cache, mask.shape[1] + max_new_tokens), next_logits, mask


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    group_size: int,
    settings: SamplingSettings,
    max_prompt_length: int = 10**9,
    truncate_prompts: str = "error",
    share_prompt_prefix: bool = True,
    noise: torch.Tensor | None = None,
) -> Rollout:
    """Sample `group_size` completions for every prompt in one batched decode.

    noise: optional (P * group_size, max_new_tokens) uniforms in [0, 1); completion i's token t is drawn with
    noise[i, t] (see sample_next_token). None samples from torch's global generator.
    """
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, truncate_prompts)
    stop_ids = torch.tensor(eos_ids(tokenizer, model), device=device)
    num_rows = len(prompts) * group_size

    cache, next_logits, mask = prefill_groups(model, prompt_ids, prompt_mask, group_size, share_prompt_prefix,
                                              settings.max_new_tokens)  # (N, V), (N, Lp)

    completion_ids = torch.full((num_rows, settings.max_new_tokens), tokenizer.pad_token_id, dtype=torch.long)
    sampler_logprobs = torch.zeros((num_rows, settings.max_new_tokens), dtype=torch.float32)
    active = torch.arange(num_rows, device=device)  # rows still decoding
    next_position = mask.sum(dim=1)  # (N,)
    if noise is not None:
        noise = noise.to(device)  # (N, max_new_tokens)
    for step in range(settings.max_new_tokens):
        tokens = sample_next_token(next_logits, settings, None if noise is None else noise[active, step])  # (n,)
        completion_ids[active.cpu(), step] = tokens.cpu()
        logp = torch.log_softmax(next_logits.float() / settings.temperature, dim=-1)  # (n, V)
        sampler_logprobs[active.cpu(), step] = logp.gather(1, tokens[:, None]).squeeze(1).cpu()
        running = ~torch.isin(tokens, stop_ids)  # (n,)
        if step == settings.max_new_tokens - 1 or not running.any():
            break
        if not running.all():  # drop finished rows from the decode batch
            keep = running.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            active, tokens, mask, next_position = active[keep], tokens[keep], mask[keep], next_position[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (n, L + 1)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                    use_cache=True, **{_CACHE_ARG: cache})
        next_logits, next_position = out.logits[:, -1], next_position + 1

    completion_mask = completion_mask_from_ids(completion_ids, stop_ids.tolist())
    truncated = completion_mask.all(dim=1) & ~torch.isin(completion_ids[:, -1], stop_ids.cpu())
    lengths = completion_mask.sum(dim=1).tolist()
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(completion_ids.tolist(), lengths)],
                                   skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, group_size, texts,
                   sampler_logprobs * completion_mask)


# ----------------------------------------------------------------------------------------------------
# Log-probs of completions


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
    share_template=False: no separate pass over the prompts' common leading tokens (see _prefill), so every
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
    cache, last_logits = _prefill(model, ids, mask, share_template)  # (u, V)
    cache.batch_select_indices(expand)  # (n, ...) each completion sees its prompt's keys and values
    first_logits = last_logits[expand]  # (n, V) predicts the first completion token

    full_mask = torch.cat([mask[expand], torch.ones_like(completion_ids)], dim=1)  # (n, Lp + T)
    positions = mask[expand].sum(dim=1, keepdim=True) + torch.arange(completion_ids.shape[1], device=device)
    logits = model(input_ids=completion_ids, attention_mask=full_mask, position_ids=positions,
                   use_cache=True, **{_CACHE_ARG: cache}).logits  # (n, T, V)
    logits = torch.cat([first_logits[:, None], logits[:, :-1]], dim=1)  # (n, T, V) aligned with targets
    return token_logprobs_from_logits(logits, completion_ids, temperature, chunk_size, with_entropy,
                                      entropy_grad)  # (n, T), and (n, T) entropies with_entropy


def _full_sequence_logprobs(model, prompt_ids, prompt_mask, completion_ids, temperature, chunk_size,
                            with_entropy=False, entropy_grad=False):
    """The straightforward path: every completion re-reads its own copy of the prompt."""
    prompt_len = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (n, Lp + T)
    mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=_positions(mask), use_cache=False).logits
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

# --------------------------------------------------------------------------------------------------
# the sampling noise of a step, and padding per-micro-batch results back to the rollout's shape


def sampling_seed(seed: int, step: int) -> int:
    """The seed of an optimizer step's sampling noise: a hash of (seed, step), the same on every rank."""
    return int.from_bytes(hashlib.sha256(f"forge-sampling:{seed}:{step}".encode()).digest()[:8], "little")


def sampling_noise(generator: torch.Generator, rows: int, max_new_tokens: int, rank: int = 0,
                   world_size: int = 1) -> torch.Tensor:
    """(rows, max_new_tokens) uniforms that sample this rank's `rows` completions.

    Every rank draws the noise of the whole rollout batch (all ranks' rows) from a generator seeded by
    (seed, step) and keeps its own rows: ranks never share draws, yet each prompt gets the same draws on 1 or
    N processes, so a run's completions do not depend on the number of processes, and resuming at a step needs
    no saved sampler state."""
    noise = torch.rand(rows * world_size, max_new_tokens, dtype=torch.float64, generator=generator)  # (N_total, T)
    return noise[rank * rows:(rank + 1) * rows]  # (N, T)


def padded_rows(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Stack per-micro-batch (n_i, T_i) results into a float32 zero tensor shaped like `like` (N, T), on CPU."""
    full = torch.zeros(like.shape, dtype=torch.float32)  # (N, T)
    row = 0
    for part in parts:
        full[row:row + part.shape[0], :part.shape[1]] = part.cpu()
        row += part.shape[0]
    return full
