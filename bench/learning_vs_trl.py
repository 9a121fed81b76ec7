"""Forge against TRL's GRPOTrainer on `forge demo`'s recipe: held-out accuracy against steps and against time.

    python bench/learning_vs_trl.py run --framework forge|trl [--seed 0] [--steps 40] [--eval-every 10] \
        [--heldout 240] [--threads 1]
    python bench/learning_vs_trl.py report          # merge the runs into the JSON summary and the figure

The recipe is the demo's (forge/demo.py: DemoSettings, demo_config, demo_rewards): the packaged
SmolLM2-135M-Instruct in fp32, the arithmetic chat prompts of forge/data/arithmetic.py, reward = correctness +
0.1 x tag format, LoRA r=16 alpha=32 dropout 0 on q/k/v/o/gate/up/down, AdamW lr 2e-4 constant, no warm-up,
4 prompts x 8 completions per optimizer step, temperature 0.7 (top-p 1, top-k off), 64 new tokens, loss
dr_grpo (sum over tokens / (completions x max new tokens)), rewards scaled by the group's std, clip 0.2, one
update per rollout, kl beta 0 (the demo's: no reference model), max grad norm 1, the same torch thread count.
Both get the same training rows in the same order: Forge with shuffle=False, TRL with shuffle_dataset=False
(its RepeatSampler then yields the rows in order, each repeated group-size times; the questions every step
saw are recorded and `report` checks they match). Forge leaves zero-std groups out of the backward pass
(the demo's drop_zero_std_groups); with kl beta 0 their advantages are 0 in TRL too, so the update is the
same. The trainers' random streams differ, so the sampled completions do.

At step 0 and every --eval-every steps each run evaluates the same fixed held-out set (the first --heldout
problems of forge.data.arithmetic.arithmetic_heldout) with the same code, forge.eval.evaluate, greedy, on
the model being trained (TRL's PEFT model too), and records (step, training wall seconds so far, training
CPU seconds of this process so far, strict accuracy); evaluation time is left out of both clocks. CPU
seconds (time.process_time) are measured too because the machine is shared: another process's load
stretches wall time but hardly CPU time. Each run rewrites its raw file after every evaluation, so a run that
is stopped keeps what it measured: bench/results/learning_vs_trl/<framework>_seed<seed>.json.

`report` writes bench/results/learning_vs_trl.json (time_to_target_ratio = Forge's seconds / TRL's seconds
to first reach target_accuracy, the strict accuracy TRL reaches at its last evaluation; with several seeds,
both come from the curves averaged over seeds at the steps every seed evaluated; on wall and on CPU time) and
bench/results/learning_vs_trl.png (accuracy vs steps, accuracy vs training time).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RAW_DIR = HERE / "results" / "learning_vs_trl"
OUT_JSON = HERE / "results" / "learning_vs_trl.json"
OUT_PNG = HERE / "results" / "learning_vs_trl.png"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train one framework and record its held-out curve")
    run.add_argument("--framework", choices=["forge", "trl"], required=True)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--steps", type=int, default=40)
    run.add_argument("--eval-every", type=int, default=10)
    run.add_argument("--heldout", type=int, default=240)
    run.add_argument("--threads", type=int, default=1)
    run.add_argument("--eval-batch-size", type=int, default=60, help="prompts per evaluation generate call")
    run.add_argument("--skip-base-eval", action="store_true",
                     help="no step-0 evaluation: the base model's greedy result is the same for both frameworks "
                          "(same weights, same evaluation code and batches); `report` takes it from the other run")
    run.add_argument("--precision", choices=["float32", "best"], default="float32",
                     help="float32: both at fp32 (the default). best: each framework at its best dtype on this "
                          "machine, Forge dtype='auto' and TRL bf16=True where the CPU has bf16 matrix units (fp32 "
                          "both where it has none), and both evaluated under the same bf16 autocast; raw files go to "
                          "bench/results/learning_vs_trl_best/")
    run.add_argument("--raw-dir", default=None, help="default: bench/results/learning_vs_trl[_best]/")
    rep = sub.add_parser("report", help="merge the raw runs into the summary JSON and the figure")
    rep.add_argument("--precision", choices=["float32", "best"], default="float32",
                     help="which runs to merge: float32 (learning_vs_trl/) or best (learning_vs_trl_best/, written "
                          "to learning_vs_trl_best.json / .png)")
    rep.add_argument("--raw-dir", default=None)
    rep.add_argument("--out-json", default=None)
    rep.add_argument("--out-png", default=None)
    args = p.parse_args(argv)
    suffix = "_best" if args.precision == "best" else ""
    args.raw_dir = args.raw_dir or str(RAW_DIR.with_name(RAW_DIR.name + suffix))
    if args.command == "report":
        args.out_json = args.out_json or str(OUT_JSON.with_name(f"learning_vs_trl{suffix}.json"))
        args.out_png = args.out_png or str(OUT_PNG.with_name(f"learning_vs_trl{suffix}.png"))
    return args


def compute_dtype(precision: str):
    """(torch dtype each framework computes in, why): bf16 for "best" on a CPU with bf16 matrix units."""
    import torch

    from forge.model import choose_precision

    if precision == "float32":
        return torch.float32, "float32 asked for"
    chosen = choose_precision("auto", "cpu")
    return chosen.compute, chosen.reason


# ----------------------------------------------------------------------------------------------------
# one run


class Curve:
    """Training clocks that leave evaluation out, the held-out curve, per-step rewards and prompts seen."""

    def __init__(self, args, model, tokenizer, heldout, path: Path, meta: dict):
        self.args, self.model, self.tokenizer, self.heldout, self.path = args, model, tokenizer, heldout, path
        self.data = {**meta, "evals": [], "step_rewards": [], "step_questions": [], "finished": False}
        self.eval_wall = self.eval_cpu = 0.0
        self.wall0 = self.cpu0 = None

    def start(self):
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        self.eval_wall = self.eval_cpu = 0.0  # the step-0 evaluation ran before the clocks started

    def clocks(self) -> tuple[float, float]:
        if self.wall0 is None:  # before training starts
            return 0.0, 0.0
        return (time.perf_counter() - self.wall0 - self.eval_wall, time.process_time() - self.cpu0 - self.eval_cpu)

    def evaluate(self, step: int, model=None):
        from forge.eval.evaluate import evaluate

        wall, cpu = self.clocks()
        w0, c0 = time.perf_counter(), time.process_time()
        with eval_precision(self.args.compute_dtype):  # the same numerics for both frameworks' models
            result = evaluate(model or self.model, self.tokenizer, self.heldout,
                              max_new_tokens=self.args.max_new_tokens, batch_size=self.args.eval_batch_size)
        eval_wall, eval_cpu = time.perf_counter() - w0, time.process_time() - c0
        self.eval_wall += eval_wall
        self.eval_cpu += eval_cpu
        m = result.metrics
        point = {"step": step, "train_wall_seconds": wall, "train_cpu_seconds": cpu,
                 "strict_accuracy": m["strict_accuracy"], "soft_accuracy": m["soft_accuracy"],
                 "format_rate": m["format_rate"], "mean_completion_length": m["mean_completion_length"],
                 "num_strict_correct": sum(r["num_strict_correct"] for r in result.records), "n": m["n"],
                 "eval_seconds": m["seconds"], "eval_wall_seconds": eval_wall, "eval_cpu_seconds": eval_cpu,
                 "load_average": os.getloadavg(), "time": time.strftime("%H:%M:%S")}
        self.data["evals"].append(point)
        print(f"[{self.data['framework']}] step {step}: strict {m['strict_accuracy']:.1%} "
              f"({point['num_strict_correct']}/{m['n']}), train {wall:.0f}s wall / {cpu:.0f}s cpu, "
              f"eval {m['seconds']:.0f}s, load {point['load_average'][0]:.2f}", flush=True)
        self.save()

    def step_done(self, step: int, reward: float | None):
        wall, cpu = self.clocks()
        self.data["step_rewards"].append({"step": step, "reward": reward, "train_wall_seconds": wall,
                                          "train_cpu_seconds": cpu})
        if step % self.args.eval_every == 0 or step == self.args.steps:
            self.evaluate(step)
        else:
            self.save()

    def save(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def eval_precision(dtype):
    """bf16 evaluation: under CPU autocast, so Forge's bf16-stored LoRA base and TRL's fp32 base multiply alike."""
    import contextlib

    import torch

    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast("cpu", dtype=dtype)


def question_of(prompt) -> str:
    from forge.eval.evaluate import question_text

    return question_text({"prompt": prompt})


def run(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from workloads import cpu_model, load_model, machine_info

    from forge.data.arithmetic import arithmetic_dataset, arithmetic_heldout
    from forge.demo import DemoSettings

    settings = DemoSettings(steps=args.steps, seed=args.seed, heldout=args.heldout, threads=args.threads)
    args.compute_dtype, dtype_reason = compute_dtype(args.precision)
    args.max_new_tokens = settings.max_new_tokens
    torch.manual_seed(args.seed)
    model, tokenizer = load_model("smollm2", "short")
    rows = [{"prompt": r["prompt"], "reference": r["reference"]}
            for r in arithmetic_dataset(n=settings.steps * settings.prompts_per_step, seed=settings.seed, chat=True)]
    heldout = arithmetic_heldout(n=args.heldout, chat=True)
    meta = {"framework": args.framework, "seed": args.seed, "steps": args.steps, "eval_every": args.eval_every,
            "heldout": len(heldout), "threads": args.threads, "settings": vars(settings) | {"shuffle": False},
            "machine": machine_info(args.threads), "cpu_name": cpu_model(), "command": " ".join(sys.argv),
            "precision": args.precision, "compute_dtype": str(args.compute_dtype).removeprefix("torch."),
            "compute_dtype_reason": dtype_reason}
    curve = Curve(args, model, tokenizer, heldout, Path(args.raw_dir) / f"{args.framework}_seed{args.seed}.json", meta)
    if not args.skip_base_eval:
        curve.evaluate(0)  # the base model, before either clock runs
    (run_forge if args.framework == "forge" else run_trl)(settings, model, tokenizer, rows, curve, args.compute_dtype)
    curve.data["finished"] = True
    curve.data["trained_steps"] = len(curve.data["step_rewards"])
    curve.save()


def run_forge(settings, model, tokenizer, rows, curve: Curve, dtype) -> None:
    import tempfile

    from forge.core.trainer import GRPOTrainer
    from forge.demo import demo_config, demo_rewards

    with tempfile.TemporaryDirectory(prefix="lvt_forge_") as out:
        import torch

        config = demo_config(settings, out, shuffle=False, log_completions=0,
                             dtype="float32" if dtype == torch.float32 else "auto")
        trainer = GRPOTrainer(model, tokenizer, demo_rewards(), config)
        curve.model = trainer.model
        step = trainer.step
        count = 0

        def recorded_step(step_rows):
            nonlocal count
            curve.data["step_questions"].append([question_of(r["prompt"]) for r in step_rows])
            metrics = step(step_rows)
            count += 1
            curve.step_done(count, float(metrics["reward"]))
            return metrics

        trainer.step = recorded_step
        curve.start()
        trainer.train(rows)


def run_trl(settings, model, tokenizer, rows, curve: Curve, dtype) -> None:
    import tempfile

    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from workloads import completion_text

    from forge.demo import demo_rewards

    correctness, tag_format = demo_rewards()
    seen: list[list[str]] = []

    def correctness_reward(prompts, completions, reference, **kwargs) -> list[float]:
        questions = list(dict.fromkeys(question_of(p) for p in prompts))  # this generation's prompts, in order
        seen.append(questions)
        texts = [completion_text(c) for c in completions]
        return correctness(list(map(str, prompts)), texts, references=reference)  # the task reward: a list

    def format_reward(prompts, completions, **kwargs) -> list[float]:
        return tag_format(list(map(str, prompts)), [completion_text(c) for c in completions]).scores

    group = settings.group_size
    per_step = settings.prompts_per_step * group
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="lvt_trl_"),
        per_device_train_batch_size=group,  # completions per forward/backward, as the demo's micro_batch_size
        gradient_accumulation_steps=per_step // group, generation_batch_size=per_step,  # one rollout per step
        num_generations=group, max_completion_length=settings.max_new_tokens,
        temperature=settings.temperature, top_p=1.0, top_k=0, beta=0.0, loss_type="dr_grpo", scale_rewards="group",
        epsilon=0.2, num_iterations=1, mask_truncated_completions=False,
        reward_weights=[1.0, settings.format_weight],
        learning_rate=settings.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch", max_steps=settings.steps, seed=settings.seed, shuffle_dataset=False,
        # TRL's default bf16=True (accelerate's bf16 autocast over fp32 weights) only where it is fast; its default
        # gradient_checkpointing=True is set off, as the demo's.
        bf16=str(dtype) == "torch.bfloat16", fp16=False, gradient_checkpointing=False, use_cpu=True, use_vllm=False,
        report_to="none", logging_strategy="steps", logging_steps=1, save_strategy="no", eval_strategy="no",
        log_completions=False, disable_tqdm=True, dataloader_num_workers=0,
    )
    peft_config = LoraConfig(task_type="CAUSAL_LM", r=settings.lora_r, lora_alpha=2 * settings.lora_r,
                             lora_dropout=0.0, target_modules=settings.lora_targets.split(","))
    rewards: dict[int, float] = {}

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            curve.start()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards[state.global_step] = float(logs["reward"])
                for entry in curve.data["step_rewards"]:  # on_log comes after on_step_end
                    if entry["step"] == state.global_step:
                        entry["reward"] = rewards[state.global_step]

        def on_step_end(self, args, state, control, model=None, **kwargs):
            curve.data["step_questions"] = seen
            curve.model = model
            curve.step_done(state.global_step, None)

    trainer = trl.GRPOTrainer(model=model, reward_funcs=[correctness_reward, format_reward], args=args,
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                              peft_config=peft_config, callbacks=[Recorder()])
    curve.data["trl"] = trl.__version__
    trainer.train()
    for entry in curve.data["step_rewards"]:  # logged after on_step_end; fill them in at the end
        entry["reward"] = rewards.get(entry["step"])



# ----------------------------------------------------------------------------------------------------
# report


def time_to(evals: list[dict], target: float, clock: str) -> float | None:
    """Training seconds (on `clock`) at the first evaluation whose strict accuracy reaches `target`."""
    for point in evals:
        if point["strict_accuracy"] >= target - 1e-12:
            return point[clock]
    return None


def mean_curve(runs: list[dict]) -> list[dict]:
    """Strict accuracy and training clocks averaged over runs (seeds), at the steps every run evaluated."""
    steps = sorted(set.intersection(*({p["step"] for p in r["evals"]} for r in runs)))
    curve = []
    for step in steps:
        points = [next(p for p in r["evals"] if p["step"] == step) for r in runs]
        curve.append({"step": step, **{k: sum(p[k] for p in points) / len(points)
                                       for k in ("strict_accuracy", "train_wall_seconds", "train_cpu_seconds")}})
    return curve


def step_clock_stats(run: dict) -> dict:
    """Per-step wall and CPU seconds (from the cumulative clocks) and how much each varies from step to step."""
    import statistics

    points = [{"train_wall_seconds": 0.0, "train_cpu_seconds": 0.0}] + run["step_rewards"]
    wall = [b["train_wall_seconds"] - a["train_wall_seconds"] for a, b in itertools.pairwise(points)]
    cpu = [b["train_cpu_seconds"] - a["train_cpu_seconds"] for a, b in itertools.pairwise(points)]
    if len(wall) < 2:
        return {"wall": wall, "cpu": cpu}
    cv = lambda xs: statistics.stdev(xs) / statistics.mean(xs)
    return {"wall": wall, "cpu": cpu, "wall_per_cpu": [w / c for w, c in zip(wall, cpu)],
            "wall_cv": cv(wall), "cpu_cv": cv(cpu)}


def report(args) -> dict:
    raw_dir = Path(args.raw_dir)
    runs = [json.loads(p.read_text()) for p in sorted(raw_dir.glob("*_seed*.json"))]
    if not any(r["framework"] == "trl" for r in runs) or not any(r["framework"] == "forge" for r in runs):
        raise SystemExit(f"need at least one forge and one trl run in {raw_dir}")
    for r in runs:  # see "clock_correction" in the raw file: a fixed offset, added to every training clock
        c = r.get("clock_correction")
        if c and not c.get("applied"):
            for point in [p for p in r["evals"] if p["step"] > 0] + r["step_rewards"]:
                point["train_wall_seconds"] += c["wall_seconds"]
                point["train_cpu_seconds"] += c["cpu_seconds"]
            c["applied"] = True
    base = next((p for r in runs for p in r["evals"] if p["step"] == 0), None)
    for r in runs:  # a run started with --skip-base-eval: the base model's (deterministic) greedy result
        if base is not None and not any(p["step"] == 0 for p in r["evals"]):
            r["evals"].insert(0, {**base, "train_wall_seconds": 0.0, "train_cpu_seconds": 0.0,
                                  "copied_from_other_run": True})
    trl_runs = sorted((r for r in runs if r["framework"] == "trl"), key=lambda r: r["seed"])
    forge_runs = sorted((r for r in runs if r["framework"] == "forge"), key=lambda r: r["seed"])
    trl_mean, forge_mean = mean_curve(trl_runs), mean_curve(forge_runs)
    target = trl_mean[-1]["strict_accuracy"]  # what TRL reaches at its last evaluation (mean over its seeds)
    n = trl_runs[0]["heldout"]
    summary = {"target_accuracy": target,
               "target_from": f"TRL at step {trl_mean[-1]['step']}, mean of seeds {[r['seed'] for r in trl_runs]}",
               "heldout": n, "cpu_name": trl_runs[0]["cpu_name"],
               "compute_dtype": {f"{r['framework']}_seed{r['seed']}": r.get("compute_dtype", "float32") for r in runs},
               "seeds": {"forge": [r["seed"] for r in forge_runs], "trl": [r["seed"] for r in trl_runs]},
               "mean_curves": {"trl": trl_mean, "forge": forge_mean}}
    trl_wall = time_to(trl_mean, target, "train_wall_seconds")
    trl_cpu = time_to(trl_mean, target, "train_cpu_seconds")
    forge_wall = time_to(forge_mean, target, "train_wall_seconds")
    forge_cpu = time_to(forge_mean, target, "train_cpu_seconds")
    ratio = lambda a, b: None if a is None or not b else a / b
    summary["time_to_target_ratio"] = ratio(forge_wall, trl_wall)
    summary["time_to_target_ratio_cpu"] = ratio(forge_cpu, trl_cpu)
    matched = sorted({r["seed"] for r in forge_runs} & {r["seed"] for r in trl_runs})
    if matched and (len(matched) < len(forge_runs) or len(matched) < len(trl_runs)):
        # the same comparison on only the seeds both frameworks ran (the same training rows on both sides)
        fm = mean_curve([r for r in forge_runs if r["seed"] in matched])
        tm = mean_curve([r for r in trl_runs if r["seed"] in matched])
        t = tm[-1]["strict_accuracy"]
        summary["matched_seeds"] = {
            "seeds": matched, "target_accuracy": t,
            "time_to_target_ratio": ratio(time_to(fm, t, "train_wall_seconds"), time_to(tm, t, "train_wall_seconds")),
            "time_to_target_ratio_cpu": ratio(time_to(fm, t, "train_cpu_seconds"),
                                              time_to(tm, t, "train_cpu_seconds"))}
    per_run = []
    for r in forge_runs:  # each Forge seed alone, against the same target and TRL's mean-curve time
        wall, cpu = time_to(r["evals"], target, "train_wall_seconds"), time_to(r["evals"], target, "train_cpu_seconds")
        per_run.append({"seed": r["seed"], "forge_wall_seconds": wall, "forge_cpu_seconds": cpu,
                        "wall_ratio": ratio(wall, trl_wall), "cpu_ratio": ratio(cpu, trl_cpu),
                        "reached": wall is not None, "last_step": r["evals"][-1]["step"],
                        "best_accuracy": max(p["strict_accuracy"] for p in r["evals"])})
    summary["time_to_target"] = {"trl_wall_seconds": trl_wall, "trl_cpu_seconds": trl_cpu,
                                 "forge_wall_seconds": forge_wall, "forge_cpu_seconds": forge_cpu,
                                 "forge_seeds": per_run,
                                 "note": "training seconds at the first evaluation of the mean curve (over seeds, "
                                         "at the steps every seed evaluated) at or above the target; evaluations "
                                         f"every {trl_runs[0]['eval_every']} steps in both"}
    # per-step accuracy: the gap at each shared evaluation step against the binomial standard error
    table = []
    steps = sorted({p["step"] for r in runs for p in r["evals"]})
    for step in steps:
        row = {"step": step}
        for r in runs:
            point = next((p for p in r["evals"] if p["step"] == step), None)
            if point:
                row[f"{r['framework']}_seed{r['seed']}"] = {
                    k: point[k] for k in ("strict_accuracy", "num_strict_correct", "train_wall_seconds",
                                          "train_cpu_seconds")}
        table.append(row)
    summary["table"] = table
    gaps = []
    for row in table:
        f = [v["strict_accuracy"] for k, v in row.items() if k.startswith("forge")]
        t = [v["strict_accuracy"] for k, v in row.items() if k.startswith("trl")]
        if f and t:
            pf, pt = sum(f) / len(f), sum(t) / len(t)
            se = math.sqrt(pf * (1 - pf) / (n * len(f)) + pt * (1 - pt) / (n * len(t)))
            gaps.append({"step": row["step"], "forge": pf, "trl": pt, "gap": pf - pt, "se_of_gap": se,
                         "within_2se": abs(pf - pt) <= 2 * se + 1e-12,
                         # how far apart one framework's own seeds are at this step (0 with one seed)
                         "forge_seed_range": max(f) - min(f), "trl_seed_range": max(t) - min(t)})
    summary["accuracy_gap"] = gaps
    summary["accuracy_per_step_equal_within_noise"] = all(g["within_2se"] for g in gaps[1:]) if len(gaps) > 1 else None
    summary["prompt_order_matches"] = all(
        r["step_questions"][: len(t["step_questions"])] == t["step_questions"][: len(r["step_questions"])]
        for r in forge_runs for t in trl_runs if t["seed"] == r["seed"])
    summary["per_step_clocks"] = {f"{r['framework']}_seed{r['seed']}": step_clock_stats(r) for r in runs}
    summary["runs"] = runs
    summary["commands"] = sorted({"python " + r["command"] for r in runs}) + ["python bench/learning_vs_trl.py report"]
    Path(args.out_json).write_text(json.dumps(summary, indent=1))
    plot(runs, target, n, Path(args.out_png), summary["mean_curves"])
    print(json.dumps({k: v for k, v in summary.items() if k not in ("runs", "table")}, indent=1))
    return summary


def plot(runs: list[dict], target: float, n: int, path: Path, means: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = {"forge": "tab:blue", "trl": "tab:orange"}
    for r in runs:
        steps = [p["step"] for p in r["evals"]]
        acc = [100 * p["strict_accuracy"] for p in r["evals"]]
        se = [100 * math.sqrt(max(p["strict_accuracy"] * (1 - p["strict_accuracy"]), 1e-9) / n) for p in r["evals"]]
        style = {"color": colors[r["framework"]], "marker": "o", "alpha": 1.0 if r["seed"] == 0 else 0.6,
                 "linestyle": "-" if r["seed"] == 0 else "--"}
        label = f"{'Forge' if r['framework'] == 'forge' else 'TRL'} seed {r['seed']}"
        axes[0].errorbar(steps, acc, yerr=se, capsize=3, label=label, **style)
        axes[1].plot([p["train_wall_seconds"] / 60 for p in r["evals"]], acc, label=label, **style)
        axes[2].plot([p["train_cpu_seconds"] / 60 for p in r["evals"]], acc, label=label, **style)
    for framework, curve in (means or {}).items():  # the mean over seeds, when there are several
        if sum(r["framework"] == framework for r in runs) < 2:
            continue
        label = f"{'Forge' if framework == 'forge' else 'TRL'} mean of seeds"
        acc = [100 * p["strict_accuracy"] for p in curve]
        style = {"color": colors[framework], "linewidth": 3, "alpha": 0.5}
        axes[0].plot([p["step"] for p in curve], acc, label=label, **style)
        axes[1].plot([p["train_wall_seconds"] / 60 for p in curve], acc, label=label, **style)
        axes[2].plot([p["train_cpu_seconds"] / 60 for p in curve], acc, label=label, **style)
    for ax, xlabel in zip(axes, ("optimizer step", "training wall time (min, eval excluded)",
                                 "training CPU time of the process (min, eval excluded)")):
        ax.axhline(100 * target, color="gray", linewidth=0.8, linestyle=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"held-out strict accuracy, % (n={n}, greedy)")
        ax.grid(alpha=0.3)
    axes[0].set_title("accuracy vs steps (bars: +-1 binomial SE)")
    axes[1].set_title("accuracy vs wall time")
    axes[2].set_title("accuracy vs CPU time")
    axes[0].legend(fontsize=8)
    dtypes = ", ".join(sorted({f"{'Forge' if r['framework'] == 'forge' else 'TRL'} {r.get('compute_dtype', 'float32')}"
                               for r in runs}))
    fig.suptitle(f"forge demo recipe: Forge vs TRL GRPOTrainer (SmolLM2-135M-Instruct, LoRA, {dtypes}, "
                 f"1 thread each, {runs[0]['cpu_name']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "run":
        run(args)
    else:
        report(args)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
