"""A/B in one process: the demo's loss pass with one group per micro-batch (8, the demo's) against all of a step's
carrying rows in one micro-batch (0, which computes the prompts' shared template once but pads every row to
the step's longest completion). Same model, recipe, rows and sampling seed on both sides, steps alternating
A B / B A, process CPU seconds per step.

    python bench/micro_batching.py [THREADS] [STEPS]       # e.g. 1 8 (defaults: 1 thread, 6 steps)
"""

from __future__ import annotations

import copy
import sys
import time

import torch

SIZES = (8, 0)  # micro_batch_size: one group of the demo's 8 completions, or the whole step at once


def main(threads: int, steps: int) -> None:
    from forge.core.trainer import GRPOTrainer
    from forge.data.arithmetic import arithmetic_dataset
    from forge.demo import DemoSettings, demo_config, demo_rewards
    from forge.model import load_model
    from forge.run.optim import make_scheduler

    torch.set_num_threads(threads)
    settings = DemoSettings(seed=0)
    rows = arithmetic_dataset(n=settings.steps * settings.prompts_per_step, seed=0, chat=True)  # the demo's rows
    base, tokenizer = load_model("default")
    trainers = {}
    for size in SIZES:
        config = demo_config(settings, f"/tmp/forge_micro_batching_{size}", micro_batch_size=size, eval_steps=0)
        trainer = GRPOTrainer(copy.deepcopy(base), tokenizer, demo_rewards(), config)
        # step() is called directly, outside train(), which is where the scheduler is normally built
        trainer.scheduler = make_scheduler(trainer.optimizer, "constant", 0.0, settings.steps)
        trainers[size] = trainer
    results = {size: [] for size in SIZES}
    per_step = settings.prompts_per_step
    for i in range(steps):
        for size in (SIZES if i % 2 == 0 else SIZES[::-1]):
            torch.manual_seed(1000 + i)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            metrics = trainers[size].step(rows[per_step * i: per_step * (i + 1)])
            results[size].append({"cpu": time.process_time() - cpu0, "wall": time.perf_counter() - wall0,
                                  "gen": metrics.get("generation_share"), "loss": metrics["loss"],
                                  "kept": 1 - metrics.get("frac_reward_zero_std", 0)})
        print(i, {size: {k: round(v, 4) if isinstance(v, float) else v for k, v in results[size][-1].items()}
                  for size in SIZES}, flush=True)
    cpu = {size: sum(r["cpu"] for r in results[size]) for size in SIZES}
    for size in SIZES:
        print(f"micro_batch_size={size}: {cpu[size]:.1f} CPU s, {sum(r['wall'] for r in results[size]):.1f} s wall")
    print(f"ratio (0 / 8) on CPU time: {cpu[0] / cpu[8]:.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1, int(sys.argv[2]) if len(sys.argv) > 2 else 6)
