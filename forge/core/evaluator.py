"""The trainer's default evaluator (what `GRPOTrainer` measures when given no evaluator): one greedy
completion per held-out row, scored by the run's own rewards, so the reward a run learns and the one it
reports cannot drift apart.
"""

from __future__ import annotations

import torch

from forge.core.engine_rollout import generate_on_engine
from forge.core.rollout import SamplingSettings, generate
from forge.core.scoring import (
    Scores,
    completion_token_ids,
    dataset_columns,
    rollout_tool_calls,
    score_completions,
)
from forge.run.rng import capture_rng_state, restore_rng_state
from forge.run.step_stats import completion_metrics
from forge.tools.calls import ToolSettings


def reward_metrics(scores: Scores) -> dict:
    """reward, reward_std and each reward's rewards/<name>/mean and /std (TRL's names) over the valid samples
    (a reward's own over those it applies to), NaN where there are none."""
    def mean_std(values: torch.Tensor) -> tuple[float, float]:
        return (float(values.mean()) if values.numel() else float("nan"),
                float(values.std()) if values.numel() > 1 else 0.0)

    metrics = dict(zip(("reward", "reward_std"), mean_std(scores.total[scores.valid])))
    for name, values in scores.components.items():
        applies = scores.valid & scores.applies.get(name, torch.ones_like(scores.valid))
        metrics[f"rewards/{name}/mean"], metrics[f"rewards/{name}/std"] = mean_std(values[applies])
    return metrics


def greedy_reward_evaluator(rewards: list, config, tools: ToolSettings | None = None, engine=None):
    """The trainer's default evaluator: one greedy completion per held-out row, scored by the run's own
    rewards, in TRL's names (reward, reward_std, rewards/<name>/mean and /std, completions/*; n: the rows;
    GRPOTrainer.evaluate adds the eval_ prefix), with the run's tools when it has them, on the run's
    vLLM `engine` when it has one (forge/core/engine_rollout.py). The global RNG state is restored afterwards,
    so evaluating mid-run does not change later samples."""

    @torch.no_grad()
    def evaluate(model, tokenizer, rows: list[dict], *, max_new_tokens: int, max_prompt_length: int) -> dict:
        rng_state, was_training = capture_rng_state(), model.training
        model.eval()
        settings, prompts = SamplingSettings(max_new_tokens, do_sample=False), [row["prompt"] for row in rows]
        completions, ids, calls, episodes, truncated = [], [], [], [], []
        for start in range(0, len(rows), 32):
            chunk, chunk_rows = prompts[start:start + 32], rows[start:start + 32]
            rollout = generate(model, tokenizer, chunk, 1, settings, max_prompt_length,
                               config.truncate_prompts, config.share_prompt_prefix, tools=tools,
                               rows=chunk_rows) if engine is None \
                else generate_on_engine(engine, tokenizer, chunk, 1, settings, max_prompt_length,
                                        config.truncate_prompts, tools=tools, rows=chunk_rows)
            completions += rollout.completions
            ids += completion_token_ids(rollout)
            truncated.append(rollout.truncated.float())
            calls += rollout_tool_calls(rollout) or []
            episodes += rollout.episodes or []
        scores = score_completions(rewards, prompts, completions, dataset_columns(rows),
                                   on_error=config.on_reward_error, error_value=config.reward_error_value,
                                   timeout=config.reward_timeout, completion_ids=ids,
                                   tool_calls=calls if tools is not None else None,
                                   environments=[e.environment for e in episodes] if episodes else None,
                                   episodes=episodes or None)
        restore_rng_state(rng_state)
        model.train(was_training)
        lengths = torch.tensor([float(len(one)) for one in ids])  # (N,)
        return {**reward_metrics(scores), **completion_metrics(lengths, torch.cat(truncated)), "n": len(rows)}

    return evaluate


__all__ = ["greedy_reward_evaluator", "reward_metrics"]
