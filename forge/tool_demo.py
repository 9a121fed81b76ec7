"""`forge demo --tools`: LoRA GRPO with a calculator tool on arithmetic a 135M model cannot do in its head.

Problems: 3-digit x 2-digit products, one-step "boxes" word problems, and two-step word problems with a
distractor quantity (a*b + c). The prompt (the same before and after training) describes the text protocol
`<calc>expr</calc>` -> `<result>v</result>` -> `<answer>v</answer>` and shows one worked example with one
call. Rewards: the number in the last <answer> equals the reference (weight 1), and an <answer> tag is there
(format_weight). Three greedy evaluations on the same fixed held-out set (disjoint from training): the base
model without the tool (a prompt without the calculator), the base model with it, the trained model with it.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch

SYSTEM_WITH_TOOL = ("You are a careful assistant with a calculator. To compute something, write "
                    "<calc>expression</calc>; the calculator answers with <result>value</result>. Then give the "
                    "final answer as <answer>number</answer>.")
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
            question = (f"A shop sells {a} bags of {b} apples each and {c} single apples. It has {d} workers. "
                        f"How many apples does it sell in total?")
            answer = a * b + c
        out.append({"question": question, "answer": answer, "kind": kind})
    return out


def tool_prompt(question: str, with_tool: bool = True) -> list[dict]:
    system, example = (SYSTEM_WITH_TOOL, EXAMPLE_WITH_TOOL) if with_tool else (SYSTEM_NO_TOOL, EXAMPLE_NO_TOOL)
    return [{"role": "system", "content": system}, {"role": "user", "content": EXAMPLE_QUESTION},
            {"role": "assistant", "content": example}, {"role": "user", "content": question}]


def tool_rows(problems: list[dict], with_tool: bool = True) -> list[dict]:
    return [{"prompt": tool_prompt(p["question"], with_tool), "reference": str(p["answer"]), "kind": p["kind"]}
            for p in problems]


def final_answer(text: str) -> str | None:
    found = re.findall(r"<answer>\s*(-?[\d,]+)\s*</answer>", text)
    return found[-1].replace(",", "") if found else None


def answer_correct(prompts, completions, references, **kwargs) -> list[float]:
    """1.0 when the number in the last <answer> is the reference (a <result> alone does not count)."""
    return [float(final_answer(text) == str(ref)) for text, ref in zip(completions, references)]


def answer_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion gives an <answer>number</answer>."""
    return [float(final_answer(text) is not None) for text in completions]


@torch.no_grad()
def evaluate_with_tools(model, tokenizer, rows: list[dict], *, with_tool: bool, max_new_tokens: int,
                        batch_size: int = 60) -> dict:
    """Greedy accuracy on rows (tool_rows), the share that used the tool, and per kind."""
    from forge.core.rollout import SamplingSettings, generate
    from forge.core.tool_rollout import generate_with_tools
    from forge.tools.calls import ToolSettings, as_tools, calculator

    was_training = model.training
    model.eval()
    settings = SamplingSettings(max_new_tokens, do_sample=False)
    tools = ToolSettings(as_tools([calculator]), "text", max_calls=3, timeout=5.0)
    texts, calls = [], []
    for start in range(0, len(rows), batch_size):
        prompts = [row["prompt"] for row in rows[start:start + batch_size]]
        if with_tool:
            rollout = generate_with_tools(model, tokenizer, prompts, 1, settings, tools)
            calls += rollout.tool_calls
        else:
            rollout = generate(model, tokenizer, prompts, 1, settings)
            calls += [[] for _ in prompts]
        texts += rollout.completions
    model.train(was_training)
    records = []
    for row, text, made in zip(rows, texts, calls):
        ran = [c for c in made if c.failure is None]
        records.append({"kind": row["kind"], "reference": row["reference"], "completion": text,
                        "correct": final_answer(text) == row["reference"], "used_tool": bool(ran),
                        "right_call": any(c.output == row["reference"] for c in ran)})
    n = max(len(records), 1)

    def share(key, subset=records):
        return sum(r[key] for r in subset) / max(len(subset), 1)

    return {"accuracy": share("correct"), "tool_use": share("used_tool"), "right_call": share("right_call"),
            "n": len(records), "by_kind": {k: share("correct", [r for r in records if r["kind"] == k])
                                           for k in KINDS},
            "format_rate": sum(final_answer(r["completion"]) is not None for r in records) / n,
            "examples": [r["completion"] for r in records[:3]]}


