"""`forge demo`: LoRA GRPO makes the packaged SmolLM2-135M-Instruct better at arithmetic, offline, on a CPU.

The recipe: build a seeded training set and a fixed, disjoint held-out set of arithmetic problems in a
chat prompt that asks for <think>...</think><answer>...</answer>; measure the base model on the held-out
set (greedy); train on fresh prompts every step (a group whose completions all score the same carries no
GRPO signal and skips the backward pass; --screen_candidates instead keeps only prompts with mixed results);
measure again with the same decoding; write the before/after report.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch


@dataclass
class DemoSettings:
    model: str = "default"
    """Model to fine-tune: 'default' = the packaged SmolLM2-135M-Instruct (no network needed)."""
    steps: int = 60
    """Optimizer steps of GRPO."""
    prompts_per_step: int = 4
    """Prompts per optimizer step (4 x 8 completions: the most consistent of the settings we measured)."""
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
    heldout: int = 60
    """Held-out problems (fixed set, disjoint from training)."""
    seed: int = 0
    """Seed for the training set, sampling and LoRA init."""
    output_dir: str = "forge_demo"
    """Where the report, curves, logs and adapter go."""
    threads: int = 0
    """torch threads (0 = all cores)."""
    quick: bool = False
    """Smoke run (~2 minutes): 3 steps, 20 held-out problems, small screening; learning not expected."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoSettings:
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        settings = cls(**values)
        if settings.quick:
            for name, quick_value in QUICK.items():
                if getattr(args, name) == getattr(cls, name):  # not set by the user
                    setattr(settings, name, quick_value)
        return settings


QUICK = {"steps": 3, "heldout": 20, "prompts_per_step": 2, "max_new_tokens": 48}


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
    from forge.core.policy import load_model
    from forge.core.trainer import GRPOTrainer, seed_everything
    from forge.data.arithmetic import arithmetic_dataset, arithmetic_heldout
    from forge.eval.evaluate import evaluate, heldout_metrics
    from forge.eval.plot import plot_training_curves
    from forge.eval.report import build_comparison, write_comparison
    from forge.eval.screen import screen_prompts

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

    say(f"evaluating the base model on {len(heldout)} held-out problems (greedy)")
    eval_kw = {"max_new_tokens": settings.max_new_tokens, "batch_size": 30}
    before = evaluate(model, tokenizer, heldout, **eval_kw)
    say(_summary_line("base", before.metrics))

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

    config = demo_config(settings, out)
    say(f"training: {settings.steps} steps x {settings.prompts_per_step} prompts x {settings.group_size} "
        f"completions, LoRA r={settings.lora_r}, lr {settings.learning_rate}")
    # evaluator: what train(eval_dataset=...) logs as eval/<metric> (strict/soft accuracy, format rate)
    trainer = GRPOTrainer(model, tokenizer, demo_rewards(), config,
                          evaluator=functools.partial(heldout_metrics, batch_size=eval_kw["batch_size"]))
    train_started = time.perf_counter()
    trainer.train(train_rows)
    train_seconds = time.perf_counter() - train_started

    say("evaluating the trained policy on the same held-out problems (greedy)")
    after = evaluate(trainer.model, tokenizer, heldout, **eval_kw)
    report = build_comparison(before, after, labels=("base", "trained"))
    json_path, md_path = write_comparison(report, out)
    curves = plot_training_curves(out)
    total = time.perf_counter() - started

    rows = [("strict accuracy", "strict_accuracy"), ("soft accuracy", "soft_accuracy"),
            ("format rate", "format_rate"), ("mean length", "mean_completion_length")]
    print("\n            metric |   base | trained")
    for label, key in rows:
        b, a = before.metrics[key], after.metrics[key]
        fmt = "{:6.1%}" if key != "mean_completion_length" else "{:6.1f}"
        print(f"{label:>18} | {fmt.format(b)} | {fmt.format(a)}")
    result = {"settings": asdict(settings), "before": before.metrics, "after": after.metrics,
              "train_seconds": train_seconds, "total_seconds": total,
              "seconds_per_step": train_seconds / max(1, settings.steps)}
    (out / "demo_result.json").write_text(json.dumps(result, indent=2))
    print(f"\ntraining {train_seconds:.0f}s ({result['seconds_per_step']:.1f} s/step), total {total:.0f}s")
    print(f"report:   {md_path}\n          {json_path}\ncurves:   {curves}\nlogs:     {out / 'training_log.jsonl'}, "
          f"{out / 'samples.jsonl'}\nadapter:  {out / 'final'}\nresult:   {out / 'demo_result.json'}")
    return result


def demo_config(settings: DemoSettings, output_dir, **overrides):
    """The demo's GRPOConfig (bench/learning_vs_trl.py builds TRL's config from the same settings)."""
    from forge.core.grpo import GRPOConfig

    config = GRPOConfig(
        group_size=settings.group_size, prompts_per_step=settings.prompts_per_step, gradient_accumulation_steps=1,
        max_steps=settings.steps, learning_rate=settings.learning_rate, lr_scheduler="constant", warmup_ratio=0.0,
        kl_beta=0.0, temperature=settings.temperature, max_new_tokens=settings.max_new_tokens, use_lora=True,
        lora_r=settings.lora_r, lora_alpha=2 * settings.lora_r, logging_steps=1, save_steps=0,
        reward_weights=[1.0, settings.format_weight], output_dir=str(output_dir), seed=settings.seed,
        loss_type="dr_grpo", scale_rewards="group", lora_target_modules=settings.lora_targets.split(","),
        drop_zero_std_groups=True, micro_batch_size=settings.group_size,
    )
    return replace(config, **overrides) if overrides else config


def demo_rewards() -> list:
    """The demo's rewards, weighted [1, format_weight]: correctness of the final answer, and the tag format."""
    from forge.core.reward import MathCorrectnessReward, TagFormatReward

    return [MathCorrectnessReward(), TagFormatReward()]


def _summary_line(label: str, metrics: dict) -> str:
    return (f"{label}: strict {metrics['strict_accuracy']:.1%}, soft {metrics['soft_accuracy']:.1%}, "
            f"format {metrics['format_rate']:.1%}")
