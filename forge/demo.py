"""`forge demo`: LoRA GRPO makes the packaged SmolLM2-135M-Instruct better at arithmetic, offline, on a CPU.

The recipe: build a seeded training set and a fixed, disjoint held-out set of arithmetic problems in a
chat prompt that asks for <think>...</think><answer>...</answer>; measure the base model on the held-out
set (greedy); train on fresh prompts every step (a group whose completions all score the same carries no
GRPO signal and skips the backward pass; --screen_candidates instead keeps only prompts with mixed results),
evaluating the first --eval_subset held-out problems every --eval_every steps for the held-out curve; measure
again with the same decoding; write the before/after report. --ceiling measures the base model's pass@k at the
training temperature on the held-out set instead (what sharpening alone can reach).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch


@dataclass
class DemoSettings:
    model: str = "default"
    """Model to fine-tune: 'default' = the packaged SmolLM2-135M-Instruct (no network needed)."""
    steps: int = 60
    """Optimizer steps of GRPO (--tools: 20)."""
    prompts_per_step: int = 4
    """Prompts per optimizer step (4 x 8 completions: the most consistent of the settings we measured; --tools:
    2)."""
    group_size: int = 8
    """Completions per prompt."""
    learning_rate: float = 2e-4
    """Peak learning rate of the LoRA adapters."""
    lora_r: int = 16
    """LoRA rank."""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated modules that get LoRA adapters (attention and MLP projections)."""
    max_new_tokens: int = 64
    """Tokens per completion, in training and evaluation."""
    temperature: float = 0.7
    """Sampling temperature during training (evaluation is greedy)."""
    format_weight: float = 0.1
    """Weight of the tag-format reward next to the correctness reward (weight 1)."""
    screen_candidates: int = 0
    """Training prompts screened for mixed correctness before training (0 = train on fresh prompts; groups
    whose completions all score the same are left out of the backward pass instead)."""
    screen_group_size: int = 4
    """Samples per candidate prompt while screening."""
    heldout: int = 240
    """Held-out problems (fixed set, disjoint from training), evaluated greedily before and after training."""
    eval_every: int = 15
    """During training, evaluate the first eval_subset held-out problems (greedy) every N steps; drawn in
    training_curves.png next to the reward (0 = only before and after)."""
    eval_subset: int = 60
    """Held-out problems evaluated during training (the first ones of the held-out set)."""
    eval_batch_size: int = 60
    """Prompts per generation call when evaluating."""
    ceiling: bool = False
    """Instead of training: measure the base model's pass@group_size at the training temperature on the
    held-out set (the ceiling that sharpening alone can reach), write ceiling.json and stop."""
    seed: int = 0
    """Seed for the training set, sampling and LoRA init."""
    output_dir: str = "forge_demo"
    """Where the report, curves, logs and adapter go."""
    threads: int = 0
    """torch threads (0 = all cores)."""
    dtype: str = "auto"
    """Compute dtype (GRPOConfig.dtype) of training and of every evaluation: 'auto' = bf16 on a CPU with bf16
    matrix units (AMX / AVX512-BF16) or a bf16 GPU, fp32 elsewhere; 'float32' forces fp32. Weights stay fp32."""
    quick: bool = False
    """Smoke run (~2 minutes): 3 steps, 20 held-out problems, small screening; learning not expected."""
    tools: bool = False
    """Instead: the calculator-tool demo (forge/tool_demo.py): arithmetic with a <calc> tool, base model without
    and with the tool, trained model with the tool, on the same held-out set."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoSettings:
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        settings = cls(**values)
        for wanted, defaults in ((settings.tools, TOOLS), (settings.quick, QUICK)):  # --quick wins
            for name, value in defaults.items():
                if wanted and getattr(args, name) == getattr(cls, name):  # not set by the user
                    setattr(settings, name, value)
        return settings


QUICK = {"steps": 3, "heldout": 20, "prompts_per_step": 2, "max_new_tokens": 48, "eval_every": 2,
         "eval_subset": 10}
TOOLS = {"steps": 20, "prompts_per_step": 2}
"""The tool demo's recipe: 20 steps x 2 prompts x 8 completions (the measured one, about 12 minutes on one
thread of the 2-core machine; the plain demo's 60 x 4 would take about 40)."""


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    import ast
    import inspect

    body = ast.parse(inspect.getsource(DemoSettings)).body[0].body
    docs = {node.target.id: nxt.value.value for node, nxt in itertools.pairwise(body)
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)}
    for f in fields(DemoSettings):
        if f.type in ("bool", bool):
            parser.add_argument(f"--{f.name}", action="store_true", help=docs.get(f.name, ""))
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=docs.get(f.name, ""))


