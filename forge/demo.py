"""`forge demo`: LoRA GRPO makes the packaged SmolLM2-135M-Instruct better at arithmetic, offline, on a CPU.

The recipe: build a seeded training set and a fixed, disjoint held-out set of arithmetic problems in a
chat prompt that asks for <think>...</think><answer>...</answer> (the arithmetic task,
forge/data/arithmetic.py: its rows and its grader, which both the reward and the evaluation use); measure the
base model on the held-out set (greedy); train on fresh prompts every step (a group whose completions all
score the same carries no GRPO signal and skips the backward pass; --screen_candidates instead keeps only
prompts with mixed results), evaluating the first --eval_subset held-out problems every --eval_every steps for
the held-out curve; measure again with the same decoding; write the before/after report. --ceiling measures
the base model's pass@k at the training temperature on the held-out set instead (what
sharpening alone can reach).

`forge demo --tools`: the same LoRA GRPO with a calculator tool, on arithmetic a 135M model cannot do in its
head: 3-digit x 2-digit products, one-step "boxes" word problems, and two-step word problems with a distractor
quantity (a*b + c). The prompt (the same before and after training) describes the text protocol
`<calc>expr</calc>` -> `<result>v</result>` -> `<answer>v</answer>` and shows one worked example with one
call. Rewards: the number in the last <answer> equals the reference (weight 1; the evaluation counts the same
function's verdict), and an <answer> tag is there (format_weight). Three greedy evaluations on the same fixed
held-out set (disjoint from training): the base model without the tool (a prompt without the calculator), the
base model with it, the trained model with it.

Both demos load the model and pick the precision in one place (`load_policy`: one `choose_precision` call),
and evaluate in that precision: the one the trainer trains in, so that before and after
differ by training only.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from forge.core.config import GRPOConfig
from forge.core.reward import TagFormatReward
from forge.core.trainer import GRPOTrainer, seed_everything
from forge.data.arithmetic import ARITHMETIC_TASK
from forge.demo_async import async_summary, sampling_server
from forge.eval.evaluate import aggregate_metrics, evaluate
from forge.eval.gain import gain_table, time_to_gain
from forge.eval.plot import plot_training_curves
from forge.eval.report import build_comparison, write_comparison
from forge.eval.screen import screen_prompts
from forge.model import Precision, choose_precision, cpu_name, load_model


@dataclass
class DemoSettings:
    model: str = "default"
    """Model to fine-tune: 'default' = the packaged SmolLM2-135M-Instruct (no network needed)."""
    steps: int = 60
    """Optimizer steps (--tools: 20; --distill: the student's 24)."""
    prompts_per_step: int = 4
    """Prompts per optimizer step (4 x 8 completions; --tools: 2; --distill: the student's 8 x 1)."""
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
    matrix units (AMX / AVX512-BF16) or a bf16 GPU, fp32 elsewhere; 'float32' forces fp32.
    Weights stay fp32."""
    generation_backend: str = "auto"
    """Sampling during training: Forge's own decode loop ('auto') or 'vllm' (vLLM installed; docs/scaling.md).
    Every evaluation decodes with Forge's own greedy loop, so runs on either backend are measured alike."""
    quick: bool = False
    """Smoke run (~2 minutes): 3 steps, 20 held-out problems, small screening; learning not expected."""
    tools: bool = False
    """Instead: the calculator-tool demo: arithmetic with a <calc> tool, base model without and with the tool,
    trained model with the tool, on the same held-out set."""
    distill: bool = False
    """Instead: on-policy distillation: the packaged base model (the student) learns from the demo's
    GRPO-trained adapter (the teacher: --teacher, or trained first by this command in output_dir/teacher, with
    the plain demo's recipe) to match the teacher's next-token distributions; prints the steps and CPU seconds
    each needed for 90% of the teacher's gain. The student's recipe: 24 steps x 8 prompts x 1 completion, lr
    3e-4, distill_loss 'full', the curve on 240 held-out problems every 4 steps; other flags apply to both."""
    teacher: str = ""
    """With --distill: the final/ adapter folder of an earlier `forge demo` run (its demo_result.json beside
    it gives GRPO's curve and times); empty = train the teacher first."""
    reward_coef: float = 0.0
    """With --distill: weight of the reward advantage next to the teacher's (0 = pure distillation)."""
    distill_loss: str = "sampled"
    """With --distill: 'sampled' or 'full' (the reverse KL per sampled token, or over the vocabulary;
    --distill: 'full')."""
    asynchronous: bool = False
    """--async: sample and learn at once (GRPOConfig.max_staleness): a rollout worker process samples the next
    steps' groups on half the cores while the step trains on the rest (with --generation_backend vllm: a
    `forge vllm-serve` the demo starts there); reports who waited on whom (the async/* metrics)."""
    max_staleness: int = 1
    """With --async: how many optimizer steps old the weights that sample a step are (1: one step off)."""
    dynamic_sampling: bool = False
    """Dynamic sampling (DAPO): up to 4 rounds of prompts per step until it holds prompts_per_step groups
    whose rewards differ."""
    env: bool = False
    """Instead: the environment demo (forge/demo_env.py): guess-the-number with higher/lower answers, base and
    trained model with the real answers and with a decoy's answers in their place, on the same held-out
    episodes."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoSettings:
        """The settings of parsed flags (`add_demo_arguments`: None = not given): the flags the user gave,
        then the recipe of --tools, --env, --distill or --quick (--quick wins), then the defaults."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name) is not None}
        return cls(**(recipe(given) | given))


QUICK = {"steps": 3, "heldout": 20, "prompts_per_step": 2, "max_new_tokens": 48, "eval_every": 2,
         "eval_subset": 10}
TOOLS = {"steps": 20, "prompts_per_step": 2}
"""The tool demo's recipe: 20 steps x 2 prompts x 8 completions (the measured one, about 12 minutes on one
thread of the 2-core machine; the plain demo's 60 x 4 would take about 40)."""


ENV = {"steps": 30, "prompts_per_step": 2, "max_new_tokens": 48, "learning_rate": 3e-4, "heldout": 48,
       "temperature": 1.0}
"""The environment demo's recipe (forge/demo_env.py)."""
DISTILL = {"steps": 24, "prompts_per_step": 8, "group_size": 1, "learning_rate": 3e-4, "distill_loss": "full",
           "eval_every": 4, "eval_subset": 240}
"""The distillation student's recipe (--distill; a teacher trained here first keeps the plain demo's values):
8 prompts x 1 completion (pure distillation needs no group baseline), the divergence over the whole
vocabulary, the curve on all 240 held-out problems every 4 steps (docs/performance.md, "On-policy
distillation")."""
RECIPES = {"tools": TOOLS, "env": ENV, "distill": DISTILL, "quick": QUICK}  # in this order: --quick wins


def recipe(switches: dict) -> dict:
    """The settings changed by the switches that are on in `switches` ({"tools": True, ...}), with their
    values."""
    return {key: value for name, values in RECIPES.items() if switches.get(name)
            for key, value in values.items()}


def recipe_defaults(switches: dict) -> dict:
    """Every setting's default in the demo `switches` describe: DemoSettings' own, then that recipe."""
    return {f.name: f.default for f in fields(DemoSettings)} | recipe(switches)


def add_demo_arguments(parser: argparse.ArgumentParser, switches: dict | None = None) -> None:
    """One flag per DemoSettings field, its docstring the help, with the default of the demo the flags
    describe (`switches`, e.g. {"tools": True}: that recipe). A flag left out parses as None (False for a
    switch)."""
    body = ast.parse(inspect.getsource(DemoSettings)).body[0].body
    docs = {node.target.id: nxt.value.value for node, nxt in itertools.pairwise(body)
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)}
    defaults = recipe_defaults(switches or {})
    for f in fields(DemoSettings):
        text = " ".join(docs.get(f.name, "").split()).replace("%", "%%")
        if f.type in ("bool", bool):
            flags = ["--async"] if f.name == "asynchronous" else []  # `async` is a Python keyword
            parser.add_argument(*flags, f"--{f.name}", dest=f.name, action="store_true", default=None,
                                help=text)
        else:
            type_name = f.type if isinstance(f.type, str) else f.type.__name__
            kind = {"int": int, "float": float, "str": str}[type_name]
            parser.add_argument(f"--{f.name}", type=kind, default=None,
                                help=f"{text} (default: {defaults[f.name]})")


