"""Multi-turn rollouts: batched decoding in which a completion may call tools and read their results.

The loop is core/rollout.py's `generate` (one prefill per group, one batched decode, finished rows leave the
batch) with one addition: a row may be *fed* tokens instead of sampling them. When a row's model text ends a
call (see core/tools.py CallFormat), the calls of that decode step run together (parallel threads, each with
its timeout); each result is rendered and tokenized, and its tokens are fed to that row one per decode step,
in the same batched forward passes in which the other rows go on sampling. So rows that make no call never
wait for the result tokens of rows that do, and a completion is one contiguous interleaved sequence (model
text, result, model text, ...) whose log-probs the loss teacher-forces exactly as for a plain completion.

A row ends at EOS, after `max_new_tokens` tokens of its *own* (fed result tokens do not count), or at a call
beyond `max_calls` (the completion then ends with that unanswered call). `Rollout.action_mask` marks the
sampled tokens; the trainer keeps the fed ones out of the loss. Sampling noise is indexed by the row's model
token count, so with no call the tokens are those `generate` samples from the same noise.

Kept apart from core/rollout.py so that `generate`, which every run without tools uses, stays as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forge.core.rollout import (
    _CACHE_ARG,
    Prompt,
    Rollout,
    SamplingSettings,
    eos_ids,
    prefill_groups,
    sample_next_token,
    tokenize_prompts,
)
from forge.tools.calls import CallFormat, ToolResult, ToolSettings, call_format, run_calls


class _Row:
    """One completion being decoded."""

    def __init__(self):
        self.tokens: list[int] = []  # completion tokens, model and fed
        self.sampled: list[int] = []  # 1 where the model sampled the token, 0 where it was fed
        self.logprobs: list[float] = []  # sampler log-prob of each token (0 for fed tokens)
        self.fed: list[int] = []  # result tokens still to feed
        self.model_tokens = 0
        self.segment_start = 0  # where the model text since the last result begins (index into tokens)
        self.calls: list[ToolResult] = []
        self.done = False
        self.eos = False
        self.hit_call_limit = False


def _closing_token_ids(tokenizer, closers: Sequence[str]) -> torch.Tensor:
    """(V,) bool: tokens whose text holds the last character of a closer. Only after one of those can a call
    have just ended, so the row's text is decoded only then."""
    cached = getattr(tokenizer, "_forge_closing_ids", None)
    last_chars = "".join(sorted({c[-1] for c in closers}))
    if cached is not None and cached[0] == last_chars:
        return cached[1]
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    table = torch.tensor([any(ch in piece for ch in last_chars) for piece in pieces])
    try:
        tokenizer._forge_closing_ids = (last_chars, table)
    except AttributeError:
        pass
    return table


def _ended_call(tokenizer, fmt: CallFormat, segment_ids: list[int]):
    """(call, overflow) when the segment's last token completes a closer, else (None, ''). overflow: the text
    of that token after the closer (BPE may merge a closer with what follows, e.g. '><')."""
    text = tokenizer.decode(segment_ids, skip_special_tokens=True)
    before = len(tokenizer.decode(segment_ids[:-1], skip_special_tokens=True))
    for closer in fmt.closers:
        end = text.rfind(closer) + len(closer)
        if end >= len(closer) and end > before:  # the closer ends inside the last token
            call = fmt.parse(text[:end])
            if call is not None:
                return call, text[end:]
    return None, ""


def _grow(cache, needed: int) -> None:
    """Give preallocated cache layers room for `needed` positions (fed result tokens were not in the plan)."""
    for layer in getattr(cache, "layers", []):
        buffer = getattr(layer, "key_buffer", None)
        if buffer is None or buffer.shape[-2] >= needed:
            continue
        capacity = max(needed, buffer.shape[-2] + 64)
        for name in ("key_buffer", "value_buffer"):
            old = getattr(layer, name)
            new = old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
            new[:, :, :layer.length] = old[:, :, :layer.length]
            setattr(layer, name, new)
        layer._expose()


