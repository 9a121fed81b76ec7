"""Peak memory of each phase of a GRPO step: loading, generation, reference/old log-probs, the loss pass.

Each phase's peak is the process's peak resident memory (Linux VmHWM, reset before the phase through
/proc/self/clear_refs) minus its resident memory when the phase began, so a figure is what that phase adds on
top of what was alive. Next to the measured peaks, what the phase holds by arithmetic: the weights, the KV cache
of the rollout, and the (N, T, V) logits a loss pass over one micro-batch would hold in the compute dtype.

Workloads (nothing is downloaded):
    demo   the packaged SmolLM2-135M-Instruct, `forge demo`'s config: LoRA, 4 prompts x 8 completions,
           64 new tokens, one group per micro-batch, the demo's chat prompts and rewards
    qwen   a random-init model of Qwen2.5-0.5B's shape (896 wide, 24 layers, 14/2 heads, 151,936 vocabulary) with
           SmolLM2's tokenizer: LoRA, 4 prompts x 8 completions x 256 new tokens, kl_beta 0.04, defaults otherwise

    python bench/memory_phases.py demo                      # one run, printed as a table, JSON on the last line
    python bench/memory_phases.py demo --set gradient_checkpointing=true --steps 3
    python bench/memory_phases.py qwen --against /tmp/forge-before --repeats 2
        # --against: a second checkout of Forge (e.g. `git worktree add /tmp/forge-before <commit>`): both
        # checkouts run the same workload in fresh processes, alternating A B B A ..., and the table gives both

Each run is its own process (`--child`), so one run's freed memory does not lower the next one's figures.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QWEN_SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
              "tie_word_embeddings": True, "rope_theta": 1000000.0}


def status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak() -> float:
    """Give freed heap back to the system, reset the peak to the current resident size; returns that size."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mb("VmRSS")


class PhaseMeter:
    """Records, per phase name, the largest rise of peak resident memory over the phase's starting size."""

    def __init__(self):
        self.peaks: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, list[tuple[float, float]]] = {}  # (resident at its start, its rise) per call

    def wrap(self, name, fn):
        def measured(*args, **kwargs):
            start = reset_peak()
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                rise = status_mb("VmHWM") - start
                self.peaks[name] = max(self.peaks.get(name, 0.0), rise)
                self.calls.setdefault(name, []).append((round(start), round(rise)))
                self.seconds[name] = self.seconds.get(name, 0.0) + time.process_time() - t0
        return measured


def build(workload: str, overrides: dict):
    """(trainer, rows) for a workload, the trainer built with its config plus `overrides`."""
    import torch

    from forge.core.config import GRPOConfig
    from forge.core.trainer import GRPOTrainer
    from forge.data.arithmetic import arithmetic_dataset
    from forge.model import load_model

    rows = arithmetic_dataset(n=64, seed=0, chat=True)
    if workload == "demo":
        from forge.demo import DemoSettings, demo_config, demo_rewards

        settings = DemoSettings(seed=0)
        config = demo_config(settings, "/tmp/forge_memory_phases", **({"eval_steps": 0, "preflight": "off"} | overrides))
        model, tokenizer = load_model("default")
        return GRPOTrainer(model, tokenizer, demo_rewards(), config), rows
    if workload == "qwen":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        _, tokenizer = load_model("default")
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_SHAPE)).to(torch.bfloat16).eval()

        def varied(prompts, completions, **kwargs):  # any reward that differs within a group
            return [float(len(str(c)) % 7) for c in completions]

        config = GRPOConfig(**{"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 256, "kl_beta": 0.04,
                               "use_lora": True, "logging_steps": 1, "save_steps": 0, "preflight": "off",
                               "output_dir": "/tmp/forge_memory_phases", "overwrite_output_dir": True} | overrides)
        return GRPOTrainer(model, tokenizer, varied, config), rows
    raise ValueError(f"unknown workload {workload!r}: demo or qwen")


def arithmetic(trainer, batch) -> dict:
    """What the phases hold by arithmetic, in MB: weights, the rollout's KV cache, one micro-batch's logits."""
    config, model = trainer.config, trainer.model
    cfg = model.config
    element = torch_size(trainer.precision.compute)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    rollout = batch.rollouts[0]
    rows, new = rollout.completion_ids.shape
    prompt = rollout.prompt_ids.shape[1]
    heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_hidden_layers * 2 * heads * head_dim * rows * (prompt + new) * element / 2**20
    micro = config.micro_batch_size or rows
    logits = micro * new * cfg.vocab_size * element / 2**20
    return {"weights_mb": weights, "kv_cache_mb": kv, "micro_batch_logits_mb": logits,
            "rows": rows, "prompt_tokens": prompt, "new_tokens": new, "micro_batch_size": micro}


def torch_size(dtype) -> int:
    import torch

    return torch.empty(0, dtype=dtype).element_size()


