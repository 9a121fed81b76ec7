"""Rollouts: `group_size` completions for each of many prompts, in one batched decode loop (`generate`).

Each step of the loop samples one token for every running completion and runs one forward; finished
completions leave the decode batch, so the tail of generation costs only what the still-running completions
need. How the prompts are prefilled and how a step runs on this model (each group's prompt run and attended
once, a cache written in place, a compiled step) is the decode plan's (forge/model/decode_plan.py): `generate`
calls `plan.prefill` once and the loop calls the step it returns once per token. Tools and environments are
the loop's hook (ToolTurns, after the loop): a completion that ends a call is fed the result's tokens while
the others go on sampling. The log-probs of the sampled tokens under the policy are computed by
core/logprobs.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from forge.core.tool_turns import ToolTurns
from forge.envs.protocol import EnvironmentSettings, Episode
from forge.model.decode_plan import DecodePlan
from forge.tools.calls import CallFormat, ToolResult, ToolSettings

Prompt = str | list[dict]  # plain text, or chat messages rendered with the tokenizer's chat template


@dataclass
class SamplingSettings:
    max_new_tokens: int = 512
    temperature: float = 0.9
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    backend: str = "eager"  # the decode step (forge/model/decode_plan.py): "eager", "compiled" or "auto"

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
    # softmax (logits / temperature, before top-k / top-p), 0 on padding: what the trainer's log-probs equal
    action_mask: torch.Tensor | None = None  # (N, T) 1 on tokens the model sampled, 0 on tool results fed
    # to it (tools); None = every completion token was sampled
    tool_calls: list[list] | None = None  # (N,) each completion's calls, in order (forge/tools ToolResult)
    episodes: list | None = None  # (N,) each completion's environment episode (forge/envs Episode) or None
    policy_version: int | None = None  # async GRPO: the optimizer step whose weights sampled it (None: the
    # trainer's weights as they are, sampled in this step)
    # Computed from the fields above once, when the Rollout is built (__post_init__):
    completion_lengths: torch.Tensor = field(init=False)  # (N,) tokens of each completion, fed ones included
    sampled_mask: torch.Tensor = field(init=False)  # (N, T) 1 on the completion tokens the model sampled: the
    # tokens that are actions in the loss (completion_mask without fed tool results)
    failed: torch.Tensor = field(init=False)  # (N,) bool: completions whose environment could not run (built
    # or reset), left out of the loss
    environments: list | None = field(init=False)  # (N,) each completion's environment instance, as rewards
    # receive it (`environments=`); None without an environment

    def __post_init__(self) -> None:
        self.completion_lengths = self.completion_mask.sum(dim=1)  # (N,)
        self.sampled_mask = self.completion_mask if self.action_mask is None \
            else self.completion_mask * self.action_mask  # (N, T)
        if self.episodes is None:
            self.failed, self.environments = torch.zeros(self.completion_ids.shape[0], dtype=torch.bool), None
        else:
            self.failed = torch.tensor([e.failure is not None for e in self.episodes], dtype=torch.bool)
            self.environments = [e.environment for e in self.episodes]

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_index(self) -> torch.Tensor:
        """(N,) which prompt row each completion belongs to."""
        return torch.arange(self.num_prompts).repeat_interleave(self.group_size)


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
    encoded = [tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"]
               for text, prompt in zip(texts, prompts)]
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


def prompt_budget(model_config, max_new_tokens: int, max_prompt_length: int | None) -> int:
    """The longest prompt a run may pass: max_prompt_length, or the model's context (its config's
    max_position_embeddings) minus max_new_tokens."""
    limit = getattr(model_config, "max_position_embeddings", None) or 10**9
    room = limit - max_new_tokens
    if max_prompt_length is not None:
        if max_prompt_length > room:
            raise ValueError(f"max_prompt_length={max_prompt_length} + max_new_tokens={max_new_tokens} "
                             f"exceeds the model's context of {limit} tokens; lower one of them")
        return max_prompt_length
    if room < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {limit} tokens")
    return room


def check_prompt_lengths(tokenizer, rows: Sequence[dict], max_prompt_length: int,
                         truncate: str = "error") -> None:
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
    logits: torch.Tensor, settings: SamplingSettings, uniforms: torch.Tensor | None = None,
    cdf_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits: (n, V) -> (n,) next token ids, greedy or with temperature / top-k / top-p.

    uniforms: (n,) draws in [0, 1), one per row, to sample by inverse CDF instead of torch's global
    generator: a row's token then depends only on its own logits and its own draw, not on the other rows.
    cdf_out: an (n, V) float64 buffer for the CDF, reused across decode steps (a fresh one, 12 MB in the demo,
    was paged in at every step).
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
        # keep the first token over p
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= settings.top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if uniforms is None:
        return torch.multinomial(probs, 1).squeeze(1)
    cdf = probs.double() if cdf_out is None else cdf_out.copy_(probs)
    cdf.cumsum_(dim=-1)  # (n, V)
    target = uniforms.to(cdf)[:, None] * cdf[:, -1:]  # (n, 1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # (n,) first token whose cdf exceeds it
    if bool((tokens < cdf.shape[-1]).all()):  # then at or before the last token of nonzero probability
        return tokens
    last_possible = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1)  # (n,) guards a draw rounded up to 1
    return torch.minimum(tokens, last_possible)


class Decoding:
    """One completion being decoded: its tokens so far and why it ended."""

    def __init__(self, limit: int):
        self.tokens: list[int] = []  # completion tokens (with tools: model and fed)
        self.logprobs: list[float] = []  # sampler log-prob of each token (0 for fed tokens)
        self.limit = limit  # most completion tokens: max_episode_tokens and the context left after the prompt
        self.model_tokens = 0
        self.done = False
        self.eos = False

    def take(self, tokens: list[int], logprobs: list[float], stop_ids, max_new_tokens: int) -> None:
        """Append tokens the model sampled; done at a stop token or with the budget spent."""
        self.tokens += tokens
        self.logprobs += logprobs
        self.model_tokens += len(tokens)
        if tokens and tokens[-1] in stop_ids:
            self.done = self.eos = True
        elif not tokens or self.model_tokens >= max_new_tokens or len(self.tokens) >= self.limit:
            self.done = True

    @property
    def truncated(self) -> bool:
        """Cut at the token budget (no stop token)."""
        return not self.eos


class ToolDecoding(Decoding):
    """A completion of a run with tools or an environment, whose calls the decode loop's hook (ToolTurns)
    answers: also the result tokens it is fed, its calls and its episode."""

    def __init__(self, limit: int, episode: Episode | None = None, stops_at_eos: bool = True):
        super().__init__(limit)
        self.stops_at_eos = stops_at_eos  # False: the call format reads past a stop token
        self.sampled: list[int] = []  # 1 where the model sampled the token, 0 where it was fed
        self.done = episode is not None and episode.failure is not None  # a failed episode samples nothing
        self.fed: list[int] = []  # result tokens fed in this step's forward, after the sampled token
        self.segment_start = 0  # where the model text since the last result begins (index into tokens)
        self.calls: list[ToolResult] = []
        self.episode = episode
        self.hit_call_limit = False
        self.ended = False  # the environment ended the episode

    def take(self, tokens: list[int], logprobs: list[float], stop_ids, max_new_tokens: int) -> None:
        self.fed = []
        self.sampled += [1] * len(tokens)
        super().take(tokens, logprobs, stop_ids if self.stops_at_eos else (), max_new_tokens)

    def feed(self, ids: list[int]) -> None:
        self.fed = ids
        self.tokens += ids
        self.sampled += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.segment_start = len(self.tokens)

    @property
    def truncated(self) -> bool:
        """Cut at the token budget: no stop token, no call limit, not ended by its environment."""
        return not self.eos and not self.hit_call_limit and not self.ended


# ----------------------------------------------------------------------------------------------------
# The decode loop

INFERENCE_MODE = True  # False: the loop under no_grad only (for A/B runs)


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
    plan: DecodePlan | None = None,
) -> Rollout:
    """Sample `group_size` completions for every prompt in one batched decode.

    noise: optional (P * group_size, max_new_tokens) uniforms in [0, 1); a row's k-th sampled token is drawn
    with noise[row, k] (see sample_next_token). None samples from torch's global generator.
    tools: the tools the policy may call (forge/tools), or an environment (forge/envs: one instance per
    completion, reset with its dataset row from `rows`, whose methods are the tools), run by the decode loop's
    hook, ToolTurns (below the loop: what a call, its result and the token budgets do).
    plan: how the decode runs on this model (forge/model/decode_plan.py), decided once by a trainer; None
    decides it here, from settings.backend, under the autocast the call runs in.
    """
    turns = None if tools is None else ToolTurns(tools, prompts, rows, group_size, tokenizer, call_format_)
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts if turns is None else turns.prompts,
                                               max_prompt_length, truncate_prompts,
                                               tools=None if turns is None else turns.schemas)  # (P, Lp)
    plan = plan or DecodePlan.of(model, settings.backend, with_tools=turns is not None)
    with plan.sampling_weights(model):  # the precision, merged LoRA and packing the plan says
        # The loop's tensors never meet autograd and it returns plain lists: inference mode skips autograd's
        # version counting and view tracking on each of its operators (the same values; 1.05x the tokens per
        # CPU-second of the demo's generation on an AMX Xeon, bench/decode_switch.py inference_mode). Under
        # autocast with unpacked weights (bf16 on a CPU without bf16 units) it would also turn off autocast's
        # cache of each weight's bf16 copy, casting every weight again at every decode step: there the loop
        # runs under no_grad.
        recast = torch.is_autocast_enabled(next(model.parameters()).device.type) and not plan.pack
        with torch.inference_mode() if INFERENCE_MODE and not recast else torch.no_grad():
            # (the decode step, next-token logits (N, V), the attention mask (N, Lp))
            prefilled = plan.prefill(model, prompt_ids, prompt_mask, group_size, settings.max_new_tokens,
                                     share_prompt_prefix)
            decodings = decode(model, tokenizer, prefilled, settings, noise, turns)
    return as_rollout(decodings, prompt_ids, prompt_mask, group_size, settings.max_new_tokens, tokenizer,
                      with_tools=turns is not None)


def decode(model, tokenizer, prefilled: tuple, settings: SamplingSettings, noise: torch.Tensor | None = None,
           turns: ToolTurns | None = None) -> list[Decoding]:
    """The batched decode loop over N completions, from the plan's prefill (`plan.prefill`: the decode step,
    next-token logits (N, V), the attention mask (N, Lp)): each step samples one token for every running
    completion and runs one forward; finished completions leave the batch. `turns` (tools) answers the calls
    that ended and feeds their results in the next forward."""
    device = next(model.parameters()).device
    stop_ids, max_new_tokens = eos_ids(tokenizer, model), settings.max_new_tokens
    step, next_logits, mask = prefilled  # the step, (N, V) next-token logits, (N, Lp) mask
    noise = None if noise is None else noise.to(device)  # (N, max_new_tokens)
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 10**9
    decodings = [Decoding(context - length) if turns is None
                 else ToolDecoding(min(turns.budget, context - length), turns.episode(n),
                                   turns.fmt.stops_at_eos)
                 for n, length in enumerate(mask.sum(dim=1).tolist())]
    active = torch.arange(len(decodings), device=device)  # (n,) the completions still decoding
    next_position = mask.sum(dim=1)  # (N,)
    # failed episodes leave before the first step
    running = still_running(decodings, step, active, next_logits, mask, next_position)
    cdf = next_logits.new_empty(next_logits.shape, dtype=torch.float64)  # (N, V) the sampler's, every step
    while running is not None:
        active, next_logits, mask, next_position = running
        draws = None if noise is None else noise[active, torch.tensor(
            [decodings[i].model_tokens for i in active.tolist()], device=device)]  # (n,)
        tokens, logprobs = sample_with_logprobs(next_logits, settings, draws, cdf[:len(active)])  # (n,) each
        for i, token, logprob in zip(active.tolist(), tokens.tolist(), logprobs.tolist()):
            decodings[i].take([token], [logprob], stop_ids, max_new_tokens)
        if turns is not None:  # the calls that just ended run; their results are fed in the next forward
            turns.answer(decodings, [(i, [token]) for i, token in zip(active.tolist(), tokens.tolist())],
                         max_new_tokens)
        running = still_running(decodings, step, active, tokens, mask, next_position)
        if running is None:
            break
        active, tokens, mask, next_position = running
        if turns is not None and any(decodings[i].fed for i in active.tolist()):  # results join this forward
            next_logits, mask, next_position = turns.forward(model, step.cache, decodings, active, tokens,
                                                             mask, next_position)
        else:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (n, L + 1)
            next_logits, next_position = step(tokens, mask, next_position), next_position + 1  # (n, V)
        running = active, next_logits, mask, next_position
    return decodings


def sample_with_logprobs(logits: torch.Tensor, settings: SamplingSettings, draws: torch.Tensor | None,
                         cdf_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, V) next-token logits -> (n,) sampled tokens and (n,) their log-probs under the sampling softmax."""
    scaled = logits.float()  # (n, V) the sampling softmax's logits, once
    scaled = scaled if settings.temperature == 1.0 else scaled / settings.temperature
    unit_temperature = replace(settings, temperature=1.0)  # the logits are scaled already
    tokens = sample_next_token(scaled if settings.do_sample else logits, unit_temperature, draws,
                               cdf_out)  # (n,)
    return tokens, scaled.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)  # (n,) each


