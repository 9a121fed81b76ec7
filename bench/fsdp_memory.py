"""Peak memory per rank: FSDP2 (--fsdp) vs data-parallel, 2 CPU processes (gloo), full fine-tuning.

    python bench/fsdp_memory.py [--models wide,default] [--steps 2] [--rounds 1]

For each model, `forge train` runs under torch.distributed.run with 2 processes, once data-parallel and
once with --fsdp (alternating, `--rounds` times), on the same rows, reward and seed. Each rank reports its
peak resident set size (getrusage ru_maxrss, which includes the ~0.4 GB of the Python/torch runtime) and
the bytes of parameters it holds; rank 0 reports the mean step time. Models:

    wide      a random-init Llama built from a config (8 layers, hidden 768, 69M parameters), no download
    default   the packaged SmolLM2-135M-Instruct

Full fine-tuning with AdamW keeps 16 bytes per parameter in fp32 (weights, gradients, two moments): data
parallelism keeps all of it on each rank, FSDP2 1/N of it, plus the whole weights while a rollout decodes.
Writes bench/results/fsdp_memory.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REWARD = "def text_length(prompts, completions, **kwargs):\n    return [len(t) % 7 / 6 for t in completions]\n"


def worker(report: str, argv: list[str]) -> int:
    """One rank: forge train, then its peak RSS and the parameter bytes it holds, as one JSON line."""
    from forge.core import sharding
    from forge.core.trainer import GRPOTrainer
    from forge.cli import main

    held = {}
    real_init = GRPOTrainer.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        held["parameter_bytes"] = sum(sharding.local(p).numel() * p.element_size() for p in self.model.parameters())

    GRPOTrainer.__init__ = recording_init
    code = main(argv)
    rank = int(os.environ.get("RANK", "0"))
    with open(report, "a") as f:
        f.write(json.dumps({"rank": rank, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            **held}) + "\n")
    return code


def build_wide(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from forge.core.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=768, intermediate_size=3072, num_hidden_layers=8,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run(model: str, fsdp: bool, work: Path, steps: int, tag: str) -> dict:
    out, report = work / f"out-{tag}", work / f"report-{tag}.jsonl"
    argv = ["train", "--model", model, "--dataset", str(work / "data.jsonl"), "--reward",
            f"{work / 'rewards.py'}:text_length", "--output_dir", str(out), "--overwrite_output_dir",
            "--group_size", "4", "--prompts_per_step", "2", "--max_new_tokens", "16", "--max_steps", str(steps),
            "--save_steps", "0", "--logging_steps", "1", "--learning_rate", "1e-5", "--seed", "0",
            *(["--fsdp"] if fsdp else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           __file__, "--worker", str(report), *argv], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    ranks = sorted((json.loads(line) for line in report.read_text().splitlines()), key=lambda r: r["rank"])
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    return {"fsdp": fsdp, "ranks": ranks, "wall_seconds": time.perf_counter() - started,
            "step_seconds": [row["step_seconds"] for row in log]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="wide,default")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "fsdp_memory.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="forge-fsdp-bench-"))
    rows = [{"prompt": f"What is {a} * {b}? Answer with the number.", "reference": str(a * b)}
            for a in range(3, 9) for b in range(4, 8)]
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "rewards.py").write_text(REWARD)
    results = {"machine": {"cpu": _cpu_name(), "cores": os.cpu_count(),
                           "load_average_start": os.getloadavg()}, "steps": args.steps, "models": {}}
    for name in args.models.split(","):
        model = name
        if name == "wide":
            model = str(work / "wide")
            build_wide(Path(model))
        runs = []
        for r in range(args.rounds):
            for fsdp in (False, True):  # alternating: data-parallel, FSDP, data-parallel, ...
                runs.append(run(model, fsdp, work, args.steps, f"{name}-{'fsdp' if fsdp else 'dp'}-{r}"))
                print(f"{name} {'fsdp' if fsdp else 'dp  '}: peak RSS per rank "
                      f"{[round(x['peak_rss_bytes'] / 2**30, 3) for x in runs[-1]['ranks']]} GiB", flush=True)
        results["models"][name] = runs
    results["machine"]["load_average_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n| model | mode | parameters held per rank | peak RSS per rank (max of 2) | FSDP / DP | step s |")
    print("|---|---|---|---|---|---|")
    for name, runs in results["models"].items():
        dp = max(max(x["peak_rss_bytes"] for x in r["ranks"]) for r in runs if not r["fsdp"])
        for mode in (False, True):
            mine = [r for r in runs if r["fsdp"] == mode]
            peak = max(max(x["peak_rss_bytes"] for x in r["ranks"]) for r in mine)
            held = mine[0]["ranks"][0]["parameter_bytes"]
            steps = [s for r in mine for s in r["step_seconds"][1:] or r["step_seconds"]]
            print(f"| {name} | {'FSDP2' if mode else 'data-parallel'} | {held / 2**20:.0f} MiB | "
                  f"{peak / 2**30:.2f} GiB | {peak / dp:.2f}x | {sum(steps) / len(steps):.1f} |")
    print(f"\nwritten to {args.out}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3:]))
    main()
