"""`forge demo` synchronous against async (max_staleness=1), end to end, alternating, on this machine.

    python bench/async_demo.py run [--pairs 1] [--seed 0] [--steps 60] [--bound] [--extra "--eval_every 0 ..."]
    python bench/async_demo.py report                # the table from the runs in bench/results/async_demo/

`run` runs, in turn, `forge demo --seed S` (both cores, the synchronous run) and `forge demo --seed S --async`
(the rollout worker on one core, the trainer on the rest), `--pairs` times (A B A B, so drift in the machine's
speed hits both alike). The two-core bound is each side's one-core seconds a step, summed and halved: the best a
step can be with both cores always busy. The async run measures both sides on one core each (the worker's
async/sampler_s; the trainer's step_time less async/trainer_wait_s); with --bound, `forge demo --seed S
--threads 1` measures them once more on one thread alone (its generation, and the rest of its step). Each run's folder keeps its demo_result.json and training_log.jsonl; `report`
prints, for each pair, the end-to-end and training wall seconds, the ratio async / synchronous, the seconds a
step against the bound, who waited how long (async/trainer_wait_s, async/sampler_idle_s), and the held-out
accuracies, and writes bench/results/async_demo.json with the CPU named.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RAW = HERE / "results" / "async_demo"
OUT = HERE / "results" / "async_demo.json"


def demo(out: Path, seed: int, steps: int, *flags: str) -> dict:
    """Run `forge demo` into `out`; its wall seconds from outside, and the demo's own result."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "forge", "demo", "--seed", str(seed), "--steps", str(steps),
               "--output_dir", str(out), *flags]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    result = json.loads((out / "demo_result.json").read_text())
    return {"command": shlex.join(["forge", *command[3:]]), "wall_seconds": time.perf_counter() - started,
            "result": result}


def run(args: argparse.Namespace) -> None:
    RAW.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.extra)
    tag = "_".join(flag.strip("-") for flag in extra) or "own_loop"
    for pair in range(args.pairs):
        for kind, flags in [(k, f) for k, f in (("sync", []), ("async", ["--async"])) if k in args.kinds.split(",")]:
            out = RAW / f"{tag}_seed{args.seed}_{kind}_{pair}"
            record = demo(out, args.seed, args.steps, *flags, *extra)
            (out.with_suffix(".json")).write_text(json.dumps(record | {"kind": kind, "pair": pair}, indent=2))
            print(f"{out.name}: {record['wall_seconds']:.0f} s", flush=True)
    if not args.bound:
        return
    out = RAW / f"{tag}_seed{args.seed}_one_thread"
    record = demo(out, args.seed, args.steps, "--threads", "1", *extra)
    out.with_suffix(".json").write_text(json.dumps(record | {"kind": "one_thread"}, indent=2))
    print(f"{out.name}: {record['wall_seconds']:.0f} s", flush=True)


def log_rows(command: str) -> list[dict]:
    """The training rows of a run's training_log.jsonl (its folder under bench/results/async_demo/); a log written
    before step_time took TRL's name has step_seconds."""
    folder = RAW / Path(shlex.split(command)[shlex.split(command).index("--output_dir") + 1]).name
    rows = [json.loads(line) for line in (folder / "training_log.jsonl").read_text().splitlines() if line.strip()]
    return [{"step_time": row.get("step_seconds"), **row} for row in rows if "reward" in row]


def bound_per_step(one_thread: dict) -> dict:
    """Each side's one-core seconds a step (the one-thread run's generation, and the rest of its step), their
    sum halved: a step when both cores are always busy."""
    rows = log_rows(one_thread["command"])
    generation = statistics.fmean(r["generation_share"] * r["step_time"] for r in rows)
    rest = statistics.fmean(r["step_time"] for r in rows) - generation
    return {"sampling_one_core_s": generation, "learning_one_core_s": rest, "bound_s": (generation + rest) / 2}


