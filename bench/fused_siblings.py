"""A/B in one process: the demo's generation with sibling layers as one packed product (forge/model/packed_linear.py
SIBLINGS: q/k/v and gate/up, each with its LoRA A; every other LoRA layer with its A) against each layer packed on
its own and the adapters through PEFT's layer (packed_linear.FUSED = False).

The demo's trainer (packaged SmolLM2-135M, LoRA r=16 on the 7 projections, 4 prompts x 8 completions, 64 new
tokens, temperature 0.7, its precision); its adapters are given random B matrices first, so the adapter path
computes what a trained adapter does. Each round generates the same prompts with the same sampling noise on both
sides (every round the same), alternating A B / B A: the adapter path (training's sampling in bf16) and, with --merged, merged weights
(evaluation's). Reports tokens per CPU second, the median of the rounds' ratios and whether both sides sampled the same tokens and
log-probs; writes bench/results/fused_siblings[_TAG].json. Packing, and so this, applies in bf16 on CPUs with AMX
or AVX512-BF16 (PACKED_LINEAR_MEASURED); elsewhere both sides are the same.

    python bench/fused_siblings.py [--rounds 4] [--threads 1] [--merged] [--tag NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--merged", action="store_true", help="generate on merged weights (evaluation's path)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from workloads import cpu_model, demo_trainer

    from forge.model import merged_adapters, packed_linear

    trainer, prompts = demo_trainer("/tmp/forge_fused_siblings")
    sides = {"fused": True, "per_layer": False}
    rounds = {side: [] for side in sides}
    rollouts = {}
    trainer.generate(prompts)  # warm-up
    for i in range(args.rounds):
        for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            packed_linear.FUSED = sides[side]
            trainer.sampling_rng.manual_seed(0)  # the same sampling in every round
            started = time.process_time()
            with merged_adapters(trainer.model, args.merged, rounded=True):  # as evaluation merges in bf16
                rollout = trainer.generate(prompts)
            cpu = time.process_time() - started
            tokens = int(rollout.completion_mask.sum())
            rounds[side].append({"tokens": tokens, "cpu_seconds": cpu, "tokens_per_cpu_second": tokens / cpu})
            rollouts.setdefault(i, {})[side] = rollout
        print(i, {side: round(rounds[side][-1]["tokens_per_cpu_second"], 1) for side in sides}, flush=True)
    packed_linear.FUSED = True
    same = all(torch.equal(r["fused"].completion_ids, r["per_layer"].completion_ids)
               and torch.equal(r["fused"].sampler_logprobs, r["per_layer"].sampler_logprobs)
               for r in rollouts.values())
    median = {side: statistics.median(r["tokens_per_cpu_second"] for r in rounds[side]) for side in sides}
    ratios = [f["tokens_per_cpu_second"] / p["tokens_per_cpu_second"] for f, p in zip(rounds["fused"],
                                                                                   rounds["per_layer"])]
    report = {"what": f"sibling layers fused vs packed one by one, the demo's generation "
                      f"({'merged weights' if args.merged else 'adapter path'}), alternating A B / B A",
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": args.threads,
                          "torch": torch.__version__, "precision": str(trainer.precision.compute),
                          "load_average": os.getloadavg()},
              "tokens_per_cpu_second": median, "ratio_fused_over_per_layer": statistics.median(ratios),
              "ratio_per_round": ratios,
              "same_tokens_and_logprobs": same, "rounds": rounds}
    path = RESULTS / f"fused_siblings{'_merged' if args.merged else ''}{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"fused {median['fused']:.1f} tokens/CPU-s, per layer {median['per_layer']:.1f}: "
          f"{report['ratio_fused_over_per_layer']:.3f}x; same tokens and log-probs: {same}\nwritten to {path}")


if __name__ == "__main__":
    main()