@torch.no_grad()
def generate_with_tools(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    group_size: int,
    settings: SamplingSettings,
    tools: ToolSettings,
    max_prompt_length: int = 10**9,
    truncate_prompts: str = "error",
    share_prompt_prefix: bool = True,
    noise: torch.Tensor | None = None,
    call_format_: CallFormat | None = None,
) -> Rollout:
    """`generate` with tool calls: `group_size` completions per prompt, calls answered as they are made.

    noise: optional (N, max_new_tokens) uniforms; a row's k-th sampled token is drawn with noise[row, k]."""
    fmt = call_format_ or call_format(tools.format, tools.tools, tokenizer)
    device = next(model.parameters()).device
    schemas = [t.schema for t in tools.tools] if fmt.kind == "template" else None
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, truncate_prompts,
                                               tools=schemas)
    stop_ids = eos_ids(tokenizer, model)
    closing = _closing_token_ids(tokenizer, fmt.closers)
    num_rows = len(prompts) * group_size

    cache, next_logits, mask = prefill_groups(model, prompt_ids, prompt_mask, group_size, share_prompt_prefix,
                                              settings.max_new_tokens)  # (N, V), (N, Lp)
    if noise is not None:
        noise = noise.to(device)  # (N, max_new_tokens)

    rows = [_Row() for _ in range(num_rows)]
    active = torch.arange(num_rows, device=device)  # rows still decoding
    next_position = mask.sum(dim=1)  # (N,)
    while True:
        active_list = active.tolist()
        is_fed = torch.tensor([bool(rows[i].fed) for i in active_list], device=device)  # (n,)
        tokens = torch.empty(len(active_list), dtype=torch.long, device=device)  # (n,)
        logp_of = torch.zeros(len(active_list))
        if is_fed.any():
            tokens[is_fed] = torch.tensor([rows[i].fed[0] for i in active_list if rows[i].fed], device=device)
        sampling = (~is_fed).nonzero().squeeze(1)  # (s,) positions in the active batch that sample
        if sampling.numel():
            logits = next_logits[sampling]  # (s, V)
            draws = None if noise is None else noise[active[sampling], torch.tensor(
                [rows[active_list[j]].model_tokens for j in sampling.tolist()], device=device)]
            sampled = sample_next_token(logits, settings, draws)  # (s,)
            tokens[sampling] = sampled
            logp = torch.log_softmax(logits.float() / settings.temperature, dim=-1)  # (s, V)
            logp_of[sampling.cpu()] = logp.gather(1, sampled[:, None]).squeeze(1).cpu()

        round_calls: list[tuple[int, object]] = []
        for j, i in enumerate(active_list):
            row, token = rows[i], int(tokens[j])
            row.tokens.append(token)
            if row.fed:
                row.fed.pop(0)
                row.sampled.append(0)
                row.logprobs.append(0.0)
                if not row.fed:
                    row.segment_start = len(row.tokens)
                continue
            row.sampled.append(1)
            row.logprobs.append(float(logp_of[j]))
            row.model_tokens += 1
            if token in stop_ids and fmt.stops_at_eos:
                row.done = row.eos = True
                continue
            if token < closing.numel() and bool(closing[token]):
                call, overflow = _ended_call(tokenizer, fmt, row.tokens[row.segment_start:])
                if call is not None:
                    if len(row.calls) >= tools.max_calls:
                        row.done = row.hit_call_limit = True
                        continue
                    if row.model_tokens < settings.max_new_tokens:  # a call the model can still read
                        round_calls.append((i, call, overflow))
                        continue
            if row.model_tokens >= settings.max_new_tokens:
                row.done = True
        if round_calls:
            results = run_calls([call for _, call, _ in round_calls], tools)
            for (i, _, overflow), result in zip(round_calls, results):
                rows[i].calls.append(result)
                rendered = fmt.render(result)
                # The call's last token may run past the closer ("</calc><" as one token, the model starting
                # "<result>" itself): feed only the rest of the result then.
                rendered = rendered[len(overflow):] if overflow and rendered.startswith(overflow) else rendered
                rows[i].fed = tokenizer(rendered, add_special_tokens=False)["input_ids"] or [tokenizer.pad_token_id]

        running = torch.tensor([not rows[i].done for i in active_list], device=device)  # (n,)
        if not running.any():
            break
        if not running.all():  # drop finished rows from the decode batch
            keep = running.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            active, tokens, mask, next_position = active[keep], tokens[keep], mask[keep], next_position[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (n, L + 1)
        _grow(cache, mask.shape[1])
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                    use_cache=True, **{_CACHE_ARG: cache})
        next_logits, next_position = out.logits[:, -1], next_position + 1

    length = max(len(row.tokens) for row in rows)
    completion_ids = torch.full((num_rows, length), tokenizer.pad_token_id, dtype=torch.long)  # (N, T)
    completion_mask = torch.zeros((num_rows, length), dtype=torch.long)  # (N, T)
    action_mask = torch.zeros((num_rows, length), dtype=torch.long)  # (N, T)
    sampler_logprobs = torch.zeros((num_rows, length), dtype=torch.float32)  # (N, T)
    for n, row in enumerate(rows):
        k = len(row.tokens)
        completion_ids[n, :k] = torch.tensor(row.tokens)
        completion_mask[n, :k] = 1
        action_mask[n, :k] = torch.tensor(row.sampled)
        sampler_logprobs[n, :k] = torch.tensor(row.logprobs)
    truncated = torch.tensor([not row.eos and not row.hit_call_limit for row in rows])
    texts = [tokenizer.decode(row.tokens, skip_special_tokens=True) for row in rows]
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, group_size, texts,
                   sampler_logprobs, action_mask=action_mask, tool_calls=[row.calls for row in rows])


__all__ = ["generate_with_tools"]
