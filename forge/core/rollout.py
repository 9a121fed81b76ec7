"""Rollouts: `group_size` completions for each of many prompts, in one batched decode loop (`generate`).

The completions of a prompt all start from the same prompt, so the prompt is run through the model once per
group and its key/value cache is expanded to the group. Finished rows leave the decode batch, so the tail of
generation costs only what the still-running completions need; the cache is allocated once for prompt +
max_new_tokens and written in place (forge/model/kv_cache.py). With tools, a row that ends a call is fed the
result's tokens while the other rows go on sampling. The log-probs of the sampled tokens under the policy
are computed by core/logprobs.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from forge.envs.protocol import EnvironmentSettings, Episode, with_opening
from forge.model.kv_cache import CACHE_ARG, grow, preallocated, returned_cache
from forge.model.packed_linear import packed_linears
from forge.model.static_decode import decoder, resolve_backend
from forge.tools.calls import (
    CallFormat,
    ToolResult,
    ToolSettings,
    call_format,
    closing_token_ids,
    ended_call,
    run_calls,
)

Prompt = str | list[dict]  # plain text, or chat messages rendered with the tokenizer's chat template


@dataclass
class SamplingSettings:
    max_new_tokens: int = 512
    temperature: float = 0.9
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    backend: str = "eager"  # the decode step (forge/model/static_decode.py): "eager", "compiled" or "auto"

    @classmethod
    def from_config(cls, config) -> SamplingSettings:
        """A run's sampling: GRPOConfig's max_new_tokens, temperature, top_p, top_k and generation_backend."""
        return cls(config.max_new_tokens, config.temperature, config.top_p, config.top_k,
                   backend=config.generation_backend)


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
    # (tools); None = every completion token was sampled
    tool_calls: list[list] | None = None  # (N,) each completion's calls, in order (forge/tools ToolResult)
    episodes: list | None = None  # (N,) each completion's environment episode (forge/envs Episode); None: none

    @property
    def environments(self) -> list | None:
        """(N,) each completion's environment instance, as rewards receive it (`environments=`)."""
        return None if self.episodes is None else [e.environment for e in self.episodes]

    @property
    def failed(self) -> torch.Tensor:
        """(N,) bool: completions whose environment could not run (built or reset), left out of the loss."""
        if self.episodes is None:
            return torch.zeros(self.completion_ids.shape[0], dtype=torch.bool)
        return torch.tensor([e.failure is not None for e in self.episodes], dtype=torch.bool)

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


@dataclass
class Batch:
    """The rollouts of one optimizer step, with everything the loss needs (one entry per rollout batch): what
    GRPOTrainer.collect gives GRPOTrainer.update."""

    rollouts: list[Rollout] = field(default_factory=list)  # each: P prompts x G completions
    rows: list[list[dict]] = field(default_factory=list)  # the dataset rows of each rollout
    advantages: list[torch.Tensor] = field(default_factory=list)  # (N,)
    loss_mask: list[torch.Tensor] = field(default_factory=list)  # (N, T): completion mask x kept samples
    old_logprobs: list[torch.Tensor | None] = field(default_factory=list)  # (N, T); None: pi_old = sg(pi)
    ref_logprobs: list[torch.Tensor | None] = field(default_factory=list)  # (N, T); None when kl_beta == 0


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
    # worked examples) share most of their tokens; the prefix columns are then computed once (prefill).
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
    # (n, V); x / 1 is x: the decode loop passes logits it has already scaled, with temperature 1
    logits = logits.float() if settings.temperature == 1.0 else logits.float() / settings.temperature
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
    if bool((tokens < cdf.shape[-1]).all()):  # then at or before the last token of nonzero probability
        return tokens
    last_possible = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1)  # (n,) guards a draw rounded up to 1
    return torch.minimum(tokens, last_possible)


def padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: (n, L) -> (n, L)."""
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


MIN_SHARED_PREFIX = 8  # below this many tokens, a separate prefix pass costs more than it saves
# The last position as an index (logits_to_keep): the model gathers it into a contiguous (n, 1, C) input of the
# output layer. logits_to_keep=1 slices a strided view, which torch.matmul cannot fold into one matrix product:
# it copies the transposed output weight once per row instead (0.55 s for the demo's 4 prompts on a CPU, 60x the
# product itself). The same logits in bf16; in fp32 the one product and the per-row ones can differ in the last bit.
LAST_POSITION = torch.tensor([-1])


def prefill(model, ids: torch.Tensor, mask: torch.Tensor, share_template: bool = True,
            last_position: int | torch.Tensor = 1):
    """Run prompts (n, L) through the model; return (cache, logits of the last position (n, V)).
    last_position: the model's logits_to_keep; generation passes LAST_POSITION, the loss pass the slice (1).

    Leading columns that are the same real token in every row (a shared template) are computed once and
    their cache expanded to all rows; gradients, when enabled, flow back through the expansion. That takes a
    second forward only for some batches; share_template=False always runs one (a sharded model needs the
    same number of forwards on every rank).
    """
    same = (ids == ids[:1]).all(dim=0) & mask.bool().all(dim=0)  # (L,)
    shared = int(same.long().cumprod(0).sum()) if ids.shape[0] > 1 else 0
    shared = min(shared, ids.shape[1] - 1)
    if shared < MIN_SHARED_PREFIX or not share_template:
        out = model(input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask), use_cache=True,
                    logits_to_keep=last_position)
        return returned_cache(out), out.logits[:, -1]
    prefix = model(input_ids=ids[:1, :shared], attention_mask=mask[:1, :shared], use_cache=True,
                   logits_to_keep=last_position)
    cache = returned_cache(prefix)
    cache.batch_repeat_interleave(ids.shape[0])
    out = model(input_ids=ids[:, shared:], attention_mask=mask, position_ids=padded_positions(mask)[:, shared:],
                use_cache=True, logits_to_keep=last_position, **{CACHE_ARG: cache})
    return returned_cache(out), out.logits[:, -1]


def prefill_groups(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                   share_prompt_prefix: bool, max_new_tokens: int):
    """Prefill P prompts (P, Lp) for P * group_size completions, ready to decode: the prompt runs once and its
    cache is expanded to the group (share_prompt_prefix), or runs once per completion.
    Returns (a cache with room for max_new_tokens more, next-token logits (N, V), the attention mask (N, Lp))."""
    device = next(model.parameters()).device
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)  # (P, Lp)
    if not share_prompt_prefix:
        ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)  # (N, Lp)
    cache, next_logits = prefill(model, ids, mask, last_position=LAST_POSITION)  # (P or N, V)
    repeats = group_size if share_prompt_prefix else 1
    if share_prompt_prefix:
        next_logits = next_logits.repeat_interleave(group_size, 0)  # (N, V)
        mask = mask.repeat_interleave(group_size, 0)  # (N, Lp)
    return preallocated(cache, mask.shape[1] + max_new_tokens, repeats), next_logits, mask  # the cache: N rows


TRUNCATION_MARKER = " [truncated: token budget]"  # ends a fed result cut to the completion's token budget


class DecodeRow:
    """One completion being decoded."""

    def __init__(self, limit: int, episode: Episode | None = None):
        self.tokens: list[int] = []  # completion tokens, model and fed
        self.sampled: list[int] = []  # 1 where the model sampled the token, 0 where it was fed
        self.logprobs: list[float] = []  # sampler log-prob of each token (0 for fed tokens)
        self.fed: list[int] = []  # result tokens fed in this step's forward, after the sampled token
        self.limit = limit  # most completion tokens: max_episode_tokens and the context left after the prompt
        self.model_tokens = 0
        self.segment_start = 0  # where the model text since the last result begins (index into tokens)
        self.calls: list[ToolResult] = []
        self.episode = episode
        self.done = episode is not None and episode.failure is not None  # a failed episode samples nothing
        self.eos = False
        self.hit_call_limit = False
        self.ended = False  # the environment ended the episode

    def take(self, tokens: list[int], logprobs: list[float], stop_ids, closing: torch.Tensor | None, tokenizer,
             fmt: CallFormat | None, tools: ToolSettings | None, max_new_tokens: int) -> tuple | None:
        """Append tokens the model sampled (their last one decides what follows). Returns (call, overflow) when
        they end a call the model can still read, to be answered; otherwise settles the row: done at a stop token,
        at a call past tools.max_calls (left unanswered), or with its budget spent. closing: (V,) the tokens after
        which a call may have ended (closing_token_ids)."""
        self.tokens += tokens
        self.sampled += [1] * len(tokens)
        self.logprobs += logprobs
        self.model_tokens += len(tokens)
        self.fed = []
        last = tokens[-1] if tokens else None
        if last in stop_ids and (fmt is None or fmt.stops_at_eos):
            self.done = self.eos = True
            return None
        if closing is not None and last is not None and last < closing.numel() and bool(closing[last]):
            call, overflow = ended_call(tokenizer, fmt, self.tokens[self.segment_start:])
            if call is not None:
                if len(self.calls) >= tools.max_calls:
                    self.done = self.hit_call_limit = True
                    return None
                if self.model_tokens < max_new_tokens and len(self.tokens) < self.limit:
                    return call, overflow  # a call the model can still read
        if not tokens or self.model_tokens >= max_new_tokens or len(self.tokens) >= self.limit:
            self.done = True
        return None

    def feed(self, ids: list[int]) -> None:
        self.fed = ids
        self.tokens += ids
        self.sampled += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.segment_start = len(self.tokens)


# ----------------------------------------------------------------------------------------------------
# The decode loop (with tools or an environment: a row that ends a call is fed the result)


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
    tools: ToolSettings | EnvironmentSettings | None = None,
    call_format_: CallFormat | None = None,
    rows: Sequence[dict] | None = None,
) -> Rollout:
    """Sample `group_size` completions for every prompt in one batched decode.

    noise: optional (P * group_size, max_new_tokens) uniforms in [0, 1); a row's k-th sampled token is drawn
    with noise[row, k] (see sample_next_token). None samples from torch's global generator.
    tools: the tools the policy may call (forge/tools), or an environment (forge/envs: one instance per
    completion, reset with its dataset row from `rows`, whose methods are the tools). When a row's text ends a
    call (CallFormat), the calls of that decode step run together, each with its timeout; each result is
    rendered, tokenized and *fed* to its row in the next forward, all its tokens in that one pass, while the other
    rows go on sampling (rows of unequal inputs are left-padded within the step). A completion is then one
    interleaved sequence (model text, result, model text, ...); `Rollout.action_mask` marks the sampled tokens,
    and only those count towards max_new_tokens. Sampled and fed tokens together count towards
    `tools.max_episode_tokens`, and prompt + completion never pass the model's context: a result that does not
    fit is cut, ends with TRUNCATION_MARKER, and ends the row. A row also ends at a call beyond
    `tools.max_calls` (left unanswered), and when its environment ends the episode. With no call made and no
    opening observation, the tokens are those sampled without tools (the noise is indexed by sampled tokens).
    The eager decode step runs the linear layers on weights packed once for this generation where that measured
    faster with the same bits (forge/model/packed_linear.py).
    """
    device = next(model.parameters()).device
    eager = tools is not None or resolve_backend(settings.backend, device.type) == "eager"
    with packed_linears(model, enabled=eager):
        return _generate(model, tokenizer, prompts, group_size, settings, max_prompt_length, truncate_prompts,
                         share_prompt_prefix, noise, tools, call_format_, rows)


def start_episodes(tools, prompts: Sequence[Prompt], rows: Sequence[dict] | None, group_size: int):
    """(tools, episodes, prompts): for an environment, its tools, one episode per completion reset with its
    dataset row, and the prompts with their opening observation; plain tools (or None) pass through unchanged."""
    if not isinstance(tools, EnvironmentSettings):
        return tools, None, prompts
    episodes = tools.start(rows if rows is not None else [{"prompt": p} for p in prompts], group_size)
    return tools.tools, episodes, [with_opening(p, episodes[i * group_size].opening) for i, p in enumerate(prompts)]


def _generate(model, tokenizer, prompts, group_size, settings, max_prompt_length, truncate_prompts,
              share_prompt_prefix, noise, tools, call_format_, rows) -> Rollout:
    """generate's decode loop."""
    tools, episodes, prompts = start_episodes(tools, prompts, rows, group_size)
    fmt = None if tools is None else call_format_ or call_format(tools.format, tools.tools, tokenizer)
    device = next(model.parameters()).device
    schemas = [t.schema for t in tools.tools] if fmt is not None and fmt.kind == "template" else None
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, truncate_prompts,
                                               tools=schemas)
    stop_ids = eos_ids(tokenizer, model)
    closing = None if fmt is None else closing_token_ids(tokenizer, fmt.closers)
    num_rows = len(prompts) * group_size

    cache, next_logits, mask = prefill_groups(model, prompt_ids, prompt_mask, group_size, share_prompt_prefix,
                                              settings.max_new_tokens)  # (N, V), (N, Lp)
    cache, decode_step = decoder(model, cache, settings.backend if tools is None else "eager")
    if noise is not None:
        noise = noise.to(device)  # (N, max_new_tokens)

    context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 10**9
    budget = (tools.max_episode_tokens if tools is not None else None) or 10**9
    rows_ = [DecodeRow(min(budget, context - length), None if episodes is None else episodes[n])
             for n, length in enumerate(mask.sum(dim=1).tolist())]
    unit_temperature = replace(settings, temperature=1.0)  # for the logits the loop scales itself
    active = torch.arange(num_rows, device=device)  # rows still decoding
    next_position = mask.sum(dim=1)  # (N,)
    if any(row.done for row in rows_):  # failed episodes leave before the first token
        keep = torch.tensor([not row.done for row in rows_]).nonzero().squeeze(1).to(device)
        if keep.numel() == 0:
            return as_rollout(rows_, prompt_ids, prompt_mask, group_size, settings.max_new_tokens, tokenizer,
                               tools is not None)
        cache.batch_select_indices(keep)
        active, next_logits, mask, next_position = active[keep], next_logits[keep], mask[keep], next_position[keep]
    while True:
        active_list = active.tolist()
        draws = None if noise is None else noise[active, torch.tensor(
            [rows_[i].model_tokens for i in active_list], device=device)]  # (n,)
        scaled = next_logits.float() / settings.temperature  # (n, V) the sampling softmax's logits, once
        tokens = sample_next_token(scaled if settings.do_sample else next_logits, unit_temperature, draws)  # (n,)
        logp_of = torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1).tolist()  # (n,)

        round_calls: list[tuple[int, object, str]] = []
        for i, token, token_logp in zip(active_list, tokens.tolist(), logp_of):
            call = rows_[i].take([token], [token_logp], stop_ids, closing, tokenizer, fmt, tools,
                                 settings.max_new_tokens)
            if call is not None:
                round_calls.append((i, *call))
        if round_calls:
            answer_calls(round_calls, rows_, tools, fmt, tokenizer)

        running = torch.tensor([not rows_[i].done for i in active_list], device=device)  # (n,)
        if not running.any():
            break
        if not running.all():  # drop finished rows from the decode batch
            keep = running.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            active, tokens, mask, next_position = active[keep], tokens[keep], mask[keep], next_position[keep]
        inputs = [[token] + rows_[i].fed for i, token in zip(active.tolist(), tokens.tolist())]
        width = max(len(ids) for ids in inputs)
        if width == 1:  # every row feeds its one sampled token
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (n, L + 1)
            next_logits, next_position = decode_step(tokens, mask, next_position), next_position + 1  # (n, V)
            continue
        # Some rows also feed a result: every row's inputs, left-padded to the widest, in one forward.
        lengths = torch.tensor([len(ids) for ids in inputs], device=device)  # (n,)
        step_ids = torch.full((len(inputs), width), tokenizer.pad_token_id, dtype=torch.long, device=device)
        for j, ids in enumerate(inputs):
            step_ids[j, width - len(ids):] = torch.tensor(ids, device=device)
        offsets = torch.arange(width, device=device)[None, :] - (width - lengths[:, None])  # (n, width), <0 = pad
        mask = torch.cat([mask, (offsets >= 0).long()], dim=1)  # (n, L + width)
        grow(cache, mask.shape[1])
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=next_position[:, None] + offsets.clamp(min=0),
                    use_cache=True, logits_to_keep=LAST_POSITION, **{CACHE_ARG: cache})
        next_logits, next_position = out.logits[:, -1], next_position + lengths
    return as_rollout(rows_, prompt_ids, prompt_mask, group_size, settings.max_new_tokens, tokenizer,
                               tools is not None)


