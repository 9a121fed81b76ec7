"""`forge demo --env`: GRPO teaches the packaged SmolLM2-135M-Instruct to act on what an environment tells it.

The environment is guess-the-number (forge/envs/guess.py): a hidden number from 1 to `high`, a few guesses,
each wrong one answered with the direction, the numbers left and their middle. The prompt states the rules and
shows one worked game. The game is won by reading the answers: a policy that ignores them finds the number at
most turns/high of the time. So every policy is measured twice on the same held-out episodes (greedy): with
the real answers, and with answers about a decoy number. Success with real answers above success with the
decoy's is success *because of* the answers. Training: LoRA GRPO, one GuessNumber per completion, its
`get_reward` as the reward (1 when found; otherwise up to 0.5 for the share of the range the answers ruled
out); the answers are fed to the model and masked out of the loss. Held-out episodes are ranges the
training never sees.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import torch

from forge.core.rollout import SamplingSettings, generate
from forge.core.trainer import GRPOTrainer
from forge.demo import DemoRun, DemoSettings, _machine, demo_config, load_policy
from forge.envs import EnvironmentSettings
from forge.envs.guess import GuessNumber, NoisyGuessNumber, guess_rows
from forge.tools.calls import ToolSettings

TRAIN_HIGHS = [8, 10, 12, 14]  # ranges of the training episodes
HELDOUT_HIGHS = [9, 11, 13, 15]  # ranges of the held-out episodes (never trained on)
TURNS = 4  # guesses per episode: bisection finds any number up to 15
ENTROPY_FLOOR = {"adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 0.3,
                 "entropy_coef_delta": 0.01}
"""The recipe's entropy floor (GRPOConfig.adaptive_entropy, Skywork-OR1's control): while a step's mean token
entropy is at or below 0.3 nats the loss adds an entropy bonus whose coefficient starts at 0.01 and rises by
0.01 a step. Without it one seed of five (AMX Xeon) settled on a way of playing that skips middles it is told
(45.8% of the held-out games); with it each of the five found at least 77% (docs/environments.md)."""


def env_settings(factory) -> EnvironmentSettings:
    """The game as the demo's rollouts run it, in training and evaluation: text protocol, TURNS guesses."""
    return EnvironmentSettings.of(factory, ToolSettings([], "text", max_calls=TURNS, timeout=5.0))


@torch.no_grad()
def evaluate_episodes(model, tokenizer, rows: list[dict], factory, *, max_new_tokens: int) -> dict:
    """Greedy episodes on rows: the share found, guesses per episode, and a few transcripts."""
    was_training = model.training
    model.eval()
    rollout = generate(
        model,
        tokenizer,
        [row["prompt"] for row in rows],
        1,
        SamplingSettings(max_new_tokens, do_sample=False),
        tools=env_settings(factory),
        rows=rows,
    )
    model.train(was_training)
    found = [bool(e.environment is not None and e.environment.found) for e in rollout.episodes]
    turns = [e.turns for e in rollout.episodes]
    return {"success": sum(found) / len(rows), "turns_per_episode": sum(turns) / len(rows), "n": len(rows),
            "examples": rollout.completions[:3]}


def run_env_demo(settings: DemoSettings) -> dict:
    """The --env path of `forge demo`."""
    run = DemoRun(settings, "forge demo --env")
    model, tokenizer, precision = load_policy(settings)
    heldout = guess_rows(HELDOUT_HIGHS, TURNS, seed=1000)[:settings.heldout]
    train = guess_rows(TRAIN_HIGHS, TURNS, repeats=8, seed=settings.seed)
    run.timings["load"] = run.elapsed()

    def measured(phase: str, model) -> dict:
        with run.timed(phase), precision.autocast(model):
            return {feedback: evaluate_episodes(model, tokenizer, heldout, factory,
                                                max_new_tokens=settings.max_new_tokens)
                    for feedback, factory in (("real", GuessNumber), ("noise", NoisyGuessNumber))}

    run.say(
        f"base model on {len(heldout)} held-out episodes (ranges {HELDOUT_HIGHS}), greedy, real and noise "
        f"feedback"
    )
    before = measured("base_eval", model)
    run.say(_line("base", before))
    config = demo_config(settings, run.out, reward_weights=None, max_tool_calling_iterations=TURNS,
                         tool_format="text", tool_timeout=5.0, **ENTROPY_FLOOR)
    trainer = GRPOTrainer(model, tokenizer, [], config, environment_factory=GuessNumber)
    run.say(f"training: {settings.steps} steps x {settings.prompts_per_step} prompts x {settings.group_size} "
            f"episodes, LoRA r={settings.lora_r}, lr {settings.learning_rate}")
    with run.timed("training"):
        trainer.train(train)
    after = measured("final_eval", trainer.model)
    run.say(_line("trained", after))
    run.timings["total"] = run.elapsed()
    result = {"settings": asdict(settings), "heldout_size": len(heldout), "heldout_highs": HELDOUT_HIGHS,
              "train_highs": TRAIN_HIGHS, "turns": TURNS, "before": before, "after": after,
              "gain": after["real"]["success"] - before["real"]["success"],
              "feedback_effect_trained": after["real"]["success"] - after["noise"]["success"],
              "feedback_effect_base": before["real"]["success"] - before["noise"]["success"],
              "timings": run.timings, "machine": _machine() | {"precision": str(precision.compute)}}
    (run.out / "demo_env_result.json").write_text(json.dumps(result, indent=2))
    print(f"\n{'':>8} | real feedback | noise feedback | guesses/episode (real)\n" + "\n".join(
        f"{label:>8} | {m['real']['success']:13.1%} | {m['noise']['success']:14.1%} | "
        f"{m['real']['turns_per_episode']:.2f}" for label, m in (("base", before), ("trained", after)))
          + f"\nresult: {run.out / 'demo_env_result.json'}  ({run.timings['total']:.0f}s)")
    return result


def _line(label: str, measured: dict) -> str:
    real, noise = measured["real"], measured["noise"]
    return (f"{label}: found {real['success']:.1%} with the answers, {noise['success']:.1%} with noise; "
            f"{real['turns_per_episode']:.2f} guesses per episode")
