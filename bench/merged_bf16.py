"""bf16 LoRA generation: adapters merged once per generation (W + s B A formed in fp32, rounded once to bf16) against
the adapter path (three matmuls per adapted layer), on the packaged SmolLM2-135M in the demo's recipe.

1. Trains the demo's LoRA run in bf16 for STEPS steps (so the adapters carry a real, early-training update: the
   case where rounding W + s B A to bf16 loses most of it).
2. Exactness: samples one rollout of the demo's shape with each variant (the same noise), then computes the
   trainer's log-probs of those tokens (bf16 autocast, adapter path: what the loss sees) and the exact policy's
   (the same weights in fp32, no autocast). Reports |sampler - trainer| (`sampling/sampling_logp_difference/mean`, `/max`, what the
   run logs), |sampler - exact|, the share of adapted weight elements whose update rounds away, and how much of
   the update's effect on the sampled tokens' log-probs (exact trained - exact base) the sampler shows (the slope
   of sampler - exact base on it: 1 = all, 0 = a sampler that lags at the base model).
3. Speed: greedy evaluation of HELDOUT held-out problems by the base model (adapters off), the adapter path and
   the merged weights, alternating the order each round; reports each one's best wall time and process CPU
   time per generated token as a ratio of the base's (per token: the trained model's answers differ in length).
   STEPS=0 trains nothing and gives the adapters an early-training size (B ~ N(0, 1e-3)) instead, so the three
   answer alike and the lengths match.

Writes bench/results/merged_bf16_{STEPS}steps.json.

    python bench/merged_bf16.py [STEPS] [HELDOUT] [ROUNDS]   # defaults: 6 60 2
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("base", "adapters", "merged")


def main(steps: int, heldout_size: int, rounds: int) -> None:
    from forge.core.logprobs import completion_logprobs
    from forge.core.rollout import SamplingSettings, generate
    from forge.core.trainer import GRPOTrainer
    from forge.data.arithmetic import arithmetic_dataset, arithmetic_heldout
    from forge.demo import DemoSettings, demo_config, demo_rewards
    from forge.eval.evaluate import evaluate
    from forge.model import cpu_name, load_model, merged_adapters
    from forge.run.optim import make_scheduler
    from forge.run.step_stats import logprob_gap

    settings = DemoSettings(seed=0, dtype="bfloat16")
    rows = arithmetic_dataset(n=max(steps, 1) * settings.prompts_per_step + 8, seed=0, chat=True)
    base, tokenizer = load_model("default")
    config = demo_config(settings, "/tmp/forge_merged_bf16", eval_steps=0, preflight="off")
    trainer = GRPOTrainer(base, tokenizer, demo_rewards(), config)
    trainer.scheduler = make_scheduler(trainer.optimizer, "constant", 0.0, settings.steps)
    per_step = settings.prompts_per_step
    if steps == 0:  # no training: adapters of an early-training size, the outputs (and lengths) near the base's
        with torch.no_grad():
            for name, parameter in trainer.model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 1e-3, generator=torch.Generator().manual_seed(0))
    for i in range(steps):
        metrics = trainer.step(rows[per_step * i: per_step * (i + 1)])
        print(f"step {i + 1}: reward {metrics.get('reward', float('nan')):.3f} "
              f"logp_diff_mean {metrics.get('sampling/sampling_logp_difference/mean', float('nan')):.4f}", flush=True)
    model, precision = trainer.model, trainer.precision

    # 2. exactness: the same noise through each variant
    exact = copy.deepcopy(model).float()  # the same weights, every product in fp32
    prompts = [row["prompt"] for row in rows[-per_step:]]
    sampling = SamplingSettings(settings.max_new_tokens, settings.temperature, 1.0, 0)
    noise = torch.rand(per_step * settings.group_size, settings.max_new_tokens, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))
    exactness = {}
    for variant in ("merged", "adapters"):  # the adapter rollout last: the paired comparison below uses it
        with torch.no_grad(), precision.autocast(model), merged_adapters(model, variant == "merged", rounded=True) as merged:
            assert merged == (variant == "merged")
            rollout = generate(model, tokenizer, prompts, settings.group_size, sampling, noise=noise)
        mask = rollout.sampled_mask
        trained = trainer.rollout_logprobs(model, rollout)  # (N, T) the loss's numerics
        with torch.no_grad():
            truth = completion_logprobs(exact, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                        rollout.prompt_index, settings.temperature)
            with exact.disable_adapter():
                truth_base = completion_logprobs(exact, rollout.prompt_ids, rollout.prompt_mask,
                                                 rollout.completion_ids, rollout.prompt_index, settings.temperature)
        # how much of the update's effect on log-probs the sampler shows: the slope of (sampler - exact base)
        # on (exact trained - exact base) over the sampled tokens; 1 = all of it, 0 = the sampler lags at the base
        on = mask.bool()
        effect, shown = (truth - truth_base)[on].double(), (rollout.sampler_logprobs - truth_base)[on].double()
        captured = float((effect * shown).sum() / (effect * effect).sum().clamp(min=1e-30))
        gap_mean, gap_max = logprob_gap(trained, rollout.sampler_logprobs, mask)
        exact_mean, exact_max = logprob_gap(truth, rollout.sampler_logprobs, mask)
        exactness[variant] = {"logp_diff_mean": gap_mean, "logp_diff_max": gap_max,
                              "vs_fp32_mean": exact_mean, "vs_fp32_max": exact_max, "tokens": int(mask.sum()),
                              "update_effect_mean": float(effect.abs().mean()), "update_effect_captured": captured}
        print(variant, exactness[variant], flush=True)
    # paired, on the same tokens (the adapter rollout): the full forward with merged weights against the trainer's
    # (adapter path), next to the sampler's own decode-vs-forward gap on those tokens
    with torch.no_grad(), precision.autocast(model), merged_adapters(model, rounded=True):
        merged_forward = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                             rollout.prompt_index, settings.temperature)
    exactness["paired_merged_forward_vs_trainer"] = dict(zip(("mean", "max"), logprob_gap(
        merged_forward, trained, mask)))
    exactness["paired_merged_forward_vs_fp32"] = dict(zip(("mean", "max"), logprob_gap(merged_forward, truth, mask)))
    exactness["paired_trainer_vs_fp32"] = dict(zip(("mean", "max"), logprob_gap(trained, truth, mask)))
    with torch.no_grad(), precision.autocast(model):
        rounded_away = total = 0
        from peft.tuners.lora.layer import Linear as LoraLinear
        for m in (m for m in model.modules() if isinstance(m, LoraLinear)):
            weight = m.get_base_layer().weight
            update = (m.lora_B["default"].weight @ m.lora_A["default"].weight) * m.scaling["default"]
            merged_weight = (weight.float() + update).to(weight.dtype)
            rounded_away += int(((merged_weight == weight) & (update != 0)).sum())
            total += update.numel()
    exactness["update_elements_rounded_away"] = rounded_away / total

    # 3. speed: alternating evaluations
    heldout = arithmetic_heldout(n=heldout_size, chat=True)
    seconds = {variant: [] for variant in VARIANTS}
    accuracy = {}
    for r in range(rounds if heldout_size else 0):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            adapters_off = model.disable_adapter() if variant == "base" else contextlib.nullcontext()
            cpu = time.process_time()
            with adapters_off, precision.autocast(model):
                result = evaluate(model, tokenizer, heldout, max_new_tokens=settings.max_new_tokens,
                                  batch_size=settings.eval_batch_size, merge_adapters=variant == "merged")
            tokens = result.metrics["mean_completion_length"] * result.metrics["n"]
            seconds[variant].append({"wall_s": result.metrics["seconds"], "cpu_s": time.process_time() - cpu,
                                     "tokens": tokens, "wall_ms_per_token": 1e3 * result.metrics["seconds"] / tokens})
            accuracy[variant] = result.metrics["strict_accuracy"]
            print(r, variant, seconds[variant][-1], flush=True)
    best = {variant: min((t["wall_ms_per_token"] for t in times), default=1.0) for variant, times in seconds.items()}
    best_cpu = {variant: min((t["cpu_s"] / t["tokens"] for t in times), default=1.0)
                for variant, times in seconds.items()}
    summary = {
        "what": "bf16 LoRA evaluation/sampling: adapters merged once per generation vs the adapter path",
        "cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "model": "packaged SmolLM2-135M-Instruct", "precision": str(precision.compute),
        "steps_trained": steps, "heldout": heldout_size, "rounds": rounds,
        "exactness": exactness,
        "eval_seconds": seconds, "eval_strict_accuracy": accuracy,
        "eval_time_per_token_vs_base": {variant: best[variant] / best["base"] for variant in VARIANTS},
        "eval_cpu_per_token_vs_base": {variant: best_cpu[variant] / best_cpu["base"] for variant in VARIANTS},
        "load_average": list(os.getloadavg()),
        "command": f"python bench/merged_bf16.py {steps} {heldout_size} {rounds}",
    }
    RESULTS.mkdir(exist_ok=True)
    tag = f"{steps}steps" + ("" if heldout_size else "_exactness")
    (RESULTS / f"merged_bf16_{tag}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("exactness", "eval_time_per_token_vs_base",
                                                      "eval_cpu_per_token_vs_base")}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    arguments = [int(a) for a in sys.argv[1:]]
    main(*(arguments + [6, 60, 2][len(arguments):]))
