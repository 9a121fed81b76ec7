"""Cost of an environment against tools doing the same work: seconds per optimizer step, same run otherwise.

Both runs script every completion to open with three calls (`<add>3</add>` three times; the tiny model then
samples on): with tools, a stateless `add` that returns a fixed text; with the environment, a `Counter` whose
`add` keeps a running total (one instance per completion, reset with its row). The answers have the same
length, so the token work is the same and the difference is the environment's own cost (instances, resets,
per-call tool tables).

    python bench/env_vs_tools.py --steps 6 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "units"))

from test_tools import install_script

from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model

ROWS = [{"prompt": f"Add ({k}): ", "start": 10 + k} for k in range(8)]
SCRIPT = "<add>3</add><add>3</add><add>3</add>"


def add(amount: str) -> str:
    """Add to a total (stateless: always answers 13).

    Args:
        amount: the number to add
    """
    return "13"


class Counter:
    def reset(self, start: int = 10, **row):
        self.total = 10

    def add(self, amount: str) -> str:
        """Add to the running total and return it.

        Args:
            amount: the number to add
        """
        self.total = 10 + int(amount)  # the same two digits as the tool's answer
        return str(self.total)


def seconds_per_step(kind: str, steps: int) -> float:
    model, tokenizer = build_tiny_model(seed=0)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(group_size=8, prompts_per_step=4, gradient_accumulation_steps=1, max_new_tokens=48,
                            max_steps=steps, save_steps=0, logging_steps=1, preflight="off", tool_format="text",
                            max_tool_calling_iterations=3, output_dir=out)
        reward = [lambda prompts, completions, **kw: [len(t) % 5 / 4 for t in completions]]
        trainer = GRPOTrainer(model, tokenizer, reward, config, tools=[add] if kind == "tools" else None,
                              environment_factory=Counter if kind == "environment" else None)
        started = time.perf_counter()
        trainer.train(ROWS * steps)
        return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    install_script(setattr)(build_tiny_model(seed=0)[1], SCRIPT)
    times = {"tools": [], "environment": []}
    for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits both
        for kind, values in times.items():
            values.append(seconds_per_step(kind, args.steps))
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    print(json.dumps({"seconds_per_step": medians, "all": times,
                      "environment_over_tools": medians["environment"] / medians["tools"]}, indent=2))


if __name__ == "__main__":
    main()
