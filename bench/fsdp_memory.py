"""Peak memory per rank: FSDP2 (--fsdp) vs data-parallel, 2 CPU processes (gloo), full fine-tuning.

    python bench/fsdp_memory.py [--models wide,default] [--steps 2] [--rounds 1]

For each model, `forge train` runs under torch.distributed.run with 2 processes, once data-parallel and
once with --fsdp (alternating, `--rounds` times; `--report-only` rebuilds the table from the JSON), on the same rows, reward and seed. Each rank reports the
bytes of parameters it holds and the peaks of its resident set size in each phase (each includes the ~0.4 GB
of the Python/torch runtime): setup (loading: every rank reads the whole model on the CPU before it is
sharded), the training steps (on a GPU, the part that decides what fits), the final save (final/ gathers the
whole weights to rank 0), and the whole run (ru_maxrss). Each phase's peak is VmHWM, restarted with
/proc/self/clear_refs after glibc's malloc_trim at the phase's start. The step time is the mean over the
steps after the first. Models:

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
    from forge.cli import main
    from forge.core.trainer import GRPOTrainer
    from forge.parallel import sharding

    held = {}
    real_init = GRPOTrainer.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        held["parameter_bytes"] = sum(sharding.local(p).numel() * p.element_size() for p in self.model.parameters())
        held["setup_peak_rss_bytes"] = _peak_rss()
        _reset_peak_rss()  # from here: the training phase alone

    from forge.run.lifecycle import RunLifecycle

    real_save = RunLifecycle.save

    def recording_save(self, finished, name=None):
        if name == "final":  # the steps' peak; from here the final save (the gathered weights)
            held["steps_peak_rss_bytes"] = _peak_rss()
            _reset_peak_rss()
        return real_save(self, finished, name)

    GRPOTrainer.__init__ = recording_init
    RunLifecycle.save = recording_save
    code = main(argv)
    rank = int(os.environ.get("RANK", "0"))
    with open(report, "a") as f:
        final = _peak_rss()
        f.write(json.dumps({"rank": rank, "final_save_peak_rss_bytes": final, **held,
                            "peak_rss_bytes": max(final, held["setup_peak_rss_bytes"], held["steps_peak_rss_bytes"])})
                + "\n")
    return code


def _peak_rss() -> int:
    """VmHWM of /proc/self/status: the peak resident set since the process started or since _reset_peak_rss."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> None:
    """Give freed heap back to the OS (glibc malloc_trim), then restart the VmHWM count (Linux clear_refs 5)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def build_wide(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from forge.model.tiny import build_tiny_tokenizer

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
                           __file__, "--worker", str(report), *argv], check=False, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    ranks = sorted((json.loads(line) for line in report.read_text().splitlines()), key=lambda r: r["rank"])
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    return {"fsdp": fsdp, "ranks": ranks, "wall_seconds": time.perf_counter() - started,
            "step_seconds": [row["step_time"] for row in log]}


def main() -> None:
    from workloads import cpu_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="wide,default")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "fsdp_memory.json"))
    parser.add_argument("--report-only", action="store_true", help="print the table of an existing --out file")
    args = parser.parse_args()
    if args.report_only:
        print_table(json.loads(Path(args.out).read_text()))
        return
    work = Path(tempfile.mkdtemp(prefix="forge-fsdp-bench-"))
    rows = [{"prompt": f"What is {a} * {b}? Answer with the number.", "reference": str(a * b)}
            for a in range(3, 9) for b in range(4, 8)]
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "rewards.py").write_text(REWARD)
    results = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average_start": os.getloadavg(),
                           "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_")},
               "steps": args.steps, "models": {}}
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
    print_table(results)
    print(f"\nwritten to {args.out}")


def print_table(results: dict) -> None:
    print("| model | mode | parameters held per rank | peak RSS per rank: setup | training steps | final save "
          "| whole run | step s |")
    print("|---|---|---|---|---|---|---|---|")
    keys = ("setup_peak_rss_bytes", "steps_peak_rss_bytes", "final_save_peak_rss_bytes", "peak_rss_bytes")
    for name, runs in results["models"].items():
        for mode in (False, True):
            held = next(r for r in runs if r["fsdp"] == mode)["ranks"][0]["parameter_bytes"]
            cells = [f"{_peak(runs, mode, k) / 2**30:.2f} GiB ({_peak(runs, mode, k) / _peak(runs, False, k):.2f}x)"
                     for k in keys]
            step = _mean_step(runs, mode)
            print(f"| {name} | {'FSDP2' if mode else 'data-parallel'} | {held / 2**20:.0f} MiB | "
                  + " | ".join(cells) + f" | {step:.1f} ({step / _mean_step(runs, False):.2f}x) |")


def _peak(runs: list[dict], fsdp: bool, key: str) -> int:
    """The highest of both ranks' `key` over the runs of one mode."""
    return max(max(rank[key] for rank in r["ranks"]) for r in runs if r["fsdp"] == fsdp)


def _mean_step(runs: list[dict], fsdp: bool) -> float:
    """Mean step seconds of one mode, leaving out each run's first step (warm-up) when it has more."""
    steps = [s for r in runs if r["fsdp"] == fsdp for s in (r["step_seconds"][1:] or r["step_seconds"])]
    return sum(steps) / max(len(steps), 1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3:]))
    main()
