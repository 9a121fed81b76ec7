"""Forge against TRL's GRPOTrainer on the same GRPO workload: seconds per optimizer step, completion tokens
per second, peak RSS and the share of time spent generating.

    python bench/compare_trl.py --workload short|long --model tiny|smollm2 --mode lora|full \
        [--steps 1] [--rounds 3] [--threads 1] [--group-sizes 4,8,16]

Every measurement is a fresh process (bench/runners.py) that runs one warm-up step and `--steps` timed
optimizer steps of one framework; the rounds alternate Forge, TRL, Forge, TRL, ... so a neighbour's load
hits both alike. Both frameworks get the same rows in the same order, the same group size, max new tokens,
sampling (temperature 0.9, top-p 1, top-k off), loss (loss_type='grpo': per-sequence token mean, clip 0.2),
kl beta 0 (no reference model for either), one optimizer step per rollout, fp32, AdamW, the same LoRA
(r=16, alpha=32, q/k/v/o, dropout 0), no gradient checkpointing, and the same fixed torch thread count.
The tiny model's completions are fixed-length (EOS made unreachable, see bench/workloads.py).

On the long workload it also measures how Forge's step time scales with the group size, and the prompt's
share of it: each group size runs with the real ~550-token prompts and with 1-token prompts, completions
fixed-length in both, so the difference is what the prompt costs.

Results: a Markdown table on stdout and in bench/results/<workload>_<model>_<mode>.md (+ .json).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workloads import WORKLOADS, machine_info

# Forge/TRL ratios the issue asks for: (model, workload, mode) -> step-time target; RSS target on long.
STEP_TIME_TARGETS = {("smollm2", "long", "lora"): 0.35, ("smollm2", "short", "lora"): 0.5,
                     ("smollm2", "short", "full"): 0.5}
TINY_STEP_TIME_TARGET = 1.0
LONG_RSS_TARGET = 0.6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--model", choices=["tiny", "smollm2"], required=True)
    p.add_argument("--mode", choices=["lora", "full"], required=True)
    p.add_argument("--steps", type=int, default=1, help="timed optimizer steps per process (after --warmup)")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps at the start of each process")
    p.add_argument("--rounds", type=int, default=3, help="processes per framework, alternating Forge, TRL, ...")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads for both frameworks (1 while the machine is shared)")
    p.add_argument("--group-sizes", default="4,8,16", help="group sizes of the scaling rows (long workload)")
    p.add_argument("--scaling-rounds", type=int, default=1, help="processes per scaling configuration")
    p.add_argument("--no-scaling", action="store_true", help="skip the scaling rows on the long workload")
    p.add_argument("--scaling-only", action="store_true", help="only the scaling rows (no TRL)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="completions per loss forward/backward in both frameworks (default: the workload's; "
                        "0 = the whole rollout)")
    p.add_argument("--precision", choices=["float32", "best"], default="float32",
                   help="float32 for both, or each framework at its best dtype on this machine: Forge dtype='auto'; "
                        "TRL bf16=True where the CPU has bf16 matrix units (its default), fp32 where it has not")
    p.add_argument("--variable-length", action="store_true",
                   help="let the tiny model stop at EOS too (default: fixed-length completions for tiny)")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--from-raw", metavar="RAW_JSON",
                   help="rebuild the report from a <stem>.raw.json of an earlier run instead of measuring")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one measurement process may take")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------
# running measurements


def run_measurement(spec: dict, timeout: float) -> dict:
    """Run one measurement in a fresh process; add the process's peak RSS as the kernel saw it."""
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"]),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore", "TQDM_DISABLE": "1"}
        started = time.perf_counter()
        with open(log, "w") as log_file:
            process = subprocess.Popen([sys.executable, str(HERE / "runners.py"), json.dumps(spec), str(out)],
                                       stdout=log_file, stderr=subprocess.STDOUT, env=env)
            deadline = started + timeout
            while True:
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    break
                if time.perf_counter() > deadline:
                    process.kill()
                    pid, status, usage = os.wait4(process.pid, 0)
                    break
                time.sleep(0.2)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0 or not out.exists():
            tail = log.read_text()[-4000:]
            raise RuntimeError(f"{spec['framework']} measurement failed (exit {process.returncode}):\n{tail}")
        result = json.loads(out.read_text())
    result["process_max_rss_kib"] = usage.ru_maxrss  # whole process lifetime, Linux: KiB
    result["process_seconds"] = time.perf_counter() - started
    return result


