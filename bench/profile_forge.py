"""Where a Forge GRPO step spends its time: torch.profiler over one optimizer step, after a warm-up step.

    python bench/profile_forge.py --workload short --model smollm2 --mode lora [--threads 1] [--precision best]

Same trainer settings as compare_trl.py. Prints the time of each phase of the step (labelled with
record_function around the trainer's and the rollout's functions) and the top operators by self CPU time;
writes a Chrome trace to bench/results/profile_<workload>_<model>_<mode>.json (open in chrome://tracing or
https://ui.perfetto.dev) when --trace is given.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import runners
from workloads import WORKLOADS, dataset_rows, load_model, suppress_eos

# (module, function name, label): wrapped in torch.profiler.record_function for the phase table.
PHASES = [
    ("forge.core.trainer", "generate", "generate (the decode loop)"),
    ("forge.core.rollout", "sample_next_token", "  sampling"),
    ("forge.core.logprobs", "completion_logprobs", "loss forward: completion_logprobs"),
    ("forge.core.logprobs", "logprobs_from_hidden", "  chunked log-softmax"),
    ("forge.core.trainer", "grpo_loss", "  grpo_loss"),
    ("forge.core.trainer", "score_rollout", "score rewards"),
]


def labelled(function, label):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return function(*args, **kwargs)

    return wrapper


def install_labels() -> None:
    import importlib

    from forge.core.trainer import GRPOTrainer
    from forge.run.optim import GuardedStep

    for module_name, name, label in PHASES:
        module = importlib.import_module(module_name)
        setattr(module, name, labelled(getattr(module, name), label))
    for method, label in [("step", "optimizer step"), ("update", "update: loss forward + backward + optimizer"),
                          ("loss_and_backward", "  loss pass: forward + backward per micro-batch"),
                          ("collect", "collect: rollout + rewards")]:
        setattr(GRPOTrainer, method, labelled(getattr(GRPOTrainer, method), label))
    GuardedStep.step = labelled(GuardedStep.step, "  clip + AdamW step")
    original_backward = torch.Tensor.backward  # everything autograd runs lands under this label

    def backward(self, *args, **kwargs):
        with torch.profiler.record_function("  backward"):
            return original_backward(self, *args, **kwargs)

    torch.Tensor.backward = backward


class ProfilingRecorder(runners.Recorder):
    """Step 1 is the warm-up; the profiler records step 2, then the run stops."""

    def __init__(self):
        super().__init__(total_steps=2)
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def begin(self):
        super().begin()
        if len(self.steps) == 1:
            self.profiler.start()

    def end(self):
        if len(self.steps) == 1:
            self.profiler.stop()
        super().end()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="short")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--mode", choices=["lora", "full"], default="lora")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--one-token-prompt", action="store_true", help="replace each prompt by its first token")
    p.add_argument("--fixed-length", action="store_true", help="make EOS unreachable (default for tiny)")
    p.add_argument("--precision", choices=["float32", "best"], default="float32",
                   help="float32, or dtype='auto' (bf16 compute where the CPU has bf16 matrix units)")
    p.add_argument("--trace", action="store_true", help="also write a Chrome trace")
    p.add_argument("--top", type=int, default=25, help="operators to list")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    workload = WORKLOADS[args.workload]
    group_size = args.group_size or workload.group_size
    spec = {"workload": args.workload, "model": args.model, "mode": args.mode, "group_size": group_size,
            "prompts_per_step": workload.prompts_per_step, "max_new_tokens": workload.max_new_tokens,
            "micro_batch_size": workload.micro_batch_size if args.micro_batch_size is None else args.micro_batch_size,
            "precision": args.precision}
    model, tokenizer = load_model(args.model, args.workload)
    if args.fixed_length or args.model == "tiny":
        suppress_eos(model, tokenizer)
    rows = dataset_rows(args.workload, 20, one_token_prompt=args.one_token_prompt, tokenizer=tokenizer)

    install_labels()
    recorder = ProfilingRecorder()
    with tempfile.TemporaryDirectory() as output_dir:
        runners.run_forge(spec, model, tokenizer, rows, recorder, output_dir)

    events = recorder.profiler.key_averages()
    warmup, profiled = recorder.steps
    by_name = {e.key: e for e in events}
    total = by_name["optimizer step"].cpu_time_total / 1e6
    print(f"# Forge step profile: {args.workload} / {args.model} / {args.mode}, {args.threads} thread(s), "
          f"precision {args.precision}\n")
    print(f"warm-up step {warmup['seconds']:.2f} s; profiled step {total:.2f} s inside the profiler, "
          f"{profiled['gen_seconds']:.2f} s of it generating {profiled['completion_tokens']} completion tokens "
          f"({profiled['prompt_tokens']} prompt tokens x group)\n")
    print("| phase | seconds | share of step |\n|---|---:|---:|")
    labels = ["optimizer step"] + [label for _, _, label in PHASES] + ["update: loss forward + backward + optimizer", "  backward",
                                                   "  clip + AdamW step", "metrics"]
    for label in labels:
        event = by_name.get(label)
        if event is not None:
            seconds = event.cpu_time_total / 1e6
            name = f"- {label.strip()}" if label.startswith("  ") else label
            print(f"| {name} | {seconds:.2f} | "
                  f"{seconds / total:.0%} |")
    print("\nTop operators by self CPU time:\n")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    if args.trace:
        path = HERE / "results" / f"profile_{args.workload}_{args.model}_{args.mode}.json"
        path.parent.mkdir(exist_ok=True)
        recorder.profiler.export_chrome_trace(str(path))
        print(f"trace: {path}")


if __name__ == "__main__":
    main()
