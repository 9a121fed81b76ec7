"""A/B in one process: the demo's generation on packed linear layers (forge/model/packed_linear.py, sibling layers
as one product) against the same generation with every linear layer as torch runs it (F.linear), on this CPU.

What packing must show before PACKED_LINEAR_MEASURED lists a kind: more tokens per CPU-second, and samples as
on-policy as the unpacked ones. The demo's trainer (packaged SmolLM2-135M, LoRA r=16 on the 7 projections, 4 prompts
x 8 completions, 64 new tokens, temperature 0.7, the precision `--dtype` asks for); its adapters are given random
B matrices first, so the adapter path computes what a trained adapter does. Each round generates the same prompts
with the same sampling noise on both sides, alternating A B / B A, as training samples (bf16: the adapters apart;
fp32: merged, GRPOConfig.merge_lora_for_generation) or, with --merged, on merged weights (evaluation's). Packing is forced on for the measured side whether or not
PACKED_LINEAR_MEASURED lists this kind.

Reports per side the tokens per CPU-second (median of the rounds) and the sampler/trainer gap: the loss pass's
log-probs of the sampled tokens (trainer.rollout_logprobs, as the update computes them) against the log-probs the
sampler reported, mean and max |difference| over the completion tokens. Then the median ratio packed / unpacked,
and whether both sides sampled the same tokens and log-probs (bf16 on AMX or AVX512-BF16: the same bits; fp32:
oneDNN sums in another order than MKL's F.linear). Writes bench/results/packed_generation_<kind>_<dtype>[_merged].json.

    python bench/packed_generation.py [--rounds 4] [--threads 1] [--dtype auto] [--merged]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def sampler_gap(trainer, rollout) -> tuple[float, float]:
    """(mean, max) |loss-pass log-prob - sampler log-prob| over the sampled completion tokens."""
    with torch.no_grad():
        logprobs = trainer.rollout_logprobs(trainer.model, rollout)  # (N, T)
    mask = rollout.sampled_mask.bool()  # (N, T)
    gap = (logprobs.float() - rollout.sampler_logprobs.float()).abs()[mask]
    return float(gap.mean()), float(gap.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--merged", action="store_true", help="generate on merged weights (evaluation's path)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from workloads import cpu_model, demo_trainer

    from forge.model import merged_adapters, packed_linear
    from forge.model.precision import _bf16_units

    trainer, prompts = demo_trainer("/tmp/forge_packed_generation", dtype=args.dtype)
    compute = trainer.precision.compute
    kind = ("cpu", compute, _bf16_units())
    listed = kind in packed_linear.PACKED_LINEAR_MEASURED
    packed_linear.PACKED_LINEAR_MEASURED.setdefault(kind, "forced on by bench/packed_generation.py")
    plans = {"packed": dataclasses.replace(trainer.decode_plan, pack=True),
             "unpacked": dataclasses.replace(trainer.decode_plan, pack=False)}
    rounds = {side: [] for side in plans}
    rollouts: dict[int, dict] = {}
    trainer.sample_completions(prompts)  # warm-up
    for i in range(args.rounds):
        for side in (list(plans) if i % 2 == 0 else list(plans)[::-1]):
            trainer.decode_plan = plans[side]
            trainer.sampling_rng.manual_seed(0)  # the same sampling in every round
            with merged_adapters(trainer.model, args.merged, rounded=True):  # as evaluation merges
                started = time.process_time()
                rollout = trainer.sample_completions(prompts)
                cpu = time.process_time() - started
                gap_mean, gap_max = sampler_gap(trainer, rollout)
            tokens = int(rollout.completion_mask.sum())
            rounds[side].append({"tokens": tokens, "cpu_seconds": cpu, "tokens_per_cpu_second": tokens / cpu,
                                 "sampler_gap_mean": gap_mean, "sampler_gap_max": gap_max})
            rollouts.setdefault(i, {})[side] = rollout
        print(i, {side: round(rounds[side][-1]["tokens_per_cpu_second"], 1) for side in plans}, flush=True)
    same = all(torch.equal(r["packed"].completion_ids, r["unpacked"].completion_ids)
               and torch.equal(r["packed"].sampler_logprobs, r["unpacked"].sampler_logprobs)
               for r in rollouts.values())
    same_tokens = all(torch.equal(r["packed"].completion_ids, r["unpacked"].completion_ids)
                      for r in rollouts.values())
    median = {side: statistics.median(r["tokens_per_cpu_second"] for r in rounds[side]) for side in plans}
    gaps = {side: {"mean": statistics.median(r["sampler_gap_mean"] for r in rounds[side]),
                   "max": max(r["sampler_gap_max"] for r in rounds[side])} for side in plans}
    ratios = [p["tokens_per_cpu_second"] / u["tokens_per_cpu_second"]
              for p, u in zip(rounds["packed"], rounds["unpacked"])]
    dtype = str(compute).removeprefix("torch.")
    report = {"what": f"the demo's generation on packed linear layers vs F.linear "
                      f"({'merged weights' if args.merged else 'as training samples'}), alternating A B / B A",
              "machine": {"cpu": cpu_model(), "bf16_units": kind[2], "cores": os.cpu_count(),
                          "torch_threads": args.threads, "torch": torch.__version__, "precision": dtype,
                          "load_average": os.getloadavg()},
              "packing_listed_for_this_kind": listed,
              "tokens_per_cpu_second": median, "ratio_packed_over_unpacked": statistics.median(ratios),
              "ratio_per_round": ratios, "sampler_trainer_gap": gaps,
              "same_tokens": same_tokens, "same_tokens_and_logprobs": same, "rounds": rounds}
    tag = kind[2].lower().replace(" ", "_").replace("-", "_")
    path = RESULTS / f"packed_generation_{tag}_{dtype}{'_merged' if args.merged else ''}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"packed {median['packed']:.1f} tokens/CPU-s, unpacked {median['unpacked']:.1f}: "
          f"{report['ratio_packed_over_unpacked']:.3f}x; sampler/trainer gap, mean (max): packed "
          f"{gaps['packed']['mean']:.2e} ({gaps['packed']['max']:.2e}), unpacked {gaps['unpacked']['mean']:.2e} "
          f"({gaps['unpacked']['max']:.2e}); same tokens {same_tokens}, same log-probs {same}\nwritten to {path}")


if __name__ == "__main__":
    main()
