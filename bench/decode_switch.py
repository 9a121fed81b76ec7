"""A/B in one process: the demo's generation with one of the decode's switches on and off, alternating.

Switches (a module flag each, True in Forge):
- `fused`: sibling layers as one packed product (forge/model/packed_linear.py SIBLINGS: q/k/v and gate/up, each
  with its LoRA A; every other LoRA layer with its A) against each layer packed on its own and the adapters
  through PEFT's layer (packed_linear.FUSED). Packing, and so this, applies in bf16 on CPUs with AMX or
  AVX512-BF16 (PACKED_LINEAR_MEASURED); elsewhere both sides are the same. Writes fused_siblings[_merged][_TAG].json.
- `inference_mode`: the decode loop under torch.inference_mode against no_grad alone (rollout.INFERENCE_MODE).
  Writes decode_switch_inference_mode[_merged][_TAG].json.

The demo's trainer (packaged SmolLM2-135M, LoRA r=16 on the 7 projections, 4 prompts x 8 completions, 64 new
tokens, temperature 0.7, its precision); its adapters are given random B matrices first, so the adapter path
computes what a trained adapter does. Each round generates the same prompts with the same sampling noise on both
sides (every round the same), alternating A B / B A: the adapter path (training's sampling in bf16) and, with
--merged, merged weights (evaluation's). Reports tokens per CPU second, the median of the rounds' ratios and
whether both sides sampled the same tokens and log-probs; writes bench/results/.

    python bench/decode_switch.py fused [--rounds 4] [--threads 1] [--merged] [--tag NAME]
    python bench/decode_switch.py inference_mode --rounds 8
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
    parser.add_argument("switch", choices=["fused", "inference_mode"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--merged", action="store_true", help="generate on merged weights (evaluation's path)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from workloads import cpu_model, demo_trainer

    from forge.core import rollout as rollout_module
    from forge.model import merged_adapters, packed_linear

    module, flag, stem = {"fused": (packed_linear, "FUSED", "fused_siblings"),
                          "inference_mode": (rollout_module, "INFERENCE_MODE", "decode_switch_inference_mode")}[
        args.switch]
    trainer, prompts = demo_trainer(f"/tmp/forge_decode_switch_{args.switch}")
    sides = {"on": True, "off": False}
    rounds = {side: [] for side in sides}
    rollouts = {}
    trainer.sample_completions(prompts)  # warm-up
    for i in range(args.rounds):
        for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            setattr(module, flag, sides[side])
            trainer.sampling_rng.manual_seed(0)  # the same sampling in every round
            started = time.process_time()
            with merged_adapters(trainer.model, args.merged, rounded=True):  # as evaluation merges in bf16
                rollout = trainer.sample_completions(prompts)
            cpu = time.process_time() - started
            tokens = int(rollout.completion_mask.sum())
            rounds[side].append({"tokens": tokens, "cpu_seconds": cpu, "tokens_per_cpu_second": tokens / cpu})
            rollouts.setdefault(i, {})[side] = rollout
        print(i, {side: round(rounds[side][-1]["tokens_per_cpu_second"], 1) for side in sides}, flush=True)
    setattr(module, flag, True)
    same = all(torch.equal(r["on"].completion_ids, r["off"].completion_ids)
               and torch.equal(r["on"].sampler_logprobs, r["off"].sampler_logprobs)
               for r in rollouts.values())
    median = {side: statistics.median(r["tokens_per_cpu_second"] for r in rounds[side]) for side in sides}
    ratios = [on["tokens_per_cpu_second"] / off["tokens_per_cpu_second"] for on, off in zip(rounds["on"],
                                                                                       rounds["off"])]
    report = {"what": f"{module.__name__}.{flag} on vs off, the demo's generation "
                      f"({'merged weights' if args.merged else 'adapter path'}), alternating A B / B A",
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": args.threads,
                          "torch": torch.__version__, "precision": str(trainer.precision.compute),
                          "load_average": os.getloadavg()},
              "tokens_per_cpu_second": median, "ratio_on_over_off": statistics.median(ratios),
              "ratio_per_round": ratios,
              "same_tokens_and_logprobs": same, "rounds": rounds}
    path = RESULTS / f"{stem}{'_merged' if args.merged else ''}{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{flag} on {median['on']:.1f} tokens/CPU-s, off {median['off']:.1f}: "
          f"{report['ratio_on_over_off']:.3f}x; same tokens and log-probs: {same}\nwritten to {path}")


if __name__ == "__main__":
    main()