def demo_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of `forge demo` (the CLI hands it the demo's part of the command line, `argv`):
    with --tools in argv it describes the tool demo, its help and defaults included."""
    switches = {name: f"--{name}" in (argv or []) for name in RECIPES}
    tools = switches["tools"]
    described = __doc__.split("\n\n")
    description = described[2] if tools else "\n\n".join(described[:2])
    parser = argparse.ArgumentParser(
        prog="forge demo" + (" --tools" if tools else ""),
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_demo_arguments(parser, switches)
    return parser


# ----------------------------------------------------------------------------------------------------
# What both demos share: the run around them, the model and its precision, the GRPO config


class DemoRun:
    """The clock, the progress lines, the phase timings and the output folder of one demo run."""

    def __init__(self, settings: DemoSettings, label: str):
        self.started, self.label, self.timings = time.perf_counter(), label, {}
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.out = Path(settings.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def say(self, text: str) -> None:
        print(f"[{self.label} {self.elapsed():6.0f}s] {text}", flush=True)

    @contextlib.contextmanager
    def timed(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.timings[phase] = time.perf_counter() - t0


def load_policy(settings: DemoSettings) -> tuple[torch.nn.Module, Any, Precision]:
    """(model, tokenizer, precision). The precision is the one the trainer will train in (it asks
    `choose_precision` the same dtype on the same device); every evaluation of a demo runs in it."""
    model, tokenizer = load_model(settings.model)
    return model, tokenizer, choose_precision(settings.dtype, next(model.parameters()).device)


def demo_config(settings: DemoSettings, output_dir, **overrides) -> GRPOConfig:
    """The demo's GRPOConfig (bench/learning_vs_trl.py builds TRL's config from the same settings)."""
    config = GRPOConfig(
        group_size=settings.group_size,
        prompts_per_step=settings.prompts_per_step,
        gradient_accumulation_steps=1,
        max_steps=settings.steps,
        learning_rate=settings.learning_rate,
        lr_scheduler="constant",
        warmup_ratio=0.0,
        kl_beta=0.0,
        temperature=settings.temperature,
        max_new_tokens=settings.max_new_tokens,
        use_lora=True,
        lora_r=settings.lora_r,
        lora_alpha=2 * settings.lora_r,
        logging_steps=1,
        save_steps=0,
        reward_weights=[1.0, settings.format_weight],
        output_dir=str(output_dir),
        seed=settings.seed,
        loss_type="dr_grpo",
        scale_rewards="group",
        lora_target_modules=settings.lora_targets.split(","),
        drop_zero_std_groups=True,
        micro_batch_size=settings.group_size,
        dtype=settings.dtype,
        generation_backend=settings.generation_backend,
        dynamic_sampling=settings.dynamic_sampling,
        max_staleness=settings.max_staleness if settings.asynchronous else None,
        overwrite_output_dir=True,  # each demo run replaces the previous one in its output dir
    )
    return replace(config, **overrides) if overrides else config


def training_line(settings: DemoSettings) -> str:
    return (f"training: {settings.steps} steps x {settings.prompts_per_step} prompts x {settings.group_size} "
            f"completions, LoRA r={settings.lora_r}, lr {settings.learning_rate}")


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _machine() -> dict:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__}


def run_demo(settings: DemoSettings, teacher: str | None = None) -> dict:
    """`forge demo` (settings.distill: `run_distill_demo`; --tools and --env run forge/demo_tools.py and
    forge/demo_env.py); with `teacher` (an adapter folder) the run distills from it."""
    if settings.distill:
        return run_distill_demo(settings)
    run = DemoRun(settings, "forge demo")
    model, tokenizer, precision, heldout, candidates = _load_model_and_problems(settings, run)
    if settings.ceiling:
        with precision.autocast():
            return _measure_ceiling(settings, run, model, tokenizer, heldout, precision)

    run.say(f"evaluating the base model on {len(heldout)} held-out problems (greedy, "
            f"{str(precision.compute).removeprefix('torch.')}: {precision.reason})")
    eval_kw = {"max_new_tokens": settings.max_new_tokens, "batch_size": settings.eval_batch_size}
    with run.timed("base_eval"), precision.autocast():
        before = evaluate(model, tokenizer, heldout, **eval_kw)
    run.say(_summary_line("base", before.metrics))
    load_before = _load_average()
    train_rows = (_screened_rows(settings, run, model, tokenizer, candidates, heldout)
                  if settings.screen_candidates else candidates)

    trainer, curve, subset, train_cpu_seconds = _train_demo(settings, run, model, tokenizer, train_rows,
                                                            heldout, before, eval_kw, teacher)

    after = _final_eval(run, trainer, tokenizer, curve, heldout, eval_kw, precision)
    with run.timed("report_and_plot"):
        json_path, md_path = write_comparison(build_comparison(before, after, labels=("base", "trained")),
                                              run.out)
        curves = plot_training_curves(run.out)
    total = run.timings["total"] = run.elapsed()
    train_seconds = run.timings["training"]
    _print_comparison(before.metrics, after.metrics)
    # a student says so
    recorded = asdict(settings) | ({"distill": True, "teacher": teacher} if teacher else {})
    result = {
        "settings": recorded,
        "heldout_size": len(heldout),
        "before": before.metrics,
        "after": after.metrics,
        "gain": after.metrics["strict_accuracy"] - before.metrics["strict_accuracy"],
        "eval_curve": curve.points,
        "eval_curve_size": len(subset or ()),
        "train_seconds": train_seconds,
        "train_cpu_seconds": train_cpu_seconds,
        "total_seconds": total,
        "seconds_per_step": train_seconds / max(1, settings.steps),
        "timings": run.timings,
        "load_average": {"start": load_before, "end": _load_average()},
        "machine": _machine()
        | {"precision": str(precision.compute).removeprefix("torch."), "precision_reason": precision.reason},
    }
    _save_result(settings, run, result)
    print(
        f"report:   {md_path}\n          {json_path}\ncurves:   {curves}\nlogs:     "
        f"{run.out / 'training_log.jsonl'}, {run.out / 'samples.jsonl'}\nadapter:  {run.out / 'final'}\n"
        f"result:   {run.out / 'demo_result.json'}"
    )
    return result


def _load_model_and_problems(settings: DemoSettings, run: DemoRun):
    """The model, its tokenizer and precision, the held-out problems and the training candidates."""
    run.say(f"loading {settings.model} (the packaged model is converted from GGUF once, ~20 s)")
    model, tokenizer, precision = load_policy(settings)
    heldout = ARITHMETIC_TASK.heldout(n=settings.heldout, chat=True)
    candidates = ARITHMETIC_TASK.rows(
        n=max(settings.screen_candidates, settings.steps * settings.prompts_per_step),
        seed=settings.seed,
        chat=True,
    )
    run.timings["load"] = run.elapsed()
    return model, tokenizer, precision, heldout, candidates


def _train_demo(settings: DemoSettings, run: DemoRun, model, tokenizer, train_rows: list[dict],
                heldout: list[dict], before, eval_kw: dict, teacher: str | None):
    """Train with the held-out curve (a teacher's adapter: distill from it). Returns the trainer, the curve,
    the curve's held-out subset (None without one) and the training CPU seconds (the curve's excluded)."""
    subset = heldout[: settings.eval_subset] if settings.eval_every else None
    distill = {"teacher_model": teacher, "reward_coef": settings.reward_coef, "drop_zero_std_groups": False,
               "distill_loss": settings.distill_loss, "micro_batch_size": 0}  # every group in one loss pass
    with sampling_server(settings, run) as server:
        config = demo_config(
            settings,
            run.out,
            eval_steps=settings.eval_every,
            eval_before_training=subset is not None,
            **(distill if teacher else {}),
            **server,
        )
        run.say(training_line(settings) + (f"; held-out curve: the first {len(subset)} problems every "
                                            f"{settings.eval_every} steps" if subset else ""))
        curve = HeldoutCurve(heldout, len(subset or ()), settings.steps, eval_kw, before)
        trainer = GRPOTrainer(model, tokenizer, demo_rewards(), config, evaluator=curve)
        curve.trainer = trainer
        with run.timed("training"):
            cpu_started = time.process_time()
            trainer.train(train_rows, eval_dataset=subset)
    run.timings["training"] -= curve.seconds
    train_cpu_seconds = time.process_time() - cpu_started - curve.cpu_seconds
    run.timings["curve_evals"] = curve.seconds - curve.final_seconds
    return trainer, curve, subset, train_cpu_seconds


def _final_eval(run: DemoRun, trainer, tokenizer, curve: HeldoutCurve, heldout: list[dict], eval_kw: dict,
                precision: Precision):
    """The trained policy on the whole held-out set: the curve's last point, or evaluated here."""
    run.say(f"evaluating the trained policy on the same {len(heldout)} held-out problems (greedy)")
    with run.timed("final_eval"):
        if curve.final is None:  # no curve (eval_every 0): evaluated here, in the training precision
            with precision.autocast(trainer.model):
                curve.final = evaluate(trainer.model, tokenizer, heldout, **eval_kw)
    run.timings["final_eval"] += curve.final_seconds
    run.say(_summary_line("trained", curve.final.metrics))
    return curve.final


