"""`forge demo --tools`: LoRA GRPO with a calculator tool on arithmetic a 135M model cannot do in its head.

The calculator task (its problems, prompt and grader) and its demo; the run around it, the model, its
precision and the GRPOConfig are the plain demo's (forge/demo.py, whose docstring describes
this demo's recipe).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict

import torch

from forge.core.rollout import SamplingSettings, generate
from forge.core.trainer import GRPOTrainer
from forge.demo import DemoRun, DemoSettings, demo_config, load_policy, training_line
from forge.tools.calls import ToolSettings, as_tools, calculator

SYSTEM_WITH_TOOL = (
    "You are a careful assistant with a calculator. To compute something, write "
    "<calc>expression</calc>; the calculator answers with <result>value</result>. Then give the "
    "final answer as <answer>number</answer>."
)
SYSTEM_NO_TOOL = "You are a careful assistant. Give the final answer as <answer>number</answer>."
EXAMPLE_QUESTION = "What is 312 * 27?"
EXAMPLE_WITH_TOOL = "<calc>312 * 27</calc><result>8424</result> The answer is <answer>8424</answer>"
EXAMPLE_NO_TOOL = "312 * 27 = 8424. The answer is <answer>8424</answer>"
KINDS = ("product", "boxes", "two_step")
HELDOUT_SEED = 10_000


def tool_problems(n: int, seed: int) -> list[dict]:
    """n problems {question, answer, kind}, the kinds in turn."""
    rng, out = random.Random(seed), []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        a, b = rng.randint(100, 999), rng.randint(11, 99)
        if kind == "product":
            question, answer = f"What is {a} * {b}?", a * b
        elif kind == "boxes":
            question, answer = f"A box holds {b} pens. How many pens are in {a} boxes?", a * b
        else:
            c, d = rng.randint(100, 999), rng.randint(2, 9)
            question = (
                f"A shop sells {a} bags of {b} apples each and {c} single apples. It has {d} workers. "
                f"How many apples does it sell in total?"
            )
            answer = a * b + c
        out.append({"question": question, "answer": answer, "kind": kind})
    return out


def tool_prompt(question: str, with_tool: bool = True) -> list[dict]:
    system, example = ((SYSTEM_WITH_TOOL, EXAMPLE_WITH_TOOL) if with_tool
                       else (SYSTEM_NO_TOOL, EXAMPLE_NO_TOOL))
    return [{"role": "system", "content": system}, {"role": "user", "content": EXAMPLE_QUESTION},
            {"role": "assistant", "content": example}, {"role": "user", "content": question}]


def tool_rows(problems: list[dict], with_tool: bool = True) -> list[dict]:
    return [
        {"prompt": tool_prompt(p["question"], with_tool), "reference": str(p["answer"]), "kind": p["kind"]}
        for p in problems
    ]


def final_answer(text: str) -> str | None:
    found = re.findall(r"<answer>\s*(-?[\d,]+)\s*</answer>", text)
    return found[-1].replace(",", "") if found else None


def answer_correct(prompts, completions, references, **kwargs) -> list[float]:
    """1.0 when the number in the last <answer> is the reference (a <result> alone does not count): the
    training reward, and the verdict the evaluation counts."""
    return [float(final_answer(text) == str(ref)) for text, ref in zip(completions, references)]


def answer_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion gives an <answer>number</answer>."""
    return [float(final_answer(text) is not None) for text in completions]


def calculator_settings() -> ToolSettings:
    """The calculator as the demo's rollouts use it, in training and evaluation: text
    protocol, 3 calls, 5 s."""
    return ToolSettings(as_tools([calculator]), "text", max_calls=3, timeout=5.0)


