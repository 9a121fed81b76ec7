"""Catch table: deliberately broken runs, and what the preflight and the run-health rules say about each.

    python bench/health_catch.py [--model tiny|default] [--steps 12]

Each case trains a short run with one thing broken (or nothing, the healthy reference) and records the preflight's
problems and advice, every run-health alarm with the step it went off at, and the seconds from the start of the
run to the first thing said. Writes bench/results/health_catch_<model>.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import torch

from forge import GRPOConfig, GRPOTrainer
from forge.core.preflight import preflight
from forge.data import arithmetic_dataset
from forge.model import load_model
from forge.model.tiny import build_tiny_model
from forge.run.health import HealthMonitor, parse_thresholds

RESULTS = Path(__file__).parent / "results"


def vowels(prompts, completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in text)) / 10 for text in completions]


def zero(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def raises_on_most(prompts, completions, **kwargs):
    if any(len(c) % 4 for c in completions):
        raise ValueError("reward bug")
    return [1.0] * len(completions)


def exact_essay(prompts, completions, **kwargs):  # a task far too hard: an exact 40-word answer
    return [float("the quick brown fox jumps over the lazy dog " * 5 in c) for c in completions]


CASES = {  # name -> (reward, config overrides, plain string prompts to a chat model?)
    "healthy (reference)": (vowels, {}, False),
    "max_new_tokens far too small": (vowels, {"max_new_tokens": 2}, False),
    "a reward that always returns 0": (zero, {}, False),
    "a reward that raises on most rows": (raises_on_most, {"on_reward_error": "score"}, False),
    "a chat model fed plain prompts": (vowels, {}, True),
    "learning rate 1e-1 (diverges)": (vowels, {"learning_rate": 1e-1}, False),
    "a task far too hard": (exact_essay, {}, False),
}


def run_case(name: str, model_name: str, steps: int) -> dict:
    reward, overrides, plain = CASES[name]
    if model_name == "tiny":
        model, tokenizer = build_tiny_model(seed=0)
        base = {"max_new_tokens": 16, "learning_rate": 1e-2}
    else:
        model, tokenizer = load_model("default")
        base = {"max_new_tokens": 48, "learning_rate": 2e-4, "use_lora": True}
    rows = arithmetic_dataset(n=32, seed=0, chat=not plain)
    config = GRPOConfig(**({"group_size": 8, "prompts_per_step": 2, "gradient_accumulation_steps": 1,
                            "max_steps": steps, "logging_steps": 1, "save_steps": 0, "kl_beta": 0.04,
                            "output_dir": tempfile.mkdtemp(), "preflight": "off"} | base | overrides))
    trainer = GRPOTrainer(model, tokenizer, reward, config)
    started = time.perf_counter()
    report = preflight(trainer, rows, total_steps=steps)
    said_at = time.perf_counter() - started if (report.problems or report.advice) else None
    health, alarms = HealthMonitor(config.health_window, parse_thresholds(config.health_thresholds)), []
    real_step = trainer.step

    def step(batch):
        nonlocal said_at
        metrics = real_step(batch)
        for alarm in health.check(metrics)[1]:
            alarms.append((trainer.global_step, alarm))
            said_at = said_at if said_at is not None else time.perf_counter() - started
        return metrics

    trainer.step = step
    quiet = io.StringIO()
    # a diverging run may stop on non-finite steps: what was said before counts
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), contextlib.suppress(Exception):
        trainer.train(rows)
    return {"case": name, "preflight_problems": report.problems, "preflight_advice": report.advice,
            "alarms": alarms, "seconds_to_first_word": said_at, "preflight_seconds": report.seconds,
            "run_seconds": time.perf_counter() - started, "steps": trainer.global_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = [run_case(name, args.model, args.steps) for name in CASES]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"health_catch_{args.model}.json").write_text(json.dumps(results, indent=2) + "\n")
    for r in results:
        said = [p.split(":")[0][:60] for p in r["preflight_problems"] + r["preflight_advice"]]
        first = "-" if r["seconds_to_first_word"] is None else f"{r['seconds_to_first_word']:.1f} s"
        print(f"{r['case']:36s} | preflight: {'; '.join(said) or '-'} | alarms: "
              f"{', '.join(f'{a}@{s}' for s, a in r['alarms']) or '-'} | first word {first}")


if __name__ == "__main__":
    main()
