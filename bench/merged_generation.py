"""A/B in one process: the demo's LoRA run generating with its adapters merged into a temporary copy of the weights
(`merge_lora_for_generation=True`, the default) against the adapter path (three matmuls per adapted layer).

Two trainers with the same model, recipe, rows and sampling seed take turns, steps alternating A B / B A; then
each greedily evaluates the same held-out problems, alternating too. Reports generation seconds per 1,000
generated tokens (the rollouts of the two sides drift apart by fp32 rounding, so their lengths differ a
little), process CPU seconds per step, and evaluation seconds; writes
bench/results/merged_generation_{THREADS}threads.json.

    python bench/merged_generation.py [THREADS] [STEPS] [HELDOUT]     # defaults: 1 thread, 6 steps, 60 problems
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

SIDES = (True, False)  # merge_lora_for_generation
RESULTS = Path(__file__).resolve().parent / "results"


def main(threads: int, steps: int, heldout_size: int) -> None:
    from workloads import cpu_model

    from forge.core.trainer import GRPOTrainer
    from forge.data.arithmetic import arithmetic_dataset, arithmetic_heldout
    from forge.demo import DemoSettings, demo_config, demo_rewards
    from forge.eval.evaluate import evaluate
    from forge.model import load_model
    from forge.run.optim import make_scheduler

    torch.set_num_threads(threads)
    settings = DemoSettings(seed=0)
    rows = arithmetic_dataset(n=settings.steps * settings.prompts_per_step, seed=0, chat=True)  # the demo's rows
    heldout = arithmetic_heldout(n=heldout_size, chat=True)
    base, tokenizer = load_model("default")
    trainers = {}
    for merge in SIDES:
        config = demo_config(settings, f"/tmp/forge_merged_generation_{merge}", merge_lora_for_generation=merge,
                             eval_steps=0)
        trainer = GRPOTrainer(copy.deepcopy(base), tokenizer, demo_rewards(), config)
        # step() is called directly, outside train(), which is where the scheduler is normally built
        trainer.scheduler = make_scheduler(trainer.optimizer, "constant", 0.0, settings.steps)
        trainers[merge] = trainer
    load_start = os.getloadavg()
    steps_log = {merge: [] for merge in SIDES}
    per_step = settings.prompts_per_step
    for i in range(steps):
        for merge in (SIDES if i % 2 == 0 else SIDES[::-1]):
            cpu0, wall0 = time.process_time(), time.perf_counter()
            metrics = trainers[merge].step(rows[per_step * i: per_step * (i + 1)])
            tokens = metrics["completions/mean_length"] * per_step * settings.group_size
            steps_log[merge].append({"cpu": time.process_time() - cpu0, "wall": time.perf_counter() - wall0,
                                     "generation": metrics["generation_share"] * metrics["step_time"],
                                     "tokens": tokens})
        print(i, {merge: {k: round(v, 2) for k, v in steps_log[merge][-1].items()} for merge in SIDES}, flush=True)
    evals = {merge: [] for merge in SIDES}
    for i in range(2):
        for merge in (SIDES if i % 2 == 0 else SIDES[::-1]):
            cpu0 = time.process_time()
            result = evaluate(trainers[merge].model, tokenizer, heldout, max_new_tokens=settings.max_new_tokens,
                              batch_size=settings.eval_batch_size, merge_adapters=merge)
            evals[merge].append({"seconds": result.metrics["seconds"], "cpu": time.process_time() - cpu0,
                                 "strict_accuracy": result.metrics["strict_accuracy"]})
        print("eval", i, evals, flush=True)

    def total(merge, key, log):
        return sum(r[key] for r in log[merge])

    summary = {merge: {"step_cpu_s": total(merge, "cpu", steps_log) / steps,
                       "generation_s_per_1k_tokens": 1000 * total(merge, "generation", steps_log)
                       / total(merge, "tokens", steps_log),
                       "eval_cpu_s": total(merge, "cpu", evals) / len(evals[merge])} for merge in SIDES}
    ratios = {key: summary[True][key] / summary[False][key] for key in summary[True]}
    report = {"what": "merge_lora_for_generation True vs False, the demo's recipe (SmolLM2-135M, LoRA r=16 on 7 "
                      "projections, 4 prompts x 8, 64 new tokens), alternating A B / B A in one process",
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": threads,
                          "torch": torch.__version__},
              "load_average": {"start": load_start, "end": os.getloadavg()},
              "steps": steps, "heldout": heldout_size, "merged": summary[True], "adapter_path": summary[False],
              "ratio_merged_over_adapter_path": ratios, "per_step": {str(k): v for k, v in steps_log.items()},
              "evaluations": {str(k): v for k, v in evals.items()}}
    path = RESULTS / f"merged_generation_{threads}threads.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for key, ratio in ratios.items():
        print(f"{key}: merged {summary[True][key]:.2f}, adapter path {summary[False][key]:.2f} -> {ratio:.2f}x")
    print(f"written to {path}")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*(args + [1, 6, 60][len(args):]))
