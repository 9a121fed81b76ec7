"""A/B in one process: the reference pass over the completions with a loss token (what a step runs) against the
same pass over every completion, on the demo's recipe with a KL term (kl_beta 0.04) and its flat groups dropped
(`drop_zero_std_groups`, the demo's default). Each step trains as usual; before its update both passes run on its
rollout, alternating A B / B A, and the log-probs of the kept completions must be the same. Process CPU seconds.

    python bench/reference_rows.py [THREADS] [STEPS]       # e.g. 1 8 (defaults: 1 thread, 6 steps)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main(threads: int, steps: int) -> None:
    from forge.core.trainer import GRPOTrainer
    from forge.data.arithmetic import arithmetic_dataset
    from forge.demo import DemoSettings, demo_config, demo_rewards
    from forge.model import load_model
    from forge.run.optim import make_scheduler

    torch.set_num_threads(threads)
    settings = DemoSettings(seed=0)
    rows = arithmetic_dataset(n=steps * settings.prompts_per_step, seed=0, chat=True)  # the demo's rows
    base, tokenizer = load_model("default")
    config = demo_config(settings, "/tmp/forge_reference_rows", kl_beta=0.04, preflight="off", eval_steps=0)
    trainer = GRPOTrainer(base, tokenizer, demo_rewards(), config)
    trainer.scheduler = make_scheduler(trainer.optimizer, "constant", 0.0, steps)
    times, kept, total = {"loss rows": [], "every row": []}, 0, 0
    for step in range(steps):
        batch, _ = trainer.collect(rows[step * settings.prompts_per_step:(step + 1) * settings.prompts_per_step])
        for r, rollout in enumerate(batch.rollouts):
            indices = batch.loss_indices[r]
            kept, total = kept + len(indices), total + rollout.completion_ids.shape[0]
            order = ("loss rows", "every row") if step % 2 == 0 else ("every row", "loss rows")
            results = {}
            for name in order:
                start = time.process_time()
                results[name] = trainer.reference_logprobs(rollout, indices if name == "loss rows" else None)
                times[name].append(time.process_time() - start)
            assert torch.allclose(results["loss rows"][indices], results["every row"][indices], atol=1e-5)
        trainer.update(batch)
        print(f"step {step + 1}: {len(batch.loss_indices[0])} of {batch.rollouts[0].completion_ids.shape[0]} "
              f"completions kept; reference pass {times['loss rows'][-1]:.2f} s against "
              f"{times['every row'][-1]:.2f} s", flush=True)
    ratio = sum(times["loss rows"]) / sum(times["every row"])
    print(f"\n{kept} of {total} completions had a loss token ({kept / total:.0%}); the reference pass took "
          f"{sum(times['loss rows']):.1f} CPU s against {sum(times['every row']):.1f} over every completion "
          f"({ratio:.2f}x; per step, median {statistics.median(times['loss rows']):.2f} s against "
          f"{statistics.median(times['every row']):.2f} s), precision {trainer.precision.compute}, "
          f"{threads} thread(s)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