def answer_calls(round_calls: list, rows: list[DecodeRow], tools: ToolSettings, fmt: CallFormat, tokenizer) -> None:
    """Run the calls of one decode step together; give each row its result's tokens to feed, cut to the row's
    token budget (then marked and ending the row); an environment that ended its episode ends the row."""
    toolboxes = None
    if rows[round_calls[0][0]].episode is not None:
        toolboxes = [rows[i].episode.toolbox for i, _, _ in round_calls]
    results = run_calls([call for _, call, _ in round_calls], tools, toolboxes=toolboxes)
    for (i, _, overflow), result in zip(round_calls, results):
        row = rows[i]
        row.calls.append(result)
        if row.episode is not None:
            EnvironmentSettings.settle(row.episode, failed=result.failure is not None)
            row.done = row.ended = row.episode.done
        rendered = fmt.render(result)
        # The call's last token may run past the closer ("</calc><" as one token, the model starting
        # "<result>" itself): feed only the rest of the result then.
        rendered = rendered[len(overflow):] if overflow and rendered.startswith(overflow) else rendered
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"] or [tokenizer.pad_token_id]
        room = row.limit - len(row.tokens)
        if len(ids) > room:
            marker = tokenizer(TRUNCATION_MARKER, add_special_tokens=False)["input_ids"]
            ids = (ids[:max(room - len(marker), 0)] + marker)[:room]
            row.done = True
        row.feed(ids)
        row.done = row.done or len(row.tokens) >= row.limit