def base_spec(args, framework: str, **overrides) -> dict:
    workload = WORKLOADS[args.workload]
    spec = {"framework": framework, "workload": args.workload, "model": args.model, "mode": args.mode,
            "group_size": workload.group_size, "prompts_per_step": workload.prompts_per_step,
            "max_new_tokens": workload.max_new_tokens,
            "micro_batch_size": workload.micro_batch_size if args.micro_batch_size is None else args.micro_batch_size,
            "steps": args.steps, "warmup": args.warmup,
            "threads": args.threads, "fixed_length": args.model == "tiny" and not args.variable_length,
            "precision": args.precision,
            "one_token_prompt": False}
    spec.update(overrides)
    return spec


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# summaries


def summarize(results: list[dict]) -> dict:
    """Median over every timed step of every process of one framework."""
    steps = [s for r in results for s in r["steps"][r["warmup"]:]]
    seconds = [s["seconds"] for s in steps]
    rss = [r["peak_rss_kib"] / 1024 for r in results]
    return {
        "step_seconds": statistics.median(seconds),
        "step_seconds_all": seconds,
        "cpu_seconds": statistics.median(s.get("cpu_seconds", float("nan")) for s in steps),
        "tokens_per_second": statistics.median(s["completion_tokens"] / s["seconds"] for s in steps),
        "generation_share": statistics.median(s["gen_seconds"] / s["seconds"] for s in steps),
        "peak_rss_mib": statistics.median(rss),
        "peak_rss_mib_all": rss,
        "process_max_rss_mib_all": [r["process_max_rss_kib"] / 1024 for r in results],
        "completion_tokens_per_step": statistics.mean(s["completion_tokens"] for s in steps),
        "prompt_tokens_per_step": statistics.mean(s["prompt_tokens"] for s in steps),
        "tokens_forwarded_per_step": statistics.mean(s["tokens_forwarded"] for s in steps),
        "trainable_parameters": results[0]["trainable_parameters"],
        "timed_steps": len(steps),
    }


def step_time_target(args) -> float | None:
    if args.model == "tiny":
        return TINY_STEP_TIME_TARGET
    return STEP_TIME_TARGETS.get((args.model, args.workload, args.mode))


def comparison_table(args, forge: dict, trl: dict) -> tuple[str, dict]:
    target_time = step_time_target(args)
    target_rss = LONG_RSS_TARGET if args.workload == "long" else None
    rows, ratios = [], {}

    def row(name, key, fmt, target=None):
        ratio = forge[key] / trl[key] if trl[key] else float("nan")
        ratios[key] = ratio
        verdict = ""
        if target is not None:
            verdict = f"<= {target:g}: {'met' if ratio <= target else 'NOT met'}"
        rows.append(f"| {name} | {fmt.format(forge[key])} | {fmt.format(trl[key])} | {ratio:.2f}x | {verdict} |")

    row("seconds per optimizer step (median)", "step_seconds", "{:.2f}", target=target_time)
    row("CPU seconds per optimizer step (median; less sensitive to the neighbours' load)", "cpu_seconds", "{:.2f}")
    row("completion tokens per second", "tokens_per_second", "{:.1f}")
    row("peak RSS, MiB (VmHWM after the last timed step)", "peak_rss_mib", "{:.0f}", target=target_rss)
    row("share of step time generating", "generation_share", "{:.0%}")
    row("completion tokens per step (mean)", "completion_tokens_per_step", "{:.0f}")
    row("prompt tokens per step (prompts x group)", "prompt_tokens_per_step", "{:.0f}")
    row("tokens through the model per step", "tokens_forwarded_per_step", "{:.0f}")
    head = ["| metric | Forge | TRL | Forge/TRL | target |", "|---|---:|---:|---:|---|"]
    return "\n".join(head + rows), ratios


