"""The loss pass's log-probs made from the hidden states chunk by chunk, against the model's full (n, T, V) logits.

One micro-batch of the loss pass (forward through completion_logprobs with entropies, backward) per setting, on
the same rows, alternating the settings each repeat: process CPU seconds and the peak resident memory the pass
adds (Linux VmHWM, reset before each pass). "full" is the model's own logits for all positions at once (the path
Forge takes for models whose logits are more than a plain head of the hidden states); a number is
logprob_chunk_size, positions per chunk.

    python bench/logprob_chunks.py demo      # SmolLM2-135M (49,152 vocabulary), LoRA, 8 rows x 64 tokens
    python bench/logprob_chunks.py qwen      # Qwen2.5-0.5B's shape, random init (151,936), LoRA, 8 x 256
    python bench/logprob_chunks.py demo --sizes full,64,128,256 --repeats 3 --threads 1
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

from memory_phases import QWEN_SHAPE, reset_peak, status_mb
from workloads import machine_info


def model_for(workload: str):
    from forge.model import load_model
    from forge.model.lora import apply_lora

    model, tokenizer = load_model("default")
    if workload == "qwen":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_SHAPE))
    torch.manual_seed(0)
    model = apply_lora(model.to(torch.bfloat16).eval(), target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=("demo", "qwen"))
    parser.add_argument("--sizes", default="full,32,64,128,256,512")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, help="completions in the micro-batch (demo 8, qwen 8)")
    parser.add_argument("--tokens", type=int, help="tokens per completion (demo 64, qwen 256)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from forge.core import logprobs

    torch.set_num_threads(args.threads)
    model, tokenizer = model_for(args.workload)
    rows, new_tokens = (8, 64) if args.workload == "demo" else (8, 256)
    rows, new_tokens = args.rows or rows, args.tokens or new_tokens
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, len(tokenizer), (1, 157), generator=generator)  # the demo's prompt length
    completions = torch.randint(0, len(tokenizer), (rows, new_tokens), generator=generator)
    index = torch.zeros(rows, dtype=torch.long)
    head = logprobs.logit_head(model)
    sizes = args.sizes.split(",")
    results = {size: {"cpu": [], "peak_mb": []} for size in sizes}
    for i in range(args.repeats):
        for size in (sizes if i % 2 == 0 else sizes[::-1]):
            logprobs._HEADS[model] = None if size == "full" else head
            chunk = 1024 if size == "full" else int(size)
            start = reset_peak()
            t0 = time.process_time()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                values, _ = logprobs.completion_logprobs(model, prompt, torch.ones_like(prompt), completions,
                                                               index, 1.0, chunk, with_entropy=True)
            values.sum().backward()
            results[size]["cpu"].append(time.process_time() - t0)
            results[size]["peak_mb"].append(status_mb("VmHWM") - start)
            model.zero_grad(set_to_none=True)
        print(i, {s: round(results[s]["cpu"][-1], 2) for s in sizes}, flush=True)
    base = min(results["full"]["cpu"]) if "full" in results else None
    print(f"{args.workload}: {rows} rows x {new_tokens} tokens, {torch.get_num_threads()} thread(s), "
          f"{machine_info(args.threads)['cpu_model']}")
    print("setting | best CPU s | vs full | peak MB added")
    for size in sizes:
        best = min(results[size]["cpu"])
        print(f"{size} | {best:.2f} | {best / base:.2f}x | {max(results[size]['peak_mb']):.0f}" if base else
              f"{size} | {best:.2f} | | {max(results[size]['peak_mb']):.0f}")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_info(args.threads), "workload": args.workload,
                                        "rows": rows, "new_tokens": new_tokens, "results": results}, indent=1))


if __name__ == "__main__":
    main()