@torch.no_grad()
def evaluate_with_tools(model, tokenizer, rows: list[dict], *, with_tool: bool, max_new_tokens: int,
                        batch_size: int = 60) -> dict:
    """Greedy accuracy on rows (tool_rows, graded by `answer_correct`), the share that used the
    tool, and per kind."""
    was_training = model.training
    model.eval()
    sampling = SamplingSettings(max_new_tokens, do_sample=False)
    tools = calculator_settings() if with_tool else None
    texts, calls = [], []
    for start in range(0, len(rows), batch_size):
        rollout = generate(
            model,
            tokenizer,
            [row["prompt"] for row in rows[start : start + batch_size]],
            1,
            sampling,
            tools=tools,
        )
        texts += rollout.completions
        calls += rollout.tool_calls or [[] for _ in rollout.completions]
    model.train(was_training)
    correct = answer_correct(None, texts, [row["reference"] for row in rows])
    records = []
    for row, text, right, made in zip(rows, texts, correct, calls):
        ran = [c for c in made if c.failure is None]
        records.append({"kind": row["kind"], "reference": row["reference"], "completion": text,
                        "correct": right == 1.0, "used_tool": bool(ran),
                        "right_call": any(c.output == row["reference"] for c in ran)})

    def share(key, subset=records):
        return sum(r[key] for r in subset) / max(len(subset), 1)

    return {"accuracy": share("correct"), "tool_use": share("used_tool"), "right_call": share("right_call"),
            "n": len(records), "by_kind": {k: share("correct", [r for r in records if r["kind"] == k])
                                           for k in KINDS},
            "format_rate": sum(answer_format(None, texts)) / max(len(records), 1),
            "examples": [r["completion"] for r in records[:3]]}


def run_tool_demo(settings: DemoSettings) -> dict:
    """The --tools path of `forge demo`."""
    run = DemoRun(settings, "forge demo --tools")
    model, tokenizer, precision = load_policy(settings)
    heldout = tool_problems(settings.heldout, HELDOUT_SEED)
    held_questions = {p["question"] for p in heldout}
    train = [p for p in tool_problems(settings.steps * settings.prompts_per_step * 2, settings.seed + 1)
             if p["question"] not in held_questions][:settings.steps * settings.prompts_per_step]
    eval_kw = {"max_new_tokens": settings.max_new_tokens, "batch_size": settings.eval_batch_size}
    run.timings["load"] = run.elapsed()

    def evaluated(phase: str, model, with_tool: bool) -> dict:
        with run.timed(phase), precision.autocast(model):
            return evaluate_with_tools(model, tokenizer, tool_rows(heldout, with_tool), with_tool=with_tool,
                                       **eval_kw)

    run.say(f"base model on {len(heldout)} held-out problems, greedy, without and with the calculator")
    no_tool = evaluated("no_tool_eval", model, with_tool=False)
    before = evaluated("base_eval", model, with_tool=True)
    run.say(f"no tool {no_tool['accuracy']:.1%}; with the tool {before['accuracy']:.1%} "
            f"(tool used {before['tool_use']:.1%}, right call {before['right_call']:.1%})")
    tools = calculator_settings()
    config = demo_config(
        settings,
        run.out,
        max_tool_calling_iterations=tools.max_calls,
        tool_format=tools.format,
        tool_timeout=tools.timeout,
    )
    trainer = GRPOTrainer(model, tokenizer, [answer_correct, answer_format], config, tools=[calculator])
    run.say(training_line(settings) + ", calculator tool")
    with run.timed("training"):
        trainer.train(tool_rows(train))  # under its own precision
    after = evaluated("final_eval", trainer.model, with_tool=True)
    run.say(f"trained with the tool {after['accuracy']:.1%} (tool used {after['tool_use']:.1%}, right call "
            f"{after['right_call']:.1%})")
    run.timings["total"] = run.elapsed()
    result = {
        "settings": asdict(settings),
        "heldout_size": len(heldout),
        "no_tool": no_tool,
        "before": before,
        "after": after,
        "gain_vs_base_with_tool": after["accuracy"] - before["accuracy"],
        "gain_vs_no_tool": after["accuracy"] - no_tool["accuracy"],
        "timings": run.timings,
        "precision": str(precision.compute).removeprefix("torch."),
    }
    (run.out / "demo_tools_result.json").write_text(json.dumps(result, indent=2))
    print(f"\n{'':>22} | accuracy | tool used | right call\n"
          + "\n".join(f"{label:>22} | {m['accuracy']:8.1%} | {m['tool_use']:9.1%} | {m['right_call']:10.1%}"
                      for label, m in (("base, no tool", no_tool), ("base, with tool", before),
                                       ("trained, with tool", after)))
          + f"\nresult: {run.out / 'demo_tools_result.json'}  ({run.timings['total']:.0f}s)")
    return result