def run_tool_demo(settings) -> dict:
    """The --tools path of `forge demo` (settings: forge.demo.DemoSettings)."""
    from forge.core.trainer import GRPOTrainer
    from forge.demo import demo_config
    from forge.model import choose_precision, load_model
    from forge.tools.calls import calculator

    started = time.perf_counter()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    def say(text):
        print(f"[forge demo --tools {time.perf_counter() - started:6.0f}s] {text}", flush=True)

    model, tokenizer = load_model(settings.model)
    heldout = tool_problems(settings.heldout, HELDOUT_SEED)
    held_questions = {p["question"] for p in heldout}
    train = [p for p in tool_problems(settings.steps * settings.prompts_per_step * 2, settings.seed + 1)
             if p["question"] not in held_questions][:settings.steps * settings.prompts_per_step]
    eval_kw = {"max_new_tokens": settings.max_new_tokens, "batch_size": settings.eval_batch_size}
    timings = {"load": time.perf_counter() - started}

    # every evaluation in the precision the trainer trains in (bf16 autocast where it is fast), as in forge demo
    precision = choose_precision(settings.dtype, next(model.parameters()).device)

    def timed(name, fn):
        t0 = time.perf_counter()
        with precision.autocast(model):  # model: the same modules, with LoRA layers once the trainer added them
            value = fn()
        timings[name] = time.perf_counter() - t0
        return value

    say(f"base model on {len(heldout)} held-out problems, greedy, without and with the calculator")
    no_tool = timed("no_tool_eval", lambda: evaluate_with_tools(model, tokenizer, tool_rows(heldout, False),
                                                                with_tool=False, **eval_kw))
    before = timed("base_eval", lambda: evaluate_with_tools(model, tokenizer, tool_rows(heldout), with_tool=True,
                                                            **eval_kw))
    say(f"no tool {no_tool['accuracy']:.1%}; with the tool {before['accuracy']:.1%} "
        f"(tool used {before['tool_use']:.1%}, right call {before['right_call']:.1%})")
    config = demo_config(settings, out, max_tool_calling_iterations=3, tool_format="text", tool_timeout=5.0)
    trainer = GRPOTrainer(model, tokenizer, [answer_correct, answer_format], config, tools=[calculator])
    say(f"training: {settings.steps} steps x {settings.prompts_per_step} prompts x {settings.group_size} "
        f"completions, LoRA r={settings.lora_r}, lr {settings.learning_rate}, calculator tool")
    t0 = time.perf_counter()
    trainer.train(tool_rows(train))  # under its own precision
    timings["training"] = time.perf_counter() - t0
    after = timed("final_eval", lambda: evaluate_with_tools(trainer.model, tokenizer, tool_rows(heldout),
                                                            with_tool=True, **eval_kw))
    say(f"trained with the tool {after['accuracy']:.1%} (tool used {after['tool_use']:.1%}, right call "
        f"{after['right_call']:.1%})")
    timings["total"] = time.perf_counter() - started
    result = {"settings": asdict(settings), "heldout_size": len(heldout), "no_tool": no_tool, "before": before,
              "after": after, "gain_vs_base_with_tool": after["accuracy"] - before["accuracy"],
              "gain_vs_no_tool": after["accuracy"] - no_tool["accuracy"], "timings": timings,
              "precision": str(precision.compute).removeprefix("torch.")}
    (out / "demo_tools_result.json").write_text(json.dumps(result, indent=2))
    print(f"\n{'':>22} | accuracy | tool used | right call\n"
          + "\n".join(f"{label:>22} | {m['accuracy']:8.1%} | {m['tool_use']:9.1%} | {m['right_call']:10.1%}"
                      for label, m in (("base, no tool", no_tool), ("base, with tool", before),
                                       ("trained, with tool", after)))
          + f"\nresult: {out / 'demo_tools_result.json'}  ({timings['total']:.0f}s)")
    return result


__all__ = ["answer_correct", "answer_format", "evaluate_with_tools", "run_tool_demo", "tool_problems",
           "tool_prompt", "tool_rows"]
