"""The teacher's pass of on-policy distillation against the reference pass, on the demo's rollout.

One demo-shaped rollout (the packaged SmolLM2-135M-Instruct with a LoRA student, 4 arithmetic prompts x 8
completions, 64 new tokens, the demo's precision) is sampled once; then the reference pass (the adapter switched
off, GRPOTrainer.reference_logprobs) and the teacher pass (a GRPO-trained adapter loaded as the student's second
adapter and switched on, core/teacher.py) score it, alternating, `--repeats` times each: process CPU seconds and
the peak resident memory each pass adds (Linux VmHWM, reset before each pass). Both are no-grad passes through
the same code (GRPOTrainer.rollout_logprobs); the teacher's adds the adapter's low-rank products.

    python bench/teacher_pass.py --teacher forge_demo/final --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workloads import machine_info

from forge.core.trainer import GRPOTrainer
from forge.data.arithmetic import ARITHMETIC_TASK
from forge.demo import DemoSettings, demo_config, demo_rewards, load_policy
from forge.run.memory import peak_mb, reset_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", required=True, help="a `forge demo` final/ adapter folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(HERE / "results" / "teacher_pass_demo.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = DemoSettings(output_dir="/tmp/forge_teacher_pass")
    model, tokenizer, _ = load_policy(settings)
    config = demo_config(settings, settings.output_dir, kl_beta=0.01, teacher_model=args.teacher, reward_coef=0.0,
                         drop_zero_std_groups=False)
    trainer = GRPOTrainer(model, tokenizer, demo_rewards(), config)
    rows = ARITHMETIC_TASK.rows(n=settings.prompts_per_step, seed=0, chat=True)
    rollout = trainer.sample_completions([row["prompt"] for row in rows], rows)
    passes = {"reference": lambda: trainer.reference_logprobs(rollout),
              "teacher": lambda: trainer.teacher.logprobs(rollout, trainer.rollout_logprobs)}
    measured = {name: {"cpu_seconds": [], "peak_added_mb": []} for name in passes}
    for _ in range(args.repeats):
        for name, run in passes.items():
            held = reset_peak()
            started = time.process_time()
            run()
            measured[name]["cpu_seconds"].append(time.process_time() - started)
            measured[name]["peak_added_mb"].append(peak_mb() - held)
    summary = {name: {key: min(values) for key, values in m.items()} for name, m in measured.items()}
    result = {"command": " ".join(["python", *sys.argv]), "rows": int(rollout.completion_ids.shape[0]),
              "completion_tokens": int(rollout.completion_mask.sum()), "measured": measured, "best": summary,
              "teacher_over_reference_cpu": summary["teacher"]["cpu_seconds"] / summary["reference"]["cpu_seconds"],
              "machine": machine_info(args.threads) | {"torch_threads": torch.get_num_threads(),
                                           "precision": str(trainer.precision.compute)}}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2), f"\nteacher / reference CPU: {result['teacher_over_reference_cpu']:.2f}x",
          f"\n-> {args.out}")


if __name__ == "__main__":
    main()
