"""Rollouts sampled on a serving engine (`generation_backend="vllm"`, forge/model/vllm_engine.py) instead of
Forge's own decode loop: the same prompts rendered and tokenized by Forge, the same Rollout out.

A step's sampling noise (forge/core/rollout.py `sampling_noise`, drawn from (seed, step)) gives each prompt's
request its seed, so the engine's draws depend on the run's seed and step only, on 1 or N processes alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forge.core.rollout import Prompt, Rollout, SamplingSettings, eos_ids, sampled_rollout, tokenize_prompts
from forge.model.vllm_engine import MODES, ColocatedEngine, EngineSampling, ServerEngine


def open_engine(config, model, tokenizer, compute: torch.dtype, world_size: int = 1, tools=None):
    """The run's engine (GRPOConfig.vllm_mode): started from the policy's weights, or a running server."""
    if tools is not None:
        raise ValueError("tools and environments decode with Forge's own loop (a call's result is fed in the "
                         "middle of a completion); leave generation_backend at 'auto' for this run")
    stop_ids = eos_ids(tokenizer, model)
    if config.vllm_mode not in MODES:
        raise ValueError(f"vllm_mode={config.vllm_mode!r}: use one of {', '.join(MODES)}")
    if config.vllm_mode == "server":
        url = config.vllm_server_base_url or f"http://{config.vllm_server_host}:{config.vllm_server_port}"
        return ServerEngine(url, stop_ids, compute, model, weights_dir=f"{config.output_dir}/vllm-weights",
                            timeout=config.vllm_server_timeout)
    if world_size > 1:
        raise ValueError("vllm_mode='colocate' starts one engine per process; with several training processes "
                         "run one `forge vllm-serve` and set vllm_mode='server' (docs/scaling.md)")
    context = getattr(model.config, "max_position_embeddings", None) or 4096
    return ColocatedEngine(model, compute, stop_ids, max_rows=config.prompts_per_step * config.group_size,
                           max_new_tokens=config.max_new_tokens, max_model_len=context,
                           enforce_eager=config.vllm_enforce_eager,
                           gpu_memory_utilization=config.vllm_gpu_memory_utilization, seed=config.seed)


def request_seeds(noise: torch.Tensor, group_size: int) -> list[int]:
    """(P,) seeds from a step's (P * G, T) uniforms: the first draw of each group's first row, as an integer."""
    return [int(u * 2**62) for u in noise[::group_size, 0].tolist()]


def generate_on_engine(engine, tokenizer, prompts: Sequence[Prompt], group_size: int, settings: SamplingSettings,
                       max_prompt_length: int = 10**9, truncate_prompts: str = "error",
                       noise: torch.Tensor | None = None) -> Rollout:
    """`group_size` completions for every prompt from the engine, as a Rollout (rollout.generate's contract:
    completions end at the first stop token, sampler log-probs of the sampled tokens, `truncated` when none)."""
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, truncate_prompts)  # (P, Lp)
    own_tokens = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]  # padding dropped
    sampling = EngineSampling(settings.max_new_tokens, settings.temperature, settings.top_p, settings.top_k,
                              greedy=not settings.do_sample)
    groups = engine.sample(own_tokens, group_size, sampling, None if noise is None else request_seeds(noise, group_size))
    samples = [(s.token_ids, s.logprobs, s.stopped) for group in groups for s in group]  # (N,)
    return sampled_rollout(samples, prompt_ids, prompt_mask, group_size, settings.max_new_tokens, tokenizer)
