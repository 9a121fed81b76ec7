"""Rollouts sampled on a serving engine (`generation_backend="vllm"`, forge/model/vllm_engine.py) instead of
Forge's own decode loop: the same prompts rendered and tokenized by Forge, the same Rollout out.

A step's sampling noise (forge/core/rollout.py `sampling_noise`, drawn from (seed, step)) gives each prompt's
request its seed, so the engine's draws depend on the run's seed and step only, on 1 or N processes alike.

With tools or an environment, each completion is its own request and stops at a stop token or at a token that
may close a call (the own loop's `closing_token_ids`); a completed call is answered as the own loop answers it
(`answer_calls`: timeouts, budgets, truncation marker, the environment's end), its result's tokens appended,
and the completion so far is sent back as token ids, so nothing the model sampled is ever re-tokenized. The
masks and budgets are the own loop's: `action_mask` marks the sampled tokens, only they count towards
max_new_tokens, and sampled and fed tokens together towards max_episode_tokens and the model's context.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forge.core.config import require_vllm
from forge.core.rollout import (
    Prompt,
    Rollout,
    SamplingSettings,
    ToolDecoding,
    as_rollout,
    eos_ids,
    sampled_rollout,
    tokenize_prompts,
)
from forge.core.tool_turns import ToolTurns
from forge.envs.protocol import EnvironmentSettings
from forge.logging.logger import note
from forge.model.vllm_engine import MODES, PUSHED_WEIGHTS, ColocatedEngine, EngineSampling, ServerEngine
from forge.tools.calls import ToolSettings


def open_engine(config, model, tokenizer, compute: torch.dtype, dist=None, worker: bool = False):
    """The run's engine (GRPOConfig.vllm_mode), or None when the run samples with the own loop: started from
    the policy's weights, or a running server that the processes of the run (`dist`, forge/parallel) share:
    the first pushes each step's weights, the others wait. Async GRPO (max_staleness set): the rollout
    worker's server (`worker`), and None in the trainer, which evaluates with the own loop
    (forge/core/rollout_worker.py)."""
    if config.generation_backend != "vllm" or (config.max_staleness is not None and not worker):
        return None
    if config.vllm_mode not in MODES:
        raise ValueError(f"vllm_mode={config.vllm_mode!r}: use one of {', '.join(MODES)}")
    if config.vllm_mode == "server":
        url = config.vllm_server_base_url or f"http://{config.vllm_server_host}:{config.vllm_server_port}"
        engine = ServerEngine(
            url,
            eos_ids(tokenizer, model),
            compute,
            context_of(model),
            weights_dir=f"{config.output_dir}/{PUSHED_WEIGHTS}",
            timeout=config.vllm_server_timeout,
            pushes=dist is None or dist.is_main,
            after_push=None if dist is None else dist.barrier,
        )
        note(f"vLLM server at {url}: weights pushed through {config.output_dir}/{PUSHED_WEIGHTS}")
        return engine
    if dist is not None and dist.world_size > 1:
        raise ValueError(
            "vllm_mode='colocate' starts one engine per process; with several training processes "
            "run one `forge vllm-serve` and set vllm_mode='server' (docs/scaling.md)"
        )
    return colocated_engine(model, tokenizer, compute, config.prompts_per_step * config.group_size,
                            config.max_new_tokens, enforce_eager=config.vllm_enforce_eager,
                            gpu_memory_utilization=config.vllm_gpu_memory_utilization, seed=config.seed)


def colocated_engine(model, tokenizer, compute: torch.dtype, max_rows: int, max_new_tokens: int,
                     **options) -> ColocatedEngine:
    """An engine in this process started from `model`'s weights, stopping where Forge's own loop stops;
    options: enforce_eager, gpu_memory_utilization, seed (ColocatedEngine)."""
    require_vllm()
    return ColocatedEngine(model, compute, eos_ids(tokenizer, model), max_rows=max_rows,
                           max_new_tokens=max_new_tokens, context=context_of(model), **options)


def context_of(model) -> int:
    """The model's context: prompt + completion never pass it."""
    return getattr(model.config, "max_position_embeddings", None) or 4096


