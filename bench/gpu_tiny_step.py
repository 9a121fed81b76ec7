"""Forge's step time on the tiny model at dtype float32 and auto, alternating, on CUDA when there is one (part of
bench/gpu_check.sh; on a CPU it runs the same steps, which checks the script before a GPU is lent).

    python bench/gpu_tiny_step.py [--steps 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    tokenizer = build_tiny_tokenizer()
    rows = [{"prompt": f"What is {a} + {a}?"} for a in range(64)]

    def reward(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    for round_ in range(args.rounds):  # fp32 and auto alternate
        for dtype in ("float32", "auto"):
            model, _ = build_tiny_model(tokenizer, seed=0)
            config = GRPOConfig(group_size=8, prompts_per_step=8, gradient_accumulation_steps=1, max_new_tokens=64,
                                max_steps=args.steps, save_steps=0, logging_steps=100, dtype=dtype, kl_beta=0.0,
                                preflight="off", output_dir=tempfile.mkdtemp())
            trainer = GRPOTrainer(model.to(device), tokenizer, reward, config)
            sync()
            start = time.perf_counter()
            trainer.train(rows)
            sync()
            print(f"round {round_} {device} dtype={dtype} ({trainer.precision.compute}): "
                  f"{(time.perf_counter() - start) / args.steps:.3f} s/step", flush=True)


if __name__ == "__main__":
    main()