def still_running(decodings: list[Decoding], step, active: torch.Tensor, *per_row: torch.Tensor):
    """The decode batch without its finished completions: (active, *per_row) of the running ones, the step
    keeping their rows; None when none is running."""
    running = torch.tensor([not decodings[i].done for i in active.tolist()], device=active.device)  # (n,)
    if not running.any():
        return None
    if running.all():
        return (active, *per_row)
    keep = running.nonzero().squeeze(1)
    step.keep(keep)
    return tuple(t[keep] for t in (active, *per_row))


def as_rollout(decodings: list[Decoding], prompt_ids, prompt_mask, group_size: int, max_new_tokens: int,
               tokenizer, with_tools: bool) -> Rollout:
    """The decoded completions as padded tensors: (N, T), T = max_new_tokens or the longest with tool
    results."""
    num_completions = len(decodings)
    length = max([len(d.tokens) for d in decodings] + [1 if with_tools else max_new_tokens])
    completion_ids = torch.full((num_completions, length), tokenizer.pad_token_id, dtype=torch.long)  # (N, T)
    completion_mask = torch.zeros((num_completions, length), dtype=torch.long)  # (N, T)
    sampler_logprobs = torch.zeros((num_completions, length), dtype=torch.float32)  # (N, T)
    for n, d in enumerate(decodings):
        k = len(d.tokens)
        completion_ids[n, :k] = torch.tensor(d.tokens, dtype=torch.long)
        completion_mask[n, :k] = 1
        sampler_logprobs[n, :k] = torch.tensor(d.logprobs, dtype=torch.float32)
    truncated = torch.tensor([d.truncated for d in decodings])
    texts = tokenizer.batch_decode([d.tokens for d in decodings], skip_special_tokens=True)
    if not with_tools:
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, group_size, texts,
                       sampler_logprobs)
    action_mask = torch.zeros((num_completions, length), dtype=torch.long)  # (N, T): 1 on sampled tokens
    for n, d in enumerate(decodings):
        action_mask[n, :len(d.sampled)] = torch.tensor(d.sampled, dtype=torch.long)
    episodes = [d.episode for d in decodings] if decodings and decodings[0].episode is not None else None
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, group_size, texts,
                   sampler_logprobs, action_mask=action_mask, tool_calls=[d.calls for d in decodings],
                   episodes=episodes)