def engine_sampling(settings: SamplingSettings) -> EngineSampling:
    """A generation's SamplingSettings as the engine takes them (do_sample=False: greedy)."""
    return EngineSampling(settings.max_new_tokens, settings.temperature, settings.top_p, settings.top_k,
                          greedy=not settings.do_sample)


def request_seeds(noise: torch.Tensor, group_size: int) -> list[int]:
    """(P,) seeds from a step's (P * G, T) uniforms: the first draw of each group's first row, as an
    integer."""
    return [int(u * 2**62) for u in noise[::group_size, 0].tolist()]


def generate_on_engine(
    engine,
    tokenizer,
    prompts: Sequence[Prompt],
    group_size: int,
    settings: SamplingSettings,
    max_prompt_length: int = 10**9,
    truncate_prompts: str = "error",
    noise: torch.Tensor | None = None,
    tools: ToolSettings | EnvironmentSettings | None = None,
    rows: Sequence[dict] | None = None,
) -> Rollout:
    """`group_size` completions for every prompt from the engine, as a Rollout (rollout.generate's contract:
    completions end at the first stop token, sampler log-probs of the sampled tokens, `truncated` when none;
    with tools or an environment, reset with the prompts' dataset `rows`: calls answered as the own loop
    does)."""
    if tools is not None:
        return _with_tools(
            engine,
            tokenizer,
            prompts,
            group_size,
            settings,
            max_prompt_length,
            truncate_prompts,
            noise,
            tools,
            rows,
        )
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length,
                                               truncate_prompts)  # (P, Lp)
    own_tokens = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]  # padding dropped
    groups = engine.sample(own_tokens, group_size, engine_sampling(settings),
                           None if noise is None else request_seeds(noise, group_size))
    samples = [(s.token_ids, s.logprobs, s.stopped) for group in groups for s in group]  # (N,)
    return sampled_rollout(samples, prompt_ids, prompt_mask, group_size, settings.max_new_tokens, tokenizer)


def _with_tools(engine, tokenizer, prompts, group_size, settings, max_prompt_length, truncate_prompts, noise,
                tools, rows) -> Rollout:
    """generate_on_engine with tools or an environment: rounds of sampling until every completion is done."""
    turns = ToolTurns(tools, prompts, rows, group_size, tokenizer)
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, turns.prompts, max_prompt_length, truncate_prompts,
                                               tools=turns.schemas)  # (P, Lp)
    own_tokens = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
    stops = sorted(set(turns.closing.nonzero().squeeze(1).tolist())
                   | (set(engine.stop_ids) if turns.fmt.stops_at_eos else set()))
    decodings = [
        ToolDecoding(min(turns.budget, engine.context - len(own_tokens[n // group_size])), turns.episode(n),
                     turns.fmt.stops_at_eos)
        for n in range(len(turns.prompts) * group_size)
    ]
    sampling = engine_sampling(settings)
    # each round: every running completion samples up to its next stop; calls answered
    for turn in range(10**9):
        active = [n for n, decoding in enumerate(decodings) if not decoding.done]
        if not active:
            break
        seeds = None if noise is None else request_seeds(noise[active, min(turn, noise.shape[1] - 1):], 1)
        samples = engine.sample(
            [own_tokens[n // group_size] + decodings[n].tokens for n in active],
            1,
            sampling,
            seeds,
            max_tokens=[
                min(
                    settings.max_new_tokens - decodings[n].model_tokens,
                    decodings[n].limit - len(decodings[n].tokens),
                )
                for n in active
            ],
            stop_ids=stops,
        )
        for n, (sample,) in zip(active, samples):
            decodings[n].take(sample.token_ids, sample.logprobs, engine.stop_ids, settings.max_new_tokens)
        turns.answer(decodings, [(n, sample.token_ids) for n, (sample,) in zip(active, samples)],
                     settings.max_new_tokens)
    return as_rollout(decodings, prompt_ids, prompt_mask, group_size, settings.max_new_tokens, tokenizer,
                      True)