def report(_: argparse.Namespace) -> None:
    records = [json.loads(p.read_text()) for p in sorted(RAW.glob("*.json"))]
    groups: dict[str, list] = {}
    for record in records:
        name = Path(shlex.split(record["command"])[shlex.split(record["command"]).index("--output_dir") + 1]).name
        groups.setdefault(name.split("_seed")[0] + "_seed" + name.split("_seed")[1].split("_")[0], []).append(record)
    summary = {}
    for name, group in groups.items():
        one = [r for r in group if r["kind"] == "one_thread"]
        bound = bound_per_step(one[0]) if one else None
        pairs = []
        for pair in sorted({r["pair"] for r in group if "pair" in r}):
            seed_group = groups.get("own_loop_seed" + name.split("_seed")[1], group)  # an async-only run: its sync
            sync = next(r for r in group + seed_group if r.get("pair") == pair and r["kind"] == "sync")
            asyn = next(r for r in group if r.get("pair") == pair and r["kind"] == "async")
            steps = [log_rows(r["command"]) for r in (sync, asyn)]
            per_step = [statistics.fmean(row["step_time"] for row in rows[1:]) for rows in steps]  # step 1: start
            waits = {key: sum(row.get(f"async/{key}", 0.0) for row in steps[1])
                     for key in ("trainer_wait_s", "sampler_idle_s", "sampler_s")}
            # each side's one-core seconds a step as the async run measured them (each process on its own core):
            # the worker's sampling, the trainer's step less its wait
            sampling = statistics.fmean(row["async/sampler_s"] for row in steps[1][1:])
            learning = statistics.fmean(row["step_time"] - row["async/trainer_wait_s"] for row in steps[1][1:])
            on_cores = {"sampling_one_core_s": sampling, "learning_one_core_s": learning,
                        "bound_s": (sampling + learning) / 2}
            pairs.append({
                "end_to_end_s": [sync["wall_seconds"], asyn["wall_seconds"]],
                "end_to_end_ratio": asyn["wall_seconds"] / sync["wall_seconds"],
                "training_s": [sync["result"]["train_seconds"], asyn["result"]["train_seconds"]],
                "training_ratio": asyn["result"]["train_seconds"] / sync["result"]["train_seconds"],
                "seconds_per_step_after_the_first": per_step,
                "bound_from_the_async_run": on_cores,
                "async_per_step_over_bound": per_step[1] / on_cores["bound_s"],
                "sync_per_step_over_bound": per_step[0] / on_cores["bound_s"],
                "async_per_step_over_one_thread_bound": per_step[1] / bound["bound_s"] if bound else None,
                "async_waits_total_s": waits,
                "heldout_strict_accuracy": [sync["result"]["after"]["strict_accuracy"],
                                            asyn["result"]["after"]["strict_accuracy"]],
                "heldout_size": sync["result"]["heldout_size"]})
        machine = group[0]["result"]["machine"]
        summary[name] = {"cpu": machine["cpu"], "cores": machine["cores"], "precision": machine["precision"],
                         "bound": bound, "pairs": pairs, "commands": sorted({r["command"] for r in group})}
        print(f"{name} on {machine['cpu']} ({machine['precision']}):")
        if bound:
            print(f"  one core: sampling {bound['sampling_one_core_s']:.2f} s + learning "
                  f"{bound['learning_one_core_s']:.2f} s a step; bound {bound['bound_s']:.2f} s a step")
        for i, p in enumerate(pairs):
            print(f"  pair {i}: end to end {p['end_to_end_s'][0]:.0f} s sync, {p['end_to_end_s'][1]:.0f} s async "
                  f"({p['end_to_end_ratio']:.2f}x); training {p['training_ratio']:.2f}x; a step "
                  f"{p['seconds_per_step_after_the_first'][0]:.2f} / {p['seconds_per_step_after_the_first'][1]:.2f} s"
                  f" (one core: sampling {p['bound_from_the_async_run']['sampling_one_core_s']:.2f} s, learning "
                  f"{p['bound_from_the_async_run']['learning_one_core_s']:.2f} s; bound "
                  f"{p['bound_from_the_async_run']['bound_s']:.2f} s; async {p['async_per_step_over_bound']:.2f}x it)"
                  + f"; trainer waited {p['async_waits_total_s']['trainer_wait_s']:.0f} s, worker idle "
                  f"{p['async_waits_total_s']['sampler_idle_s']:.0f} s; held-out "
                  f"{p['heldout_strict_accuracy'][0]:.1%} / {p['heldout_strict_accuracy'][1]:.1%}")
    OUT.write_text(json.dumps(summary, indent=2))
    print(f"wrote {OUT}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run")
    go.add_argument("--pairs", type=int, default=1)
    go.add_argument("--seed", type=int, default=0)
    go.add_argument("--steps", type=int, default=60)
    go.add_argument("--kinds", default="sync,async", help="which of the pair to run (async alone: another "
                    "--max_staleness in --extra, against a pair's synchronous run)")
    go.add_argument("--bound", action="store_true", help="then once on one thread: each side's one-core time")
    go.add_argument("--extra", default="", help="more `forge demo` flags for every run, e.g. '--eval_every 0'")
    sub.add_parser("report")
    args = parser.parse_args()
    {"run": run, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