def sampled_rollout(samples: Sequence[tuple[list[int], list[float], bool]], prompt_ids, prompt_mask,
                    group_size: int, max_new_tokens: int, tokenizer) -> Rollout:
    """A Rollout of completions sampled elsewhere (a serving engine, forge/core/engine_rollout.py): samples
    (N,) of (token ids, their sampler log-probs, ended on a stop token), group by group."""
    decodings = []
    for tokens, logprobs, stopped in samples:
        decoding = Decoding(len(tokens))
        decoding.tokens, decoding.logprobs = list(tokens), list(logprobs)
        decoding.eos = stopped
        decodings.append(decoding)
    return as_rollout(decodings, prompt_ids, prompt_mask, group_size, max_new_tokens, tokenizer, False)


# --------------------------------------------------------------------------------------------------
# the sampling noise of a step, and padding per-micro-batch results back to the rollout's shape


def sampling_seed(seed: int, step: int) -> int:
    """The seed of an optimizer step's sampling noise: a hash of (seed, step), the same on every rank."""
    return int.from_bytes(hashlib.sha256(f"forge-sampling:{seed}:{step}".encode()).digest()[:8], "little")


def sampling_noise(generator: torch.Generator, num_completions: int, max_new_tokens: int, rank: int = 0,
                   world_size: int = 1) -> torch.Tensor:
    """(num_completions, max_new_tokens) uniforms that sample this rank's completions.

    Every rank draws the noise of the whole rollout batch (all ranks' completions) from a generator seeded
    by (seed, step) and keeps its own: ranks never share draws, yet each prompt gets the same draws on 1 or
    N processes, so a run's completions do not depend on the number of processes, and resuming at a step needs
    no saved sampler state."""
    n = num_completions
    # (N_total, T)
    noise = torch.rand(n * world_size, max_new_tokens, dtype=torch.float64, generator=generator)
    return noise[rank * n:(rank + 1) * n]  # (N, T)
