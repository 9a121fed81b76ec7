"""Write your own reward three ways: a BaseReward subclass, a plain function, and a CompositeReward of both.

A reward scores a batch: reward(prompts, completions, **columns) -> one float per completion. Dataset columns
other than "prompt" arrive as keyword arguments ("reference" as references=...), and each reward gets only the
ones its signature names, so `def __call__(self, prompts, responses, keywords)` receives the "keywords" column.

Runs offline in seconds: 2 GRPO steps on the tiny random model Forge's tests use (its completions are noise,
the point is the plumbing). Point --model at a hub id or local folder to train a real model.

    python examples/custom_reward.py
    python examples/custom_reward.py --model HuggingFaceTB/SmolLM2-135M-Instruct --steps 50
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from forge import BaseReward, CompositeReward, GRPOConfig, GRPOTrainer, RewardOutput


class KeywordReward(BaseReward):
    """Template for a class reward: the fraction of a row's keywords the response mentions (case-insensitive).

    `name` (the logging key) defaults to the class name in snake case without "Reward": "keyword".
    Return a RewardOutput; its metadata is free-form and handy for debugging.
    """

    def __init__(self, default_keywords: list[str] | None = None) -> None:
        self.default_keywords = default_keywords or ["answer"]

    def __call__(self, prompts, responses, keywords=None, **kwargs) -> RewardOutput:
        keywords = keywords if keywords is not None else [self.default_keywords] * len(responses)
        scores, found = [], []
        for response, wanted in zip(responses, keywords):
            hits = [word for word in wanted if word.lower() in response.lower()]
            scores.append(len(hits) / max(1, len(wanted)))
            found.append(hits)
        return RewardOutput(scores=scores, metadata={"found": found})


def brevity(prompts, completions, **kwargs) -> list[float]:
    """Template for a function reward (TRL style): 1.0 for an empty completion, falling to 0 at 60 characters."""
    return [max(0.0, 1.0 - len(text) / 60) for text in completions]


def build_reward() -> CompositeReward:
    """One reward from two: weights are normalised, so this is (2 * keyword + 1 * brevity) / 3.

    To log each part separately instead, give the trainer a list:
        GRPOTrainer(..., reward_fn=[KeywordReward(), brevity], config=GRPOConfig(reward_weights=[2.0, 1.0]))
    """
    return CompositeReward([(KeywordReward(), 2.0), (brevity, 1.0)])


ROWS = [
    {"prompt": "Name two colours of the sky.", "keywords": ["blue", "grey"]},
    {"prompt": "What is 12 + 7? Reply with the answer.", "keywords": ["19"]},
    {"prompt": "Say yes or no: is 5 a number?", "keywords": ["yes"]},
    {"prompt": "Give the total of 3 and 4.", "keywords": ["7", "total"]},
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (offline, random weights), a hub id or a folder")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output_dir", default="custom_reward_output")
    args = parser.parse_args(argv)

    reward = build_reward()
    sample = reward(["p", "p"], ["The sky is blue.", "no idea, let me think about it for a while..."],
                    keywords=[["blue", "grey"], ["blue", "grey"]])
    print(f"composite on two responses: {[round(s, 3) for s in sample.scores]}  parts: {sample.metadata['components']}")

    if args.model == "tiny":
        from forge.model.tiny import build_tiny_model

        model, tokenizer = build_tiny_model(seed=0)
    else:
        import forge

        model, tokenizer = forge.load_model(args.model)
    config = GRPOConfig(group_size=4, prompts_per_step=2, gradient_accumulation_steps=1, max_new_tokens=16,
                        max_steps=args.steps, learning_rate=1e-3 if args.model == "tiny" else 1e-5,
                        logging_steps=1, save_steps=0, output_dir=args.output_dir)
    trainer = GRPOTrainer(model=model, tokenizer=tokenizer, reward_fn=reward, config=config)
    trainer.train(ROWS)

    log = [json.loads(line) for line in (Path(args.output_dir) / "training_log.jsonl").read_text().splitlines()]
    print(f"trained {trainer.global_step} steps; mean reward per step: {[round(row['reward'], 3) for row in log]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