def run_demo(settings: DemoSettings) -> dict:
    from forge.core.trainer import GRPOTrainer, seed_everything
    from forge.data.arithmetic import arithmetic_dataset, arithmetic_heldout
    from forge.eval.evaluate import evaluate
    from forge.eval.plot import plot_training_curves
    from forge.eval.report import build_comparison, write_comparison
    from forge.eval.screen import screen_prompts
    from forge.model import choose_precision, load_model

    if settings.tools:
        from forge.tool_demo import run_tool_demo

        return run_tool_demo(settings)
    started = time.perf_counter()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = lambda text: print(f"[forge demo {time.perf_counter() - started:6.0f}s] {text}", flush=True)

    say(f"loading {settings.model} (the packaged model is converted from GGUF once, ~20 s)")
    model, tokenizer = load_model(settings.model)
    heldout = arithmetic_heldout(n=settings.heldout, chat=True)
    candidates = arithmetic_dataset(n=max(settings.screen_candidates, settings.steps * settings.prompts_per_step),
                                    seed=settings.seed, chat=True)

    timings = {"load": time.perf_counter() - started}
    # the base model is measured in the precision the trainer will train and evaluate in, so that before and
    # after differ by training only
    precision = choose_precision(settings.dtype, next(model.parameters()).device)
    if settings.ceiling:
        with precision.autocast():
            return _measure_ceiling(settings, model, tokenizer, heldout, out, say, started, precision)

    say(f"evaluating the base model on {len(heldout)} held-out problems (greedy, "
        f"{str(precision.compute).removeprefix('torch.')}: {precision.reason})")
    eval_kw = {"max_new_tokens": settings.max_new_tokens, "batch_size": settings.eval_batch_size}
    t0 = time.perf_counter()
    with precision.autocast():
        before = evaluate(model, tokenizer, heldout, **eval_kw)
    timings["base_eval"] = time.perf_counter() - t0
    say(_summary_line("base", before.metrics))
    load_before = _load_average()

    train_rows = candidates
    if settings.screen_candidates:
        seed_everything(settings.seed)
        say(f"screening {settings.screen_candidates} training prompts ({settings.screen_group_size} samples each) "
            f"for mixed correctness")
        screened = screen_prompts(model, tokenizer, candidates[: settings.screen_candidates],
                                  group_size=settings.screen_group_size, max_new_tokens=settings.max_new_tokens,
                                  temperature=settings.temperature, seed=settings.seed, heldout_rows=heldout)
        say(screened.summary())
        train_rows = list(screened.kept)
        if len(train_rows) < settings.prompts_per_step:  # too few mixed prompts: top up with unscreened ones
            kept_questions = {str(r["prompt"]) for r in train_rows}
            train_rows += [r for r in candidates if str(r["prompt"]) not in kept_questions][
                : settings.prompts_per_step - len(train_rows)]
        (out / "screening.json").write_text(json.dumps(screened.report(), indent=2))

    subset = heldout[: settings.eval_subset] if settings.eval_every else None
    config = demo_config(settings, out, eval_steps=settings.eval_every, eval_before_training=subset is not None)
    say(f"training: {settings.steps} steps x {settings.prompts_per_step} prompts x {settings.group_size} "
        f"completions, LoRA r={settings.lora_r}, lr {settings.learning_rate}"
        + (f"; held-out curve: the first {len(subset)} problems every {settings.eval_every} steps" if subset else ""))
    curve = HeldoutCurve(heldout, len(subset or ()), settings.steps, eval_kw, before)
    trainer = GRPOTrainer(model, tokenizer, demo_rewards(), config, evaluator=curve)
    curve.trainer = trainer
    train_started = time.perf_counter()
    trainer.train(train_rows, eval_dataset=subset)
    timings["training"] = time.perf_counter() - train_started - curve.seconds
    timings["curve_evals"] = curve.seconds - curve.final_seconds

    say(f"evaluating the trained policy on the same {len(heldout)} held-out problems (greedy)")
    t0 = time.perf_counter()
    if curve.final is None:  # no curve (eval_every 0): evaluated here, in the trainer's precision
        with trainer.precision.autocast(trainer.model):
            curve.final = evaluate(trainer.model, tokenizer, heldout, **eval_kw)
    after = curve.final
    timings["final_eval"] = curve.final_seconds + time.perf_counter() - t0
    say(_summary_line("trained", after.metrics))
    t0 = time.perf_counter()
    report = build_comparison(before, after, labels=("base", "trained"))
    json_path, md_path = write_comparison(report, out)
    curves = plot_training_curves(out)
    timings["report_and_plot"] = time.perf_counter() - t0
    total = time.perf_counter() - started
    timings["total"] = total
    train_seconds = timings["training"]

    rows = [("strict accuracy", "strict_accuracy"), ("soft accuracy", "soft_accuracy"),
            ("format rate", "format_rate"), ("mean length", "mean_completion_length")]
    print("\n            metric |   base | trained")
    for label, key in rows:
        b, a = before.metrics[key], after.metrics[key]
        fmt = "{:6.1%}" if key != "mean_completion_length" else "{:6.1f}"
        print(f"{label:>18} | {fmt.format(b)} | {fmt.format(a)}")
    result = {"settings": asdict(settings), "heldout_size": len(heldout), "before": before.metrics,
              "after": after.metrics, "gain": after.metrics["strict_accuracy"] - before.metrics["strict_accuracy"],
              "eval_curve": curve.points, "eval_curve_size": len(subset or ()),
              "train_seconds": train_seconds, "total_seconds": total,
              "seconds_per_step": train_seconds / max(1, settings.steps), "timings": timings,
              "load_average": {"start": load_before, "end": _load_average()},
              "machine": _machine() | {"precision": str(precision.compute).removeprefix("torch."),
                                       "precision_reason": precision.reason}}
    (out / "demo_result.json").write_text(json.dumps(result, indent=2))
    print(f"\ntraining {train_seconds:.0f}s ({result['seconds_per_step']:.1f} s/step), total {total:.0f}s ("
          + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items() if k != "total") + ")")
    print(f"report:   {md_path}\n          {json_path}\ncurves:   {curves}\nlogs:     {out / 'training_log.jsonl'}, "
          f"{out / 'samples.jsonl'}\nadapter:  {out / 'final'}\nresult:   {out / 'demo_result.json'}")
    return result


