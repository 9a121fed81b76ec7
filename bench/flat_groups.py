"""The share of flat groups (every completion scored alike: no GRPO signal) step by step, from training logs.

    python bench/flat_groups.py RUN_DIR [RUN_DIR ...] [--block 10]

Reads each run's training_log.jsonl (`frac_reward_zero_std` of every step, as `forge demo` and `forge train` log
it) and prints, per block of `--block` steps, the mean share of flat groups and how many steps had every group
flat (steps that trained on nothing), then the same over all the runs given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def shares(run: Path) -> list[float]:
    """frac_reward_zero_std of each training step of a run, in step order."""
    rows = [
        json.loads(line) for line in (run / "training_log.jsonl").read_text().splitlines() if line.strip()
    ]
    name = "frac_reward_zero_std"  # a log written before the metric took TRL's name: frac_zero_std_groups
    return [float(row.get(name, row.get("frac_zero_std_groups"))) for row in rows
            if name in row or "frac_zero_std_groups" in row]


def blocks(values: list[float], size: int) -> list[tuple[str, float, int]]:
    """(steps a-b, mean share, steps with every group flat) per block of `size` steps."""
    out = []
    for start in range(0, len(values), size):
        part = values[start : start + size]
        out.append((f"{start + 1}-{start + len(part)}", sum(part) / len(part), sum(v >= 1.0 for v in part)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--block", type=int, default=10)
    args = parser.parse_args(argv)
    runs = {run: shares(Path(run)) for run in args.runs}
    for run, values in runs.items():
        print(
            f"{run}: {len(values)} steps, flat groups {sum(values) / max(len(values), 1):.0%} of all, "
            f"{sum(v >= 1.0 for v in values)} steps with every group flat"
        )
        for steps, mean, empty in blocks(values, args.block):
            print(f"  steps {steps:>7s}: {mean:4.0%} flat, {empty} of them every group flat")
    if len(runs) > 1:
        length = min(len(v) for v in runs.values())
        pooled = [sum(v[i] for v in runs.values()) / len(runs) for i in range(length)]
        print(f"all {len(runs)} runs, steps 1-{length}:")
        for steps, mean, _ in blocks(pooled, args.block):
            print(f"  steps {steps:>7s}: {mean:4.0%} flat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