def _print_comparison(before: dict, after: dict) -> None:
    print("\n            metric |   base | trained")
    for label, key in (("strict accuracy", "strict_accuracy"), ("soft accuracy", "soft_accuracy"),
                       ("format rate", "format_rate"), ("mean length", "mean_completion_length")):
        fmt = "{:6.1%}" if key != "mean_completion_length" else "{:6.1f}"
        print(f"{label:>18} | {fmt.format(before[key])} | {fmt.format(after[key])}")


def _save_result(settings: DemoSettings, run: DemoRun, result: dict) -> None:
    """demo_result.json, the times (and an async run's summary) printed."""
    out, train_seconds = run.out, result["train_seconds"]
    (out / "demo_result.json").write_text(json.dumps(result, indent=2))
    print(f"\ntraining {train_seconds:.0f}s ({result['seconds_per_step']:.1f} s/step), "
          f"total {result['total_seconds']:.0f}s ("
          + ", ".join(f"{k} {v:.0f}s" for k, v in run.timings.items() if k != "total") + ")")
    if settings.asynchronous:
        result["async"] = async_summary(out / "training_log.jsonl")
        (out / "demo_result.json").write_text(json.dumps(result, indent=2))
        print("async:    " + ", ".join(f"{k} {v:.1f}" for k, v in result["async"].items()))


