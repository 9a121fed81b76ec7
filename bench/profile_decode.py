"""Where one decode step of the demo's generation spends its time: torch.profiler over one `trainer.generate`.

The demo's workload (packaged SmolLM2-135M, LoRA as in bench/decode_floor.py, 4 prompts x 8 completions, in the
run's precision), a few new tokens (--max-new-tokens), after a warm-up generation; on the adapter path (training's
sampling) and on merged weights (evaluation). Each operator's self time is attributed to the phase it ran under
(the prefill, the model's forward in a decode step, the sampler, the rest of the loop) and divided by the number of
decode steps. The profiler adds its own cost to every operator, so small operators and Python read high; the
unprofiled time of the generation is printed next to it. Writes bench/results/profile_decode[_TAG].json.

    python bench/profile_decode.py [--max-new-tokens 12] [--variants adapters,merged]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PHASES = ("prefill", "decode forward", "sampler")


def install_labels(rollout_module) -> None:
    from profile_forge import labelled

    from forge.model import decode_plan

    rollout_module.sample_next_token = labelled(rollout_module.sample_next_token, "sampler")
    if not hasattr(decode_plan, "_unlabelled"):
        decode_plan._unlabelled = decode_plan.prefill_groups, decode_plan.EagerStep.__call__
        decode_plan.prefill_groups = labelled(decode_plan._unlabelled[0], "prefill")
        decode_plan.EagerStep.__call__ = labelled(decode_plan._unlabelled[1], "decode forward")


def phase_table(profiler, steps: int, top: int) -> dict:
    """{phase: ms per decode step}, and the top (phase, operator) pairs by self time, in ms per decode step."""
    by_op, by_phase = defaultdict(lambda: [0.0, 0]), defaultdict(float)
    for event in profiler.events():
        phase, parent = "rest of the loop", event
        while parent is not None:
            if parent.name in PHASES:
                phase = parent.name
                break
            parent = parent.cpu_parent
        name = "(Python and dispatch)" if event.name in PHASES else event.name
        by_op[(phase, name)][0] += event.self_cpu_time_total / 1e3
        by_op[(phase, name)][1] += 1
        by_phase[phase] += event.self_cpu_time_total / 1e3
    ops = sorted(by_op.items(), key=lambda item: -item[1][0])[:top]
    return {"phases_ms_per_step": {k: round(v / steps, 2) for k, v in sorted(by_phase.items(), key=lambda x: -x[1])},
            "top_ops_ms_per_step": [{"phase": phase, "op": op, "ms_per_step": round(ms / steps, 2),
                                     "calls_per_step": round(calls / steps, 1)}
                                    for (phase, op), (ms, calls) in ops]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--variants", default="adapters,merged")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from workloads import cpu_model

    import forge.core.rollout as rollout_module
    from forge.core.trainer import GRPOTrainer
    from forge.data.arithmetic import arithmetic_dataset
    from forge.demo import DemoSettings, demo_config, demo_rewards
    from forge.model import load_model, merged_adapters

    settings = DemoSettings(seed=0, dtype=args.dtype, max_new_tokens=args.max_new_tokens)
    base, tokenizer = load_model("default")
    config = demo_config(settings, "/tmp/forge_profile_decode", eval_steps=0, preflight="off")
    trainer = GRPOTrainer(base, tokenizer, demo_rewards(), config)
    with torch.no_grad():  # adapters as after some training (peft starts B at 0)
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 1e-3, generator=torch.Generator().manual_seed(0))
    prompts = [row["prompt"] for row in arithmetic_dataset(n=settings.prompts_per_step, seed=0, chat=True)]
    install_labels(rollout_module)

    results = {}
    for variant in (v for v in args.variants.split(",") if v):
        trainer.config = replace(config, merge_lora_for_generation=variant != "adapters")
        merge = merged_adapters(trainer.model, rounded=True) if variant == "merged" else contextlib.nullcontext()
        with merge:
            timings = []
            for _ in range(2):  # a warm-up, then the unprofiled time
                trainer.sampling_rng = torch.Generator().manual_seed(0)
                start = time.perf_counter()
                trainer.generate(prompts)
                timings.append(time.perf_counter() - start)
            trainer.sampling_rng = torch.Generator().manual_seed(0)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
                rollout = trainer.generate(prompts)
        steps = int(rollout.completion_lengths.max()) - 1
        key = variant
        results[key] = {"unprofiled_s": round(timings[-1], 3), "decode_steps": steps,
                        "rows": int(rollout.completion_ids.shape[0])} | phase_table(profiler, steps, args.top)
        print(f"\n{key}: {timings[-1]:.2f} s unprofiled, {steps} decode steps")
        for phase, ms in results[key]["phases_ms_per_step"].items():
            print(f"  {phase:18s} {ms:8.2f} ms per decode step (profiled)")
        for row in results[key]["top_ops_ms_per_step"]:
            print(f"    {row['phase']:16s} {row['op'][:44]:44s} {row['ms_per_step']:7.2f} ms/step "
                  f"{row['calls_per_step']:7.1f} calls/step")
    out = {"what": "torch.profiler over one generation of the demo's workload, ms per decode step by phase and op",
           "cpu": cpu_model(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
           "precision": str(trainer.precision.compute), "max_new_tokens": args.max_new_tokens, "results": results,
           "command": "python bench/profile_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    path = HERE / "results" / f"profile_decode{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
