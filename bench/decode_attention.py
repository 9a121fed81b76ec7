"""The decode's attention over each group's prompt stored once (forge/model/kv_cache.py) against the prompt
repeated per row (the cache layout Forge used before), on the demo's generation, alternating in one process.

The demo's workload: the packaged SmolLM2-135M-Instruct, the demo's chat prompts (4 arithmetic problems x 8
completions, up to 64 new tokens, temperature 1.0), without adapters (`--lora` adds the demo's LoRA adapters, with
small random B so that they compute), in the compute dtype asked for, with the same sampling noise for both
layouts in a round. Reported per layout: completion tokens per second of wall clock and of process CPU time
(median and range over the rounds), the ratio shared / repeated, and whether the two layouts sampled the same
tokens (and the largest sampler log-prob difference): they should, up to floating-point summation order. First,
one layer's attention alone at the demo's shape, both ways (`one_layer_attention`).

    python bench/decode_attention.py [--dtype bfloat16] [--threads 1] [--rounds 5] [--lora] [--fixed-length]

In bf16 the two layouts sample different tokens after a near-tie, so their completions (and the work) differ;
--fixed-length takes the stop token away, so that every row of both generates max_new_tokens.
Writes bench/results/decode_attention_<dtype>_<threads>t[_lora][_fixed].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def one_layer_attention(dtype: torch.dtype, calls: int = 200) -> list[dict]:
    """CPU microseconds of one layer's decode attention at the demo's shape (4 prompts of 157 positions x 8 rows,
    SmolLM2's 9 query and 3 key/value heads of 64), after t own tokens: scaled_dot_product_attention over each row's
    repeated prompt (as transformers runs it: GQA heads packed, a boolean mask) against SharedPrefixLayer.attend."""
    import torch.nn.functional as F

    from forge.model.kv_cache import SharedPrefixLayer

    prompts, group, kv_heads, per_kv, dim, length = 4, 8, 3, 3, 64, 157
    rows = prompts * group

    def microseconds(fn) -> float:
        for _ in range(5):
            fn()
        start = time.process_time()
        for _ in range(calls):
            fn()
        return (time.process_time() - start) / calls * 1e6

    out = []
    generator = torch.Generator().manual_seed(0)
    for own in (1, 32, 64):
        keys, values = (torch.randn(prompts, kv_heads, length, dim, generator=generator).to(dtype) for _ in "kv")
        mask = torch.ones(prompts, length, dtype=torch.long)
        mask[1, :20] = 0  # left padding
        layer = SharedPrefixLayer(keys, values, mask, group, capacity=64)
        for _ in range(own):
            layer.update(*(torch.randn(rows, kv_heads, 1, dim, generator=generator).to(dtype) for _ in "kv"))
        query = torch.randn(rows, kv_heads * per_kv, 1, dim, generator=generator).to(dtype)
        all_keys = torch.cat([keys.repeat_interleave(group, 0), layer.keys.to(dtype)], 2)  # (N, H_kv, Lp + t, D)
        all_values = torch.cat([values.repeat_interleave(group, 0), layer.values.to(dtype)], 2)
        allowed = torch.cat([mask.repeat_interleave(group, 0).bool(), torch.ones(rows, own, dtype=torch.bool)], 1)
        packed = query.reshape(rows, kv_heads, per_kv, dim)

        def repeated(packed=packed, all_keys=all_keys, all_values=all_values, allowed=allowed):
            return F.scaled_dot_product_attention(packed, all_keys, all_values, attn_mask=allowed[:, None, None])

        def shared(layer=layer, query=query):
            return layer.attend(query, dim**-0.5)

        out.append({"own_tokens": own, "repeated_us": microseconds(repeated), "shared_us": microseconds(shared)})
        print(f"one layer's attention after {own} own tokens: repeated prompt {out[-1]['repeated_us']:.0f} us, "
              f"shared prompt {out[-1]['shared_us']:.0f} us", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lora", action="store_true", help="the demo's LoRA adapters on the model")
    parser.add_argument(
        "--fixed-length",
        action="store_true",
        help="no stop token: every row generates max_new_tokens, so both layouts do the same work",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    from workloads import machine_info

    from forge.core import rollout as rollout_module
    from forge.core.rollout import SamplingSettings, generate, sampling_noise
    from forge.data.arithmetic import ARITHMETIC_TASK
    from forge.model import choose_precision, load_model
    from forge.model.decode_plan import DecodePlan

    attention = one_layer_attention(getattr(torch, args.dtype))
    model, tokenizer = load_model("default", dtype="float32")
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 1e-3, generator=torch.Generator().manual_seed(0))
    model.eval()
    precision = choose_precision(args.dtype)
    prompts = [row["prompt"] for row in ARITHMETIC_TASK.rows(n=args.prompts, seed=0, chat=True)]
    settings = SamplingSettings(args.max_new_tokens, temperature=1.0)
    if args.fixed_length:
        rollout_module.eos_ids = lambda tokenizer, model=None: []
    with precision.autocast(model):
        plans = {"shared": DecodePlan.of(model, "eager")}
    plans["repeated"] = replace(plans["shared"], shared_prompt=())  # each row its own copy of its prompt

    def run(layout: str, noise):
        with torch.no_grad(), precision.autocast(model):
            return generate(model, tokenizer, prompts, args.group_size, settings, noise=noise, plan=plans[layout])

    layouts = ("shared", "repeated")
    for layout in layouts:  # warm-up
        run(layout, None)
    measured = {layout: [] for layout in layouts}
    same_tokens, largest_gap = True, 0.0
    generator = torch.Generator().manual_seed(0)
    for r in range(args.rounds):
        noise = sampling_noise(generator, len(prompts) * args.group_size, args.max_new_tokens)
        rollouts = {}
        for layout in layouts if r % 2 == 0 else layouts[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            rollouts[layout] = run(layout, noise)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            tokens = int(rollouts[layout].completion_mask.sum())
            measured[layout].append(
                {
                    "tokens": tokens,
                    "seconds": wall,
                    "cpu_seconds": cpu,
                    "tokens_per_second": tokens / wall,
                    "tokens_per_cpu_second": tokens / cpu,
                }
            )
            print(
                f"round {r + 1} {layout:8s}: {tokens} tokens, {tokens / wall:.0f} tokens/s "
                f"({tokens / cpu:.0f} per CPU-second)",
                flush=True,
            )
        a, b = rollouts["shared"], rollouts["repeated"]
        same = torch.equal(a.completion_ids, b.completion_ids)
        same_tokens &= same
        if same:
            largest_gap = max(largest_gap, float((a.sampler_logprobs - b.sampler_logprobs).abs().max()))

    def summary(layout: str) -> dict:
        rows = measured[layout]
        return {
            key: {
                "median": statistics.median(row[key] for row in rows),
                "min": min(row[key] for row in rows),
                "max": max(row[key] for row in rows),
            }
            for key in ("tokens_per_second", "tokens_per_cpu_second")
        }

    result = {
        "workload": {
            "model": "SmolLM2-135M-Instruct (packaged)",
            "prompts": len(prompts),
            "lora": args.lora,
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0,
            "fixed_length": args.fixed_length,
        },
        "dtype": args.dtype,
        "shared": summary("shared"),
        "repeated": summary("repeated"),
        "one_layer_attention": attention,
        "same_tokens": same_tokens,
        "largest_sampler_logprob_gap": largest_gap,
        "rounds": measured,
        "machine": machine_info(args.threads),
        "command": "python bench/decode_attention.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    for key in ("tokens_per_second", "tokens_per_cpu_second"):
        result[f"ratio_{key}"] = result["shared"][key]["median"] / result["repeated"][key]["median"]
    tag = f"{args.dtype}_{args.threads}t{'_lora' if args.lora else ''}{'_fixed' if args.fixed_length else ''}"
    (HERE / "results" / f"decode_attention_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\n{result['machine']['cpu_model']}, {args.dtype}, {args.threads} thread(s): shared prompt "
        f"{result['ratio_tokens_per_second']:.2f}x the tokens/s of the repeated prompt "
        f"({result['ratio_tokens_per_cpu_second']:.2f}x per CPU-second); same tokens: {same_tokens}, "
        f"largest sampler log-prob gap {largest_gap:.1e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
