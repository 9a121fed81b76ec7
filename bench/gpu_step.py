"""One GRPO training step of a random-init model of Qwen2.5-0.5B's shape, in Forge and (if importable) in TRL.

Nothing is downloaded: the model is built from a config (Qwen2Config with Qwen2.5-0.5B's sizes) with random weights,
the tokenizer is Forge's tiny offline one; the output layer keeps the full 151,936-token vocabulary (its cost is
the real model's) but logits past the tokenizer's last id are masked, so every sampled token decodes. Reports per
framework: step seconds, generation seconds, generated tokens per second, peak GPU memory. bench/gpu_check.sh
runs it on a GPU; `--small` (two layers) checks it on a CPU. Forge runs with each `--backends` value of
generation_backend (eager, compiled: CUDA graphs over a static cache; vllm: a colocated vLLM engine, when vLLM is
importable, its start-up and weight pushes in the step), two steps each: the first compiles.

    python bench/gpu_step.py [--device cuda] [--small] [--max-new-tokens 128] [--backends eager,compiled]
                             [--skip-trl]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
              "rope_theta": 1000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}


def qwen_shaped(tokenizer, small: bool, seed: int = 0, mask: bool = True):
    """A random-init Qwen2ForCausalLM of Qwen2.5-0.5B's shape whose logits past the tokenizer are -inf (mask=False:
    not masked, as vLLM runs its own copy of the weights without Forge's hook; ids past the tokenizer then decode
    to nothing, which costs the step nothing)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    sizes = QWEN25_05B | ({"num_hidden_layers": 2} if small else {})
    config = Qwen2Config(**sizes, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    model = Qwen2ForCausalLM(config)
    known = len(tokenizer)

    def mask_unknown(module, args, output):  # (..., V): ids the tokenizer cannot decode are never sampled
        return output.index_fill(-1, torch.arange(known, output.shape[-1], device=output.device), float("-inf"))

    if mask:
        model.lm_head.register_forward_hook(mask_unknown)
    return model


def rows(n: int) -> list[dict]:
    return [{"prompt": f"What is {a} + {a + 3}? Think, then answer.", "reference": str(2 * a + 3)} for a in range(n)]


def text_length(prompts, completions, **kwargs) -> list[float]:
    return [float(len(str(c))) / 100 for c in completions]


def peak_memory(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def forge_step(args, tokenizer, backend: str) -> dict:
    """Two steps with generation_backend=backend: the first compiles (compiled) and warms up, the second is timed."""
    from forge import GRPOConfig, GRPOTrainer
    from forge.run.optim import make_scheduler

    model = qwen_shaped(tokenizer, args.small, mask=backend != "vllm").to(args.device)
    config = GRPOConfig(group_size=8, prompts_per_step=args.prompts, gradient_accumulation_steps=1,
                        max_new_tokens=args.max_new_tokens, max_steps=2, save_steps=0, logging_steps=100,
                        dtype="auto", kl_beta=0.0, micro_batch_size=16, preflight="off", learning_rate=1e-6,
                        generation_backend=backend, output_dir=tempfile.mkdtemp())
    trainer = GRPOTrainer(model, tokenizer, text_length, config)
    trainer.scheduler = make_scheduler(trainer.optimizer, "constant", 0.0, 2)  # step() outside train()
    data = rows(2 * args.prompts)
    results = []
    for step in range(2):
        if args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        metrics = trainer.step(data[step * args.prompts:(step + 1) * args.prompts])
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        generation = metrics["generation_share"] * metrics["step_time"]
        tokens = metrics["completions/mean_length"] * args.prompts * config.group_size
        results.append({"step_s": seconds, "generation_s": generation, "generated_tokens": tokens,
                        "tokens_per_s": tokens / generation, "peak_gib": peak_memory(args.device),
                        "precision": str(trainer.precision.compute)})
    return {"first (compiles)": results[0], "measured": results[1]}


def trl_step(args, tokenizer) -> dict:
    try:
        import trl
        from datasets import Dataset
        from transformers import TrainerCallback
    except ImportError as error:
        return {"skipped": f"TRL is not importable here ({error})"}
    model = qwen_shaped(tokenizer, args.small).to(args.device)
    steps = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            steps.append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            if args.device == "cuda":
                torch.cuda.synchronize()
            steps[-1] = time.perf_counter() - steps[-1]

    config = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), num_generations=8, per_device_train_batch_size=16,
                            gradient_accumulation_steps=args.prompts * 8 // 16, max_completion_length=args.max_new_tokens,
                            max_steps=2, learning_rate=1e-6, beta=0.0, bf16=args.device == "cuda", logging_steps=100,
                            save_strategy="no", report_to=[], use_cpu=args.device == "cpu")
    trainer = trl.GRPOTrainer(model=model, reward_funcs=text_length, args=config,
                              train_dataset=Dataset.from_list(rows(2 * args.prompts)), processing_class=tokenizer,
                              callbacks=[Timer()])
    trainer.train()
    return {"trl": trl.__version__, "step_s": steps, "peak_gib": peak_memory(args.device)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="two layers: a CPU check of the script")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--backends", default="eager,compiled", help="generation_backend values, '' for none")
    args = parser.parse_args(argv)
    from forge.model.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    result = {"model": "random-init Qwen2.5-0.5B shape" + (" (2 layers)" if args.small else ""),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "workload": {"prompts": args.prompts, "group_size": 8, "max_new_tokens": args.max_new_tokens},
              "forge": {}}
    for backend in (b for b in args.backends.split(",") if b):
        result["forge"][backend] = forge_step(args, tokenizer, backend)
        print(json.dumps({backend: result["forge"][backend]}, indent=1), flush=True)
    if not args.skip_trl:
        try:
            result["trl"] = trl_step(args, tokenizer)
        except Exception as error:  # noqa: BLE001 (TRL's API moves: report it, keep Forge's figures)
            result["trl"] = {"failed": f"{type(error).__name__}: {error}"}
        print(json.dumps({"trl": result["trl"]}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