def run_distill_demo(settings: DemoSettings) -> dict:
    """--distill: the GRPO teacher (settings.teacher, or trained here first), then the packaged base distilled
    from it; the steps and training CPU seconds each needed for 90% of the teacher's held-out gain
    (forge/eval/gain.py)."""
    out, plain = Path(settings.output_dir), replace(settings, distill=False, teacher="")
    plain_values = recipe_defaults({"quick": settings.quick})
    # the plain demo's recipe
    teacher_settings = replace(plain, **{key: plain_values[key] for key in DISTILL})
    teacher_dir = Path(settings.teacher) if settings.teacher else out / "teacher" / "final"
    if settings.teacher and not (teacher_dir.parent / "demo_result.json").is_file():
        raise FileNotFoundError(
            f"--teacher {teacher_dir}: no demo_result.json beside it; give the final/ folder of "
            f"a `forge demo` run, or leave --teacher out to train the teacher first"
        )
    grpo = (json.loads((teacher_dir.parent / "demo_result.json").read_text()) if settings.teacher
            else run_demo(replace(teacher_settings, output_dir=str(out / "teacher"))))
    student = run_demo(replace(plain, output_dir=str(out / "student")), teacher=str(teacher_dir))
    rows = [(label, result, time_to_gain(result, grpo, 0.9, log_dir / "training_log.jsonl"))
            for label, result, log_dir in (("GRPO (the teacher)", grpo, teacher_dir.parent),
                                           ("distillation", student, out / "student"))]
    print(f"\n90% of the teacher's held-out gain (greedy strict accuracy; each curve on its own held-out "
          f"problems: {rows[0][2]['n']} and {rows[1][2]['n']}):\n" + gain_table(rows))
    result = {"teacher": str(teacher_dir), "grpo": grpo, "distillation": student,
              "to_90_percent": {label: reached for label, _, reached in rows}}
    (out / "distill_result.json").write_text(json.dumps(result, indent=2))
    print(f"result:   {out / 'distill_result.json'}")
    return result