class HeldoutCurve:
    """The demo's evaluator for GRPOTrainer(evaluator=...): greedy metrics of the held-out subset during training.

    Step 0 is not generated again: it is the first `subset` problems of the base model's full evaluation
    (the same greedy decode). At the last step the whole held-out set is evaluated once (the subset comes
    first, so its metrics are those problems' share of that evaluation) and kept as the demo's "after"
    result; the trainer's closing evaluation at the same step is answered from the cache."""

    def __init__(self, heldout, subset: int, total_steps: int, eval_kw: dict, before):
        from forge.eval.evaluate import aggregate_metrics

        self.heldout, self.subset, self.total_steps, self.eval_kw = heldout, subset, total_steps, eval_kw
        self.trainer = None
        self.cache = {0: self._subset_metrics(before, aggregate_metrics)}
        self.points: list[dict] = []
        self.seconds = self.final_seconds = 0.0
        self.final = None

    def _subset_metrics(self, result, aggregate_metrics) -> dict:
        metrics = aggregate_metrics(result.records[: self.subset], 1)
        return {**metrics, "seconds": 0.0}

    def __call__(self, model, tokenizer, rows, *, max_new_tokens, max_prompt_length) -> dict:
        from forge.eval.evaluate import aggregate_metrics, evaluate

        step = self.trainer.global_step
        if step not in self.cache:
            t0 = time.perf_counter()
            if step >= self.total_steps:  # the whole held-out set once; the subset's share of it
                self.final = evaluate(model, tokenizer, self.heldout, **self.eval_kw)
                metrics = self._subset_metrics(self.final, aggregate_metrics)
                self.final_seconds = time.perf_counter() - t0
            else:
                metrics = evaluate(model, tokenizer, rows, **self.eval_kw).metrics
            self.seconds += time.perf_counter() - t0
            self.cache[step] = metrics
        if not any(point["step"] == step for point in self.points):
            m = self.cache[step]
            self.points.append({"step": step, "strict_accuracy": m["strict_accuracy"], "soft_accuracy":
                                m["soft_accuracy"], "format_rate": m["format_rate"], "n": m["n"]})
        return {k: v for k, v in self.cache[step].items() if k in HELDOUT_KEYS}


