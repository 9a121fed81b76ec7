"""One table of every Forge/TRL comparison in bench/results/*.json (docs/performance.md).

    python bench/summary.py [--results bench/results]

Reads the summaries compare_trl.py wrote; measures nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = {("short", "tiny", "lora"): 0, ("short", "tiny", "full"): 1, ("long", "tiny", "lora"): 2,
         ("long", "tiny", "full"): 3, ("short", "smollm2", "lora"): 4, ("short", "smollm2", "full"): 5,
         ("long", "smollm2", "lora"): 6, ("long", "smollm2", "full"): 7}


def comparisons(results: Path) -> list[dict]:
    found = []
    for path in results.glob("*.json"):
        if path.name.endswith(".raw.json"):
            continue
        summary = json.loads(path.read_text())
        if "ratios" in summary:  # a Forge/TRL comparison (not a scaling-only or checkpointing file)
            summary["file"] = path.with_suffix(".md").name
            found.append(summary)
    key = lambda s: ORDER.get((s["args"]["workload"], s["args"]["model"], s["args"]["mode"]), 99)
    return sorted(found, key=key)


def table(summaries: list[dict]) -> str:
    lines = [("| workload | model | mode | Forge s/step | TRL s/step | step time Forge/TRL | CPU time Forge/TRL | peak RSS Forge/TRL "
             "(MiB) | tokens through the model Forge/TRL | timed steps each | details |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in summaries:
        args, forge, trl, ratios = s["args"], s["forge"], s["trl"], s["ratios"]
        lengths = "fixed-length" if args["model"] == "tiny" and not args.get("variable_length") else "EOS on"
        lines.append(
            f"| {args['workload']} | {args['model']} ({lengths}) | {args['mode']} | {forge['step_seconds']:.2f} | "
            f"{trl['step_seconds']:.2f} | **{ratios['step_seconds']:.2f}x** | {ratios['cpu_seconds']:.2f}x | "
            f"{ratios['peak_rss_mib']:.2f}x "
            f"({forge['peak_rss_mib']:.0f} / {trl['peak_rss_mib']:.0f}) | {ratios['tokens_forwarded_per_step']:.2f}x | "
            f"{forge['timed_steps']} | `bench/results/{s['file']}` |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(HERE / "results"))
    args = p.parse_args(argv)
    print(table(comparisons(Path(args.results))))


if __name__ == "__main__":
    main()