def scaling_table(args, scaling: list[dict]) -> str:
    lines = [("| group size | completions/step | s/step, real prompt | s/step, 1-token prompt | prompt share of "
              "step time | prompt tokens per step (P x Lp) | prompt tokens forwarded by Forge | prompt share of "
              "tokens forwarded | same, prompt repeated per completion (as TRL) |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in scaling:
        real, short = entry["real"], entry["one_token"]
        share = (real["step_seconds"] - short["step_seconds"]) / real["step_seconds"]
        group = entry["group_size"]
        prompt_tokens = real["prompt_tokens_per_step"] / group  # per prompt row, summed over prompts
        forwarded = real["tokens_forwarded_per_step"] - short["tokens_forwarded_per_step"]
        repeated = 2 * real["prompt_tokens_per_step"]  # generation prefill + loss forward, once per completion
        lines.append(f"| {group} | {entry['completions']} | {real['step_seconds']:.2f} | "
                     f"{short['step_seconds']:.2f} | {share:.0%} | {prompt_tokens:.0f} | {forwarded:.0f} | "
                     f"{forwarded / real['tokens_forwarded_per_step']:.0%} | {repeated:.0f} |")
    return "\n".join(lines)


def precision_text(precision: str) -> str:
    if precision == "float32":
        return "fp32 for both"
    from forge.model import choose_precision, cpu_has_bf16_units

    chosen = choose_precision("auto", "cpu")
    trl_bf16 = cpu_has_bf16_units()[0]
    return (f"each at its best dtype here: Forge dtype='auto' -> {str(chosen.compute).removeprefix('torch.')} "
            f"({chosen.reason}), TRL bf16={trl_bf16}")


def report(args, command: str, info: dict, forge=None, trl=None, scaling=None) -> tuple[str, dict]:
    workload = WORKLOADS[args.workload]
    fixed = args.model == "tiny" and not args.variable_length
    load = ", ".join(f"{x:.1f}" for x in info.get("load_average", ())) or "not recorded"
    versions = f"torch {info['torch']}, transformers {info['transformers']}, trl {info.get('trl', 'not installed')}"
    micro = base_spec(args, "forge")["micro_batch_size"] or "all"
    lengths = "fixed-length completions (EOS unreachable)" if fixed else "variable-length completions (EOS on)"
    machine = (f"Machine: {info['cpu_model']}, {info['cpu_cores']} cores, shared (load average at start {load}); "
               f"torch threads = {args.threads} for both frameworks; {versions}. Forge at {info['git']}.")
    setup = (f"Workload: {workload.description}; {workload.prompts_per_step} prompts x group {workload.group_size} "
             f"per optimizer step, max_new_tokens {workload.max_new_tokens}, {micro} completions per loss "
             f"forward/backward (micro-batch, both frameworks), {lengths}; {args.mode} fine-tuning, "
             f"{precision_text(args.precision)}, kl beta 0, loss_type 'grpo', temperature 0.9. {args.rounds} "
             f"processes per framework "
             f"alternating Forge/TRL, each {args.warmup} warm-up + {args.steps} timed step(s); medians over all "
             f"timed steps.")
    parts = [f"# Forge vs TRL GRPOTrainer: {args.workload} / {args.model} / {args.mode}", "",
             f"Command: `{command}`", "", machine, "", setup, ""]
    summary = {"args": vars(args), "command": command, "machine": info}
    if forge and trl:
        table, ratios = comparison_table(args, forge, trl)
        parts += [table, "", "Step times (s), every timed step:", "",
                  f"- Forge: {', '.join(f'{x:.2f}' for x in forge['step_seconds_all'])}",
                  f"- TRL: {', '.join(f'{x:.2f}' for x in trl['step_seconds_all'])}", ""]
        summary.update(forge=forge, trl=trl, ratios=ratios)
    if scaling:
        note = ("Fixed-length completions (EOS unreachable) so only the prompt differs between the two columns; "
                f"{WORKLOADS['long'].prompts_per_step} prompts per step, one group per loss micro-batch (so each "
                "prompt is computed once per group in generation and once in the loss). Prompt share = (real - 1-token) / real. "
                "Prompt tokens forwarded = tokens through the model per step, real minus 1-token prompt.")
        parts += ["## Scaling with the group size (Forge, long workload)", "", note, "", scaling_table(args, scaling), ""]
        summary["scaling"] = scaling
    return "\n".join(parts), summary


# ----------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = (f"{args.workload}_{args.model}_{args.mode}" + ("_scaling" if args.scaling_only else "")
            + ("_best" if args.precision == "best" else ""))
    if args.from_raw:
        raw = json.loads(Path(args.from_raw).read_text())
        command, info = raw["command"], raw.get("machine") or machine_info(args.threads)
    else:
        command = "python bench/compare_trl.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        info = machine_info(args.threads)
        try:
            import trl

            info["trl"] = trl.__version__
        except ImportError:
            if not args.scaling_only:
                sys.exit("TRL is not installed: pip install 'forge-rl[bench]' (or run with --scaling-only)")
        raw = {"command": command, "machine": info, "measurements": []}
        run_all(args, raw, out_dir / f"{stem}.raw.json")
    forge_summary, trl_summary, scaling = summaries(args, raw["measurements"])
    text, summary = report(args, command, info, forge_summary, trl_summary, scaling)
    print(text)
    (out_dir / f"{stem}.md").write_text(text)
    (out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    log(f"wrote {out_dir / stem}.md and .json")


def run_all(args, raw: dict, raw_path: Path) -> None:
    """Run every measurement, saving the raw numbers after each one (a failure later loses nothing)."""

    def measure(spec: dict) -> None:
        result = run_measurement(spec, args.timeout)
        raw["measurements"].append(result)
        raw_path.write_text(json.dumps(raw, indent=1))
        times = ", ".join(f"{s['seconds']:.2f}" for s in result["steps"])
        log(f"  {spec['framework']}: steps {times} s, peak RSS {result['peak_rss_kib'] / 1024:.0f} MiB")

    if not args.scaling_only:
        for round_index in range(args.rounds):
            for framework in ("forge", "trl"):
                log(f"round {round_index + 1}/{args.rounds}: {framework}")
                measure(base_spec(args, framework, role="compare"))
    if args.workload == "long" and not args.no_scaling:
        for group in [int(g) for g in args.group_sizes.split(",")]:
            for _ in range(args.scaling_rounds):
                for one_token in (False, True):
                    log(f"scaling: group {group}, {'1-token' if one_token else 'real'} prompt")
                    measure(base_spec(args, "forge", role="scaling", group_size=group, fixed_length=True,
                                      micro_batch_size=group, one_token_prompt=one_token))


def summaries(args, measurements: list[dict]):
    """(Forge summary, TRL summary, scaling rows) from the raw measurements."""
    compare_count = 0 if args.scaling_only else 2 * args.rounds  # raw files from before specs carried a role
    for index, result in enumerate(measurements):
        result["spec"].setdefault("role", "compare" if index < compare_count else "scaling")
    by_framework = {"forge": [], "trl": []}
    scaling_runs: dict[int, dict[str, list]] = {}
    for result in measurements:
        spec = result["spec"]
        if spec["role"] == "compare":
            by_framework[spec["framework"]].append(result)
        else:
            kind = "one_token" if spec.get("one_token_prompt") else "real"
            scaling_runs.setdefault(spec["group_size"], {"real": [], "one_token": []})[kind].append(result)
    forge = summarize(by_framework["forge"]) if by_framework["forge"] else None
    trl = summarize(by_framework["trl"]) if by_framework["trl"] else None
    scaling = [{"group_size": group, "completions": group * WORKLOADS["long"].prompts_per_step,
                **{kind: summarize(results) for kind, results in runs.items()}}
               for group, runs in sorted(scaling_runs.items()) if runs["real"] and runs["one_token"]]
    return forge, trl, scaling or None


if __name__ == "__main__":
    main()
