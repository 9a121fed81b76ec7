"""Does a compiled, static-cache decode step pay on this machine? One decode step of the demo's shape, three ways.

The packaged SmolLM2-135M in the run's precision (bf16 on a CPU with bf16 units), a batch of ROWS rows whose
prompt of PROMPT tokens is already in the cache, then decode steps:

- `eager`: Forge's decode step (forge/model/decode_plan.py's eager step over forge/model/kv_cache.py's
  preallocated cache, whose filled part grows by one column per step; each row's own prompt, as the decode runs
  with tools), its linear layers as torch runs them;
- `eager_packed`: the same, its linear layers on weights packed once (forge/model/packed_linear.py), as
  generation runs it where PACKED_LINEAR_MEASURED lists the device (elsewhere it equals `eager`);
- `static_eager`: transformers' StaticCache (fixed shape: every step attends over the whole capacity, masked);
- `static_compiled`: the same step under torch.compile (inductor: C++ kernels on a CPU; on a GPU add
  mode="reduce-overhead" for CUDA graphs), compiled once for this (batch, capacity) bucket.

Reports the first compiled call's time (the compile), the median step time of each (alternating, after a
warm-up), the ratio compiled / eager, and after how many steps the compile has paid for itself.
Writes bench/results/compiled_decode_<model>_<device>_<dtype>[_TAG].json.

    python bench/compiled_decode.py [--rows 32] [--prompt 160] [--steps 64] [--tag avx512_bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=160)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default="default",
                        help="'default' (packaged SmolLM2), 'tiny', or 'qwen-shape' (random-init Qwen2.5-0.5B shape)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tag", default="", help="added to the result file's name (e.g. the CPU kind)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_step import qwen_shaped
    from transformers import StaticCache
    from workloads import cpu_model

    from forge.model import load_model
    from forge.model.kv_cache import CACHE_ARG, preallocated, returned_cache
    from forge.model.packed_linear import packed_linears
    from forge.model.precision import choose_precision
    from forge.model.decode_plan import DecodePlan
    from forge.model.tiny import build_tiny_model, build_tiny_tokenizer

    device = torch.device(args.device)
    if args.model == "tiny":
        model = build_tiny_model(seed=0)[0]
    elif args.model == "qwen-shape":
        model = qwen_shaped(build_tiny_tokenizer(), small=device.type == "cpu")
    else:
        model = load_model(args.model)[0]
    precision = choose_precision(args.dtype, device)
    model = model.to(device=device, dtype=precision.compute).eval()

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    rows, prompt, steps = args.rows, args.prompt, args.steps
    capacity = -(-(prompt + steps) // 64) * 64  # the length bucket: a multiple of 64
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (rows, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    step_ids = torch.randint(0, vocab, (rows, steps), generator=torch.Generator().manual_seed(1)).to(device)

    def prefilled(static: bool):
        with torch.no_grad():
            if not static:
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                return preallocated(returned_cache(out), prompt + steps)
            cache = StaticCache(config=model.config, max_cache_len=capacity)
            model(input_ids=ids, use_cache=True, logits_to_keep=1, cache_position=torch.arange(prompt, device=device),
                  **{CACHE_ARG: cache})
            return cache

    def eager_steps(n: int, packed: bool = False) -> list[float]:
        cache, times = prefilled(False), []
        step = DecodePlan.of(model, "eager").decode_step(model, cache)  # the step generation runs (its mask)
        with torch.no_grad(), packed_linears(model, enabled=packed):
            for k in range(n):
                start = now()
                mask = torch.ones(rows, prompt + k + 1, dtype=torch.long, device=device)
                step(step_ids[:, k], mask, torch.full((rows,), prompt + k, dtype=torch.long, device=device))
                times.append(now() - start)
        return times

    def static_step(cache, tokens, mask, position):  # tensors only: a Python int would recompile every step
        return model(input_ids=tokens, attention_mask=mask, position_ids=position,
                     cache_position=position[0], use_cache=True, **{CACHE_ARG: cache}).logits

    # CUDA: CUDA graphs replay the whole step (reduce-overhead); CPU: inductor's C++ kernels
    compiled = torch.compile(static_step, dynamic=False, fullgraph=False,
                             mode="reduce-overhead" if device.type == "cuda" else None)

    def static_steps(n: int, step) -> list[float]:
        cache, times = prefilled(True), []
        mask = torch.zeros(rows, capacity, dtype=torch.long, device=device)
        mask[:, :prompt] = 1
        with torch.no_grad():
            for k in range(n):
                start = now()
                mask[:, prompt + k] = 1
                position = torch.full((rows, 1), prompt + k, dtype=torch.long, device=device)
                step(cache, step_ids[:, k:k + 1], mask, position)
                times.append(now() - start)
        return times

    with precision.autocast():
        start = now()
        first = static_steps(2, compiled)
        compile_seconds = now() - start - first[-1]
        print(f"compile (first call): {compile_seconds:.1f} s", flush=True)
        ways = {"eager": lambda: eager_steps(steps), "eager_packed": lambda: eager_steps(steps, packed=True),
                "static_eager": lambda: static_steps(steps, static_step),
                "static_compiled": lambda: static_steps(steps, compiled)}
        medians = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                times = ways[name]()
                medians[name].append(statistics.median(times[2:]))
                print(r, name, f"{1e3 * medians[name][-1]:.2f} ms/step", flush=True)
    best = {name: min(values) for name, values in medians.items()}
    saved = best["eager"] - best["static_compiled"]
    result = {
        "what": "one decode step: Forge's eager step vs a static cache, eager and compiled (torch.compile, inductor)",
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "load_average": list(os.getloadavg()),
        "model": args.model, "precision": str(precision.compute),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": {"rows": rows, "prompt": prompt, "steps": steps, "capacity": capacity},
        "compile_seconds": compile_seconds, "median_step_ms": {k: [1e3 * v for v in vals] for k, vals in medians.items()},
        "compiled_over_eager": best["static_compiled"] / best["eager"],
        "static_eager_over_eager": best["static_eager"] / best["eager"],
        "eager_packed_over_eager": best["eager_packed"] / best["eager"],
        "compiled_over_eager_packed": best["static_compiled"] / best["eager_packed"],
        "steps_to_pay_for_compile": compile_seconds / saved if saved > 0 else None,
        "command": "python bench/compiled_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    RESULTS.mkdir(exist_ok=True)
    dtype = str(precision.compute).removeprefix("torch.")
    path = RESULTS / f"compiled_decode_{args.model}_{device.type}_{dtype}{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("compile_seconds", "compiled_over_eager", "static_eager_over_eager",
                                             "eager_packed_over_eager", "compiled_over_eager_packed",
                                             "steps_to_pay_for_compile")}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
