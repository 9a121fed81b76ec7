"""Which tool-call protocol does the packaged SmolLM2-135M-Instruct imitate best from one worked example?

Greedy rollouts through Forge's own decode loop with tools (core/rollout.py generate(..., tools=...)) on seeded problems the model cannot do in
its head (3-digit x 2-digit products, one-step "boxes" word problems, two-step word problems with a distractor),
the same system prompt and worked example written in two protocols:
    text   <calc>312 * 27</calc> -> <result>8424</result>
    json   <tool_call>{"name": "calculator", "arguments": {"expression": "312 * 27"}}</tool_call>
           -> <tool_response>8424</tool_response>   (the Qwen2.5 call syntax, as plain text: SmolLM2's chat
           template has no tool support)
Counts per protocol: completions with a call that ran, with a call whose value is the answer, with the right
number in <answer>. Usage: python bench/tool_protocol.py [--n 40] [--out bench/results/tool_protocol.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

from forge.core.rollout import SamplingSettings, generate
from forge.model import load_model
from forge.tools.calls import (
    CallFormat,
    ToolSettings,
    _parse_template_call,
    as_tools,
    calculator,
    call_format,
)

SYSTEM = ("You are a careful assistant with a calculator. To compute something, write {call}; the calculator "
          "answers with {result}. Then give the final answer as <answer>number</answer>.")
PROTOCOLS = {
    "text": {"call": "<calc>expression</calc>", "result": "<result>value</result>",
             "example": "<calc>312 * 27</calc><result>8424</result> The answer is <answer>8424</answer>"},
    "json": {"call": '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>',
             "result": "<tool_response>value</tool_response>",
             "example": '<tool_call>{"name": "calculator", "arguments": {"expression": "312 * 27"}}</tool_call>'
                        "<tool_response>8424</tool_response> The answer is <answer>8424</answer>"},
}
EXAMPLE_QUESTION = "What is 312 * 27?"


def problems(n: int, seed: int) -> list[tuple[str, int, str]]:
    rng, out = random.Random(seed), []
    kinds = ["product", "boxes", "two_step"]
    for i in range(n):
        kind = kinds[i % 3]
        a, b = rng.randint(100, 999), rng.randint(11, 99)
        if kind == "product":
            out.append((f"What is {a} * {b}?", a * b, kind))
        elif kind == "boxes":
            out.append((f"A box holds {b} pens. How many pens are in {a} boxes?", a * b, kind))
        else:
            c, d = rng.randint(100, 999), rng.randint(2, 9)
            question = (f"A shop sells {a} bags of {b} apples each and {c} single apples. It has {d} "
                        f"workers. How many apples does it sell in total?")
            out.append((question, a * b + c, kind))
    return out


def messages(protocol: str, question: str) -> list[dict]:
    spec = PROTOCOLS[protocol]
    return [{"role": "system", "content": SYSTEM.format(call=spec["call"], result=spec["result"])},
            {"role": "user", "content": EXAMPLE_QUESTION}, {"role": "assistant", "content": spec["example"]},
            {"role": "user", "content": question}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max_new_tokens", type=int, default=80)
    parser.add_argument("--out", default="bench/results/tool_protocol.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("default")
    model.eval()
    tools = as_tools([calculator])
    formats = {"text": call_format("text", tools),
               "json": CallFormat("json", ("</tool_call>",), _parse_template_call,
                                  lambda result: f"<tool_response>{result.output}</tool_response>")}
    rows, report = problems(args.n, args.seed), {"n": args.n, "seed": args.seed, "protocols": {}}
    for protocol, fmt in formats.items():
        started = time.perf_counter()
        settings = ToolSettings(tools, "text", max_calls=3, timeout=5.0)
        completions, calls = [], []
        for start in range(0, len(rows), 8):
            chunk = rows[start:start + 8]
            rollout = generate(model, tokenizer, [messages(protocol, q) for q, _, _ in chunk], 1,
                               SamplingSettings(args.max_new_tokens, do_sample=False), tools=settings,
                               call_format_=fmt)
            completions += rollout.completions
            calls += rollout.tool_calls
        counts = {"called": 0, "call_value_right": 0, "answer_right": 0}
        by_kind: dict[str, dict[str, int]] = {}
        for (question, answer, kind), text, made in zip(rows, completions, calls):
            ran = [c for c in made if c.failure is None]
            found = re.findall(r"<answer>\s*(-?[\d,]+)\s*</answer>", text)
            hits = {"called": bool(ran), "call_value_right": any(c.output == str(answer) for c in ran),
                    "answer_right": bool(found) and found[-1].replace(",", "") == str(answer)}
            for key, hit in hits.items():
                counts[key] += hit
                by_kind.setdefault(kind, dict.fromkeys(counts, 0))[key] += hit
        report["protocols"][protocol] = {**counts, "by_kind": by_kind, "seconds": time.perf_counter() - started,
                                         "examples": completions[:3]}
        print(protocol, counts, by_kind, f"{time.perf_counter() - started:.0f}s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