def as_rollout(rows: list[DecodeRow], prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, tokenizer,
                with_tools: bool) -> Rollout:
    """The decoded rows as padded tensors: (N, T), T = max_new_tokens or the longest row with tool results."""
    num_rows = len(rows)
    length = max([len(row.tokens) for row in rows] + [1 if with_tools else max_new_tokens])
    completion_ids = torch.full((num_rows, length), tokenizer.pad_token_id, dtype=torch.long)  # (N, T)
    completion_mask = torch.zeros((num_rows, length), dtype=torch.long)  # (N, T)
    action_mask = torch.zeros((num_rows, length), dtype=torch.long)  # (N, T)
    sampler_logprobs = torch.zeros((num_rows, length), dtype=torch.float32)  # (N, T)
    for n, row in enumerate(rows):
        k = len(row.tokens)
        completion_ids[n, :k] = torch.tensor(row.tokens, dtype=torch.long)
        completion_mask[n, :k] = 1
        action_mask[n, :k] = torch.tensor(row.sampled, dtype=torch.long)
        sampler_logprobs[n, :k] = torch.tensor(row.logprobs, dtype=torch.float32)
    truncated = torch.tensor([not row.eos and not row.hit_call_limit and not row.ended for row in rows])
    texts = tokenizer.batch_decode([row.tokens for row in rows], skip_special_tokens=True)
    if not with_tools:
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, group_size, texts,
                       sampler_logprobs)
    episodes = [row.episode for row in rows] if rows and rows[0].episode is not None else None
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, group_size, texts,
                   sampler_logprobs, action_mask=action_mask, tool_calls=[row.calls for row in rows],
                   episodes=episodes)


def sampled_rollout(samples: Sequence[tuple[list[int], list[float], bool]], prompt_ids, prompt_mask,
                    group_size: int, max_new_tokens: int, tokenizer) -> Rollout:
    """A Rollout of completions sampled elsewhere (a serving engine, forge/core/engine_rollout.py): samples (N,)
    of (token ids, their sampler log-probs, ended on a stop token), group by group."""
    rows = []
    for tokens, logprobs, stopped in samples:
        row = DecodeRow(len(tokens))
        row.tokens, row.sampled, row.logprobs, row.eos = list(tokens), [1] * len(tokens), list(logprobs), stopped
        rows.append(row)
    return as_rollout(rows, prompt_ids, prompt_mask, group_size, max_new_tokens, tokenizer, False)


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