def demo_rewards() -> list:
    """The demo's rewards, weighted [1, format_weight]: the arithmetic task's own reward (its grader on the
    final answer, the grader the evaluation uses), and the tag format."""
    return [ARITHMETIC_TASK.reward, TagFormatReward()]


def _screened_rows(settings: DemoSettings, run: DemoRun, model, tokenizer, candidates: list[dict],
                   heldout: list[dict]) -> list[dict]:
    """The candidates whose samples are mixed (some right, some wrong), topped up to one step's prompts."""
    seed_everything(settings.seed)
    run.say(
        f"screening {settings.screen_candidates} training prompts ({settings.screen_group_size} samples "
        "each) for mixed correctness"
    )
    screened = screen_prompts(model, tokenizer, candidates[: settings.screen_candidates],
                              group_size=settings.screen_group_size, max_new_tokens=settings.max_new_tokens,
                              temperature=settings.temperature, seed=settings.seed, heldout_rows=heldout)
    run.say(screened.summary())
    rows = list(screened.kept)
    if len(rows) < settings.prompts_per_step:  # too few mixed prompts: top up with unscreened ones
        kept_questions = {str(r["prompt"]) for r in rows}
        rows += [r for r in candidates if str(r["prompt"]) not in kept_questions][
            : settings.prompts_per_step - len(rows)]
    (run.out / "screening.json").write_text(json.dumps(screened.report(), indent=2))
    return rows


