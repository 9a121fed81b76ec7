"""Tools and environments in a decode loop: the hook of forge/core/rollout.py's `decode` (and of the serving
engine's rounds, forge/core/engine_rollout.py).

A completion that ends a call is fed the result's tokens while the others go on sampling (ToolTurns); the
calls run through forge/tools (`run_calls`), an environment's episodes through forge/envs. `decodings` are the
loop's completions being decoded (forge/core/rollout.py `ToolDecoding`: tokens, budget, calls, episode).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forge.envs.protocol import EnvironmentSettings, Episode, with_opening
from forge.model.kv_cache import CACHE_ARG, LAST_POSITION
from forge.tools.calls import CallFormat, ToolSettings, call_format, closing_token_ids, ended_call, run_calls

TRUNCATION_MARKER = " [truncated: token budget]"  # ends a fed result cut to the completion's token budget


class ToolTurns:
    """Tools or an environment in a decode loop. When a completion's text ends a call (CallFormat), the calls
    of that decode step run together, each with its timeout; each result is rendered, tokenized and *fed* to
    its completion in the next forward, all its tokens in that one pass, while the others go on sampling
    (inputs of unequal length are left-padded within the step). A completion is then one interleaved sequence
    (model text, result, model text, ...); `Rollout.action_mask` marks the sampled tokens, and only those
    count towards max_new_tokens. Sampled and fed tokens together count towards `tools.max_episode_tokens`,
    and prompt + completion never pass the model's context: a result that does not fit is cut, ends with
    TRUNCATION_MARKER, and ends the completion. A completion also ends at a call beyond `tools.max_calls`
    (left unanswered), and when its environment ends the episode. With no call made and no opening
    observation, the tokens are those sampled without tools (the noise is indexed by sampled tokens).

    An environment (EnvironmentSettings) gives one episode per completion, reset with its prompt's dataset row
    (`rows`), and the prompts open with its first observation (`self.prompts`)."""

    def __init__(self, tools: ToolSettings | EnvironmentSettings, prompts: Sequence[str | list[dict]],
                 rows: Sequence[dict] | None, group_size: int, tokenizer, fmt: CallFormat | None = None):
        self.tools, self.episodes, self.prompts = start_episodes(tools, prompts, rows, group_size)
        self.fmt = fmt or call_format(self.tools.format, self.tools.tools, tokenizer)
        # templates' schemas
        self.schemas = [t.schema for t in self.tools.tools] if self.fmt.kind == "template" else None
        # (V,) tokens after which a call may end
        self.closing = closing_token_ids(tokenizer, self.fmt.closers)
        self.budget = self.tools.max_episode_tokens or 10**9
        self.tokenizer = tokenizer

    def episode(self, n: int) -> Episode | None:
        return None if self.episodes is None else self.episodes[n]

    def ended_call(self, decoding, tokens: list[int], max_new_tokens: int) -> tuple | None:
        """(call, overflow) when the tokens just taken end a call the model can still read the result of; a
        call past tools.max_calls ends the completion unanswered."""
        last = tokens[-1] if tokens else None
        if decoding.eos or last is None or last >= self.closing.numel() or not bool(self.closing[last]):
            return None
        call, overflow = ended_call(self.tokenizer, self.fmt, decoding.tokens[decoding.segment_start:])
        if call is None:
            return None
        if self.tools.max_calls is not None and len(decoding.calls) >= self.tools.max_calls:
            decoding.done = decoding.hit_call_limit = True
            return None
        return None if decoding.done else (call, overflow)  # done: no budget left to read a result

    def answer(self, decodings: list, taken: Sequence[tuple[int, list[int]]], max_new_tokens: int) -> None:
        """Answer the calls that the tokens just taken, (index, tokens) per completion, ended."""
        round_calls = []
        for i, tokens in taken:
            call = self.ended_call(decodings[i], tokens, max_new_tokens)
            if call is not None:
                round_calls.append((i, *call))
        if round_calls:
            answer_calls(round_calls, decodings, self.tools, self.fmt, self.tokenizer)

    def forward(self, model, cache, decodings: list, active: torch.Tensor, tokens: torch.Tensor,
                mask: torch.Tensor, next_position: torch.Tensor):
        """One forward of every running completion's sampled token and, where a call was answered, its
        result's tokens, left-padded to the widest: (next-token logits (n, V), mask (n, L + width), next
        positions (n,))."""
        device = tokens.device
        inputs = [[token] + decodings[i].fed for i, token in zip(active.tolist(), tokens.tolist())]
        width = max(len(ids) for ids in inputs)
        lengths = torch.tensor([len(ids) for ids in inputs], device=device)  # (n,)
        step_ids = torch.full((len(inputs), width), self.tokenizer.pad_token_id, dtype=torch.long,
                              device=device)
        for j, ids in enumerate(inputs):
            step_ids[j, width - len(ids):] = torch.tensor(ids, device=device)
        # (n, width), <0 = pad
        offsets = torch.arange(width, device=device)[None, :] - (width - lengths[:, None])
        mask = torch.cat([mask, (offsets >= 0).long()], dim=1)  # (n, L + width)
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=next_position[:, None] + offsets.clamp(min=0),
            use_cache=True,
            logits_to_keep=LAST_POSITION,
            **{CACHE_ARG: cache},
        )
        return out.logits[:, -1], mask, next_position + lengths


def start_episodes(tools, prompts: Sequence[str | list[dict]], rows: Sequence[dict] | None, group_size: int):
    """(tools, episodes, prompts): for an environment, its tools, one episode per completion reset with its
    dataset row, and the prompts with their opening observation; plain tools pass through unchanged."""
    if not isinstance(tools, EnvironmentSettings):
        return tools, None, prompts
    episodes = tools.start(rows if rows is not None else [{"prompt": p} for p in prompts], group_size)
    opened = [with_opening(p, episodes[i * group_size].opening) for i, p in enumerate(prompts)]
    return tools.tools, episodes, opened


def answer_calls(round_calls: list, decodings: list, tools: ToolSettings, fmt: CallFormat,
                 tokenizer) -> None:
    """Run the calls of one decode step together; give each completion its result's tokens to feed, cut to its
    token budget (then marked and ending it); an environment that ended its episode ends the completion."""
    toolboxes = None
    if decodings[round_calls[0][0]].episode is not None:
        toolboxes = [decodings[i].episode.toolbox for i, _, _ in round_calls]
    results = run_calls([call for _, call, _ in round_calls], tools, toolboxes=toolboxes)
    for (i, _, overflow), result in zip(round_calls, results):
        decoding = decodings[i]
        decoding.calls.append(result)
        if decoding.episode is not None:
            EnvironmentSettings.settle(decoding.episode, failed=result.failure is not None)
            decoding.done = decoding.ended = decoding.episode.done
        rendered = fmt.render(result)
        # The call's last token may run past the closer ("</calc><" as one token, the model starting
        # "<result>" itself): feed only the rest of the result then.
        rendered = rendered[len(overflow):] if overflow and rendered.startswith(overflow) else rendered
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"] or [tokenizer.pad_token_id]
        room = decoding.limit - len(decoding.tokens)
        if len(ids) > room:
            marker = tokenizer(TRUNCATION_MARKER, add_special_tokens=False)["input_ids"]
            ids = (ids[:max(room - len(marker), 0)] + marker)[:room]
            decoding.done = True
        decoding.feed(ids)
        decoding.done = decoding.done or len(decoding.tokens) >= decoding.limit
