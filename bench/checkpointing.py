"""What gradient_checkpointing buys in Forge: peak RSS and step time with it off and on, side by side.

    python bench/checkpointing.py --workload short --model smollm2 --mode full [--rounds 2] [--micro-batch-size 0]

Forge only. Each measurement is a fresh process (bench/runners.py: one warm-up step, `--steps` timed steps);
the rounds alternate off, on, off, on, ... With checkpointing on, each decoder layer keeps only its input in
the loss pass and is recomputed in backward, the prompt's KV cache kept (each group's prompt runs once either
way). The default loss micro-batch is the whole rollout (0), where activation memory is largest.

Results: a Markdown table on stdout and in bench/results/checkpointing_<workload>_<model>_<mode>.md (+ .json).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_trl import base_spec, log, run_measurement, summarize
from workloads import WORKLOADS, machine_info


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--model", choices=["tiny", "smollm2"], required=True)
    p.add_argument("--mode", choices=["lora", "full"], required=True)
    p.add_argument("--steps", type=int, default=1, help="timed optimizer steps per process (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="processes per setting, alternating off, on, ...")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=0, help="completions per loss pass (0 = all)")
    p.add_argument("--variable-length", action="store_true", help="let the tiny model stop at EOS too")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=3600)
    return p.parse_args(argv)


def report(args, command: str, info: dict, off: dict, on: dict) -> str:
    workload = WORKLOADS[args.workload]
    rows = [("seconds per optimizer step (median)", "step_seconds", "{:.2f}"),
            ("CPU seconds per optimizer step (median)", "cpu_seconds", "{:.2f}"),
            ("peak RSS, MiB (VmHWM after the last timed step)", "peak_rss_mib", "{:.0f}"),
            ("tokens through the model per step", "tokens_forwarded_per_step", "{:.0f}"),
            ("completion tokens per step (mean)", "completion_tokens_per_step", "{:.0f}")]
    lines = [f"# Forge gradient checkpointing: {args.workload} / {args.model} / {args.mode}", "",
             f"Command: `{command}`", "",
             (f"Machine: {info.get('cpu_model', '?')}, {info['cpu_cores']} cores, load average at start "
             f"{', '.join(f'{x:.1f}' for x in info.get('load_average', ()))}; torch threads = {args.threads}; "
             f"torch {info['torch']}, transformers {info['transformers']}. Forge at {info.get('git', '?')}."), "",
             (f"Workload: {workload.prompts_per_step} prompts x group {workload.group_size}, max_new_tokens "
             f"{workload.max_new_tokens}, loss micro-batch {args.micro_batch_size or 'the whole rollout'}, "
             f"{args.mode} fine-tuning, fp32. {args.rounds} processes per setting, alternating, each "
             f"{args.warmup} warm-up + {args.steps} timed step(s)."), "",
             "| metric | off | on | on/off |", "|---|---:|---:|---:|"]
    for name, key, fmt in rows:
        lines.append(f"| {name} | {fmt.format(off[key])} | {fmt.format(on[key])} | {on[key] / off[key]:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    command = "python bench/checkpointing.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    info = machine_info(args.threads)
    results = {False: [], True: []}
    for round_index in range(args.rounds):
        for checkpointing in (False, True):
            log(f"round {round_index + 1}/{args.rounds}: gradient_checkpointing={checkpointing}")
            spec = base_spec(args, "forge", gradient_checkpointing=checkpointing, role="checkpointing")
            result = run_measurement(spec, args.timeout)
            results[checkpointing].append(result)
            seconds = ", ".join(f"{step['seconds']:.2f}" for step in result["steps"])
            log(f"  steps {seconds} s, "
                f"peak RSS {result['peak_rss_kib'] / 1024:.0f} MiB")
    off, on = summarize(results[False]), summarize(results[True])
    text = report(args, command, info, off, on)
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"checkpointing_{args.workload}_{args.model}_{args.mode}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps({"command": command, "machine": info, "off": off, "on": on,
                                                  "raw": {"off": results[False], "on": results[True]}}, indent=1))


if __name__ == "__main__":
    main()
