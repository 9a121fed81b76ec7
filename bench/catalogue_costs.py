"""Two measurements for the algorithm catalogue (issue 14), on the packaged model (SmolLM2-135M-Instruct), CPU:

1. the sampler/trainer log-prob gap: the log-prob of each sampled token recorded during generation
   (Rollout.sampler_logprobs) against the trainer's recomputation in the loss pass (completion_logprobs);
2. the cost of computing the token entropy inside the loss pass (logged every step): forward + backward of
   the loss with and without `with_entropy`, alternated, each pair giving one ratio.

    .venv/bin/python bench/catalogue_costs.py [--prompts 4] [--group 4] [--tokens 64] [--pairs 6]
    .venv/bin/python bench/catalogue_costs.py --sampler_dtype bfloat16 --pairs 0   # the gap of a bf16 sampler
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

import forge
from forge.core.grpo import grpo_loss
from forge.core.logprobs import completion_logprobs
from forge.core.rollout import SamplingSettings, generate
from forge.run.step_stats import logprob_gap

PROMPTS = [
    "What is 12 + 7? Think step by step, then give the answer.",
    "Tom has 5 apples and buys 3 more. How many apples does he have?",
    "A train travels 60 km in 1.5 hours. What is its average speed in km/h?",
    "Write the first five prime numbers.",
    "If a shirt costs $20 after a 20% discount, what was the original price?",
    "How many minutes are there in 3.5 hours?",
]


def loss_pass(model, rollout, temperature, with_entropy):
    """One loss forward + backward over the rollout, as _update does it (share_prompt_prefix, chunk 1024)."""
    model.zero_grad(set_to_none=True)
    started = time.process_time()  # CPU time: the machine is shared, wall time mostly measures the neighbours
    out = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                              rollout.prompt_index, temperature, 1024, True, with_entropy=with_entropy)
    logprobs = out[0] if with_entropy else out
    advantages = torch.linspace(-1, 1, logprobs.shape[0])
    loss, _ = grpo_loss(logprobs, None, None, advantages, rollout.completion_mask,
                        entropy=out[1] if with_entropy else None)
    loss.backward()
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--sampler_dtype", default="float32",
                        help="sample with a copy of the model in this dtype (bfloat16: a sampler in another precision)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"cpu: {platform.processor() or platform.machine()}, torch threads: {torch.get_num_threads()}")
    model, tokenizer = forge.load_model("default")
    model.eval()
    settings = SamplingSettings(max_new_tokens=args.tokens, temperature=args.temperature)
    sampler = model if args.sampler_dtype == "float32" else copy.deepcopy(model).to(getattr(torch, args.sampler_dtype))
    started = time.perf_counter()
    rollout = generate(sampler, tokenizer, PROMPTS[:args.prompts], args.group, settings)
    gen_seconds = time.perf_counter() - started
    tokens = int(rollout.completion_mask.sum())
    with torch.no_grad():
        trainer = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                      rollout.prompt_index, args.temperature, 1024, True)
    mean, largest = logprob_gap(trainer, rollout.sampler_logprobs, rollout.completion_mask)
    print(f"rollout ({args.sampler_dtype} sampler, fp32 trainer): {args.prompts} prompts x {args.group}, {tokens} "
          f"completion tokens, {gen_seconds:.1f} s")
    print(f"sampler vs trainer log-prob, |diff| over {tokens} tokens: mean {mean:.3e}, max {largest:.3e}")
    ratio = (trainer - rollout.sampler_logprobs)[rollout.completion_mask.bool()].exp()
    print(f"token importance weight pi_trainer / pi_sampler: min {float(ratio.min()):.6f}, "
          f"max {float(ratio.max()):.6f}")

    if args.pairs == 0:
        return
    loss_pass(model, rollout, args.temperature, False)  # warm-up
    plain, with_entropy, ratios = [], [], []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)  # alternate which runs first
        times = {flag: loss_pass(model, rollout, args.temperature, flag) for flag in order}
        plain.append(times[False])
        with_entropy.append(times[True])
        ratios.append(times[True] / times[False])
    print(f"loss pass (fwd + bwd) CPU time, {args.pairs} alternated pairs: without entropy median "
          f"{statistics.median(plain):.3f} s, with entropy {statistics.median(with_entropy):.3f} s; "
          f"ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