def child(workload: str, overrides: dict, steps: int, threads: int, train: bool = False) -> dict:
    import torch

    from forge.run.optim import make_scheduler

    torch.set_num_threads(threads)
    meter = PhaseMeter()
    start = reset_peak()
    trainer, rows = build(workload, overrides)
    load_mb = status_mb("VmHWM") - start
    trainer.scheduler = make_scheduler(trainer.optimizer, "constant", 0.0, steps)
    methods = {"generate": "sample_completions", "reference_logprobs": "reference_logprobs",
               "old_logprobs": "old_logprobs", "update": "update"}  # the phase's label: the trainer's method
    for name, method in methods.items():
        setattr(trainer, method, meter.wrap(name, getattr(trainer, method)))
    per = trainer.config.prompts_per_step
    step_cpu, batch = [], None
    original_collect = trainer.collect

    def collect(mine):
        nonlocal batch
        batch, stats = original_collect(mine)
        return batch, stats

    trainer.collect = collect
    peak_start = reset_peak()
    if train:  # the whole run: train() with its preflight (which may fit micro_batch_size='auto')
        trainer.config = dataclasses.replace(trainer.config, max_steps=steps)
        t0 = time.process_time()
        trainer.train(rows[:per * steps])
        step_cpu.append(time.process_time() - t0)
    for i in range(0 if train else steps):
        t0 = time.process_time()
        trainer.step(rows[per * i: per * (i + 1)])
        step_cpu.append(time.process_time() - t0)
    return {"workload": workload, "overrides": overrides, "threads": threads, "steps": steps,
            "load_mb": load_mb, "resident_after_load_mb": peak_start,
            "phase_peak_mb": meter.peaks, "phase_cpu_seconds": meter.seconds, "phase_calls_mb": meter.calls,
            "step_cpu_seconds": step_cpu, "micro_batch_size": getattr(trainer, "micro_batch_size", trainer.config.micro_batch_size), "train": train,

            "arithmetic": arithmetic(trainer, batch)}


def parse_overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = json.loads(value) if value not in ("", None) and value[0] in "0123456789-[{tfn\"" else value
    return out


def run_child(source: Path, args) -> dict:
    cmd = [sys.executable, str(HERE / "memory_phases.py"), args.workload, "--child", "--steps", str(args.steps),
           "--threads", str(args.threads), *(["--train"] if args.train else []),
           *(x for s in args.set for x in ("--set", s))]
    timer = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").exists() else None)
    with tempfile.NamedTemporaryFile(suffix=".txt") as peak_file:
        if timer:  # the whole child's peak resident set, as /usr/bin/time -v reports it (KiB)
            cmd = [timer, "-f", "%M", "-o", peak_file.name, *cmd]
        out = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(source)), capture_output=True, text=True,
                             cwd=source, check=False)
        if out.returncode:
            raise SystemExit(f"{source}: run failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        text = Path(peak_file.name).read_text().strip()
        result["process_peak_mb"] = int(text.splitlines()[-1]) / 1024 if timer and text else None
    result["source"] = str(source)
    return result


def peak(result: dict) -> float:
    """The run's peak resident memory over its steps: the highest a phase reached over what it began from."""
    return max(start + rise for calls in result["phase_calls_mb"].values() for start, rise in calls)


def table(results: list[dict]) -> str:
    phases = ("generate", "reference_logprobs", "old_logprobs", "update")
    head = ["source", "load", *phases, "peak", "process peak", "micro-batch", "step CPU s"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in results:
        steps = r["step_cpu_seconds"][1:] or r["step_cpu_seconds"]  # the first step warms up
        lines.append(" | ".join([Path(r.get("source", "")).name or ".", f"{r['load_mb']:.0f}",
                                 *(f"{r['phase_peak_mb'].get(p, 0):.0f}" for p in phases),
                                 f"{peak(r):.0f}", f"{r.get('process_peak_mb') or 0:.0f}",
                                 str(r.get("micro_batch_size", "")), f"{sum(steps) / len(steps):.2f}"]))
    a = results[0]["arithmetic"]
    lines.append(f"(MB; by arithmetic: weights {a['weights_mb']:.0f}, KV cache of the rollout {a['kv_cache_mb']:.0f}, "
                 f"logits of one micro-batch of {a['micro_batch_size']} x {a['new_tokens']} tokens "
                 f"{a['micro_batch_logits_mb']:.0f})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=("demo", "qwen"))
    parser.add_argument("--set", action="append", default=[], help="a GRPOConfig override, e.g. micro_batch_size=8")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", type=Path, help="a second Forge checkout, run alternating with this one")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--train", action="store_true",
                        help="run train() for --steps steps (its preflight included) instead of bare steps")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.workload, parse_overrides(args.set), args.steps, args.threads, args.train)))
        return
    sys.path.insert(0, str(HERE))
    from workloads import machine_info

    sources = [HERE.parent] + ([args.against.resolve()] if args.against else [])
    results = []
    for i in range(args.repeats):
        for source in (sources if i % 2 == 0 else sources[::-1]):
            results.append(run_child(source, args))
            print(table(results[-1:]).splitlines()[2], flush=True)
    print(table(results))
    report = {"machine": machine_info(args.threads), "workload": args.workload, "set": args.set, "runs": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