class HeldoutCurve:
    """The demo's evaluator for GRPOTrainer(evaluator=...): greedy metrics of the held-out
    subset during training.

    Step 0 is not generated again: it is the first `subset` problems of the base model's full evaluation
    (the same greedy decode). At the last step the whole held-out set is evaluated once (the subset comes
    first, so its metrics are those problems' share of that evaluation) and kept as the demo's "after"
    result; the trainer's closing evaluation at the same step is answered from the cache."""

    def __init__(self, heldout, subset: int, total_steps: int, eval_kw: dict, before):
        self.heldout, self.subset, self.total_steps, self.eval_kw = heldout, subset, total_steps, eval_kw
        self.trainer = None
        self.cache = {0: self._subset_metrics(before)}
        self.points: list[dict] = []
        self.seconds = self.final_seconds = self.cpu_seconds = 0.0  # evaluating: wall, its final part, CPU
        self.cpu_started: float | None = None  # process CPU time at the first call (training's start)
        self.final = None

    def _subset_metrics(self, result) -> dict:
        return {**aggregate_metrics(result.records[: self.subset], 1), "seconds": 0.0}

    def __call__(self, model, tokenizer, rows, *, max_new_tokens, max_prompt_length) -> dict:
        step, cpu = self.trainer.global_step, time.process_time()
        self.cpu_started = cpu if self.cpu_started is None else self.cpu_started
        train_cpu_seconds = cpu - self.cpu_started - self.cpu_seconds  # training's CPU time up to this step
        if step not in self.cache:
            t0 = time.perf_counter()
            if step >= self.total_steps:  # the whole held-out set once; the subset's share of it
                self.final = evaluate(model, tokenizer, self.heldout, **self.eval_kw)
                metrics = self._subset_metrics(self.final)
                self.final_seconds = time.perf_counter() - t0
            else:
                metrics = evaluate(model, tokenizer, rows, **self.eval_kw).metrics
            self.seconds += time.perf_counter() - t0
            self.cpu_seconds += time.process_time() - cpu
            self.cache[step] = metrics
        if not any(point["step"] == step for point in self.points):
            m = self.cache[step]
            self.points.append({"step": step, "strict_accuracy": m["strict_accuracy"], "soft_accuracy":
                                m["soft_accuracy"], "format_rate": m["format_rate"], "n": m["n"],
                                "train_cpu_seconds": train_cpu_seconds})
        return {k: v for k, v in self.cache[step].items() if k in HELDOUT_KEYS}


HELDOUT_KEYS = ("strict_accuracy", "soft_accuracy", "format_rate", "mean_completion_length", "n")


def _measure_ceiling(settings: DemoSettings, run: DemoRun, model, tokenizer, heldout,
                     precision: Precision) -> dict:
    """pass@group_size of the base model at the training temperature: what sharpening alone can reach."""
    k = settings.group_size
    run.say(f"measuring the ceiling: {k} samples per problem at temperature {settings.temperature} on "
            f"{len(heldout)} held-out problems")
    load_before = _load_average()
    result = evaluate(model, tokenizer, heldout, max_new_tokens=settings.max_new_tokens, num_samples=k,
                      temperature=settings.temperature, k_values=(1, k), seed=settings.seed,
                      batch_size=max(1, settings.eval_batch_size // k))
    run.say(result.summary())
    ceiling = {"settings": asdict(settings), "heldout_size": len(heldout), "metrics": result.metrics,
               "decoding": result.settings, "total_seconds": run.elapsed(),
               "load_average": {"start": load_before, "end": _load_average()},
               "machine": _machine() | {"precision": str(precision.compute).removeprefix("torch.")}}
    (run.out / "ceiling.json").write_text(json.dumps(ceiling, indent=2))
    print(f"pass@{k} {result.metrics[f'pass@{k}']:.1%}, pass@1 {result.metrics['pass@1']:.1%}\n"
          f"result:   {run.out / 'ceiling.json'}")
    return ceiling


def _summary_line(label: str, metrics: dict) -> str:
    return (f"{label}: strict {metrics['strict_accuracy']:.1%}, soft {metrics['soft_accuracy']:.1%}, "
            f"format {metrics['format_rate']:.1%}")