HELDOUT_KEYS = ("strict_accuracy", "soft_accuracy", "format_rate", "mean_completion_length", "n")


def _measure_ceiling(settings: DemoSettings, model, tokenizer, heldout, out: Path, say, started: float,
                     precision) -> dict:
    """pass@group_size of the base model at the training temperature: what sharpening alone can reach."""
    from forge.eval.evaluate import evaluate

    k = settings.group_size
    say(f"measuring the ceiling: {k} samples per problem at temperature {settings.temperature} on "
        f"{len(heldout)} held-out problems")
    load_before = _load_average()
    result = evaluate(model, tokenizer, heldout, max_new_tokens=settings.max_new_tokens, num_samples=k,
                      temperature=settings.temperature, k_values=(1, k), seed=settings.seed,
                      batch_size=max(1, settings.eval_batch_size // k))
    say(result.summary())
    ceiling = {"settings": asdict(settings), "heldout_size": len(heldout), "metrics": result.metrics,
               "decoding": result.settings, "total_seconds": time.perf_counter() - started,
               "load_average": {"start": load_before, "end": _load_average()},
               "machine": _machine() | {"precision": str(precision.compute).removeprefix("torch.")}}
    (out / "ceiling.json").write_text(json.dumps(ceiling, indent=2))
    print(f"pass@{k} {result.metrics[f'pass@{k}']:.1%}, pass@1 {result.metrics['pass@1']:.1%}\n"
          f"result:   {out / 'ceiling.json'}")
    return ceiling


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _machine() -> dict:
    import platform

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def demo_config(settings: DemoSettings, output_dir, **overrides):
    """The demo's GRPOConfig (bench/learning_vs_trl.py builds TRL's config from the same settings)."""
    from forge.core.config import GRPOConfig

    config = GRPOConfig(
        group_size=settings.group_size, prompts_per_step=settings.prompts_per_step, gradient_accumulation_steps=1,
        max_steps=settings.steps, learning_rate=settings.learning_rate, lr_scheduler="constant", warmup_ratio=0.0,
        kl_beta=0.0, temperature=settings.temperature, max_new_tokens=settings.max_new_tokens, use_lora=True,
        lora_r=settings.lora_r, lora_alpha=2 * settings.lora_r, logging_steps=1, save_steps=0,
        reward_weights=[1.0, settings.format_weight], output_dir=str(output_dir), seed=settings.seed,
        loss_type="dr_grpo", scale_rewards="group", lora_target_modules=settings.lora_targets.split(","),
        drop_zero_std_groups=True, micro_batch_size=settings.group_size, dtype=settings.dtype,
        overwrite_output_dir=True,  # each demo run replaces the previous one in its output dir
    )
    return replace(config, **overrides) if overrides else config


def demo_rewards() -> list:
    """The demo's rewards, weighted [1, format_weight]: correctness of the final answer, and the tag format."""
    from forge.core.reward import MathCorrectnessReward, TagFormatReward

    return [MathCorrectnessReward(), TagFormatReward()]


def _summary_line(label: str, metrics: dict) -> str:
    return (f"{label}: strict {metrics['strict_accuracy']:.1%}, soft {metrics['soft_accuracy']:.1%}, "
            f"format {metrics['format_rate']:.1%}")
