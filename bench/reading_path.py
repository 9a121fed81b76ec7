"""The reading path of one plain LoRA step: which Forge functions `GRPOTrainer.step` runs, in the order a
reader meets them, and how many lines that is (docs/architecture.md, "One step, in reading order").

    python bench/reading_path.py [--functions] [--max-lines 60] [--set share_prompt_prefix=False ...]

One step of GRPOConfig's defaults with use_lora=True (one update per rollout, the k3 KL, no tools), one
process, on the tiny offline model (forge/model/tiny.py) in fp32 (dtype='auto' picks bf16 on some machines,
which adds the mixed-precision helpers), 2 prompts x 4 completions, 8 new tokens, a plain reward function. A
profile hook (sys.setprofile, threading.setprofile) records every function of the `forge` package called while
`step` runs, in first-call order. Each counts once with its whole span, decorators and docstring included; a
function nested in a counted one (a closure, a comprehension) is not counted again and is left out of the
order (one whose enclosing function does not run, like the schedule's `factor`, counts on its own); an import
hook that Python's import system calls is not the step's code and is left out. Files are the distinct files
met; switches the changes of file from one function to the next in that order. Prints lines per file (in their
spans, and executed: the distinct lines a line tracer saw run), the totals and the functions over --max-lines.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import forge
from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer
from forge.run.optim import make_scheduler

PACKAGE = Path(forge.__file__).resolve().parent
RECIPE = "core/trainer.py"  # the file whose step is the recipe
ROWS = [{"prompt": "What is 2 + 3?", "reference": "5"}, {"prompt": "What is 4 + 1?", "reference": "5"}]


@dataclass(frozen=True)
class Function:
    file: str  # relative to the package: "core/trainer.py"
    name: str  # qualified: "GRPOTrainer.step"
    first: int  # first line of the span (the first decorator's)
    last: int  # last line of the span

    @property
    def lines(self) -> int:
        return self.last - self.first + 1


def spans(path: Path) -> dict[int, tuple[int, int, str]]:
    """Every function and lambda of a file: code.co_firstlineno (the def line, or the first decorator's) ->
    (first, last, qualified name). A lambda's entry is its line."""
    tree = ast.parse(path.read_text())
    found: dict[int, tuple[int, int, str]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found[first] = (first, child.end_lineno, prefix + child.name)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.Lambda):
                found.setdefault(child.lineno, (child.lineno, child.end_lineno, prefix + "<lambda>"))
                visit(child, prefix)
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def is_import_hook(frame) -> bool:
    """Called by Python's import system (on a module the step imports first), not by the step's code: not on
    the reading path."""
    caller = frame.f_back
    return caller is not None and caller.f_code.co_filename.startswith("<frozen importlib")


@dataclass
class Trace:
    """What running the step records: the package's code objects in first-call order, the lines that ran,
    and each first call from one file into another (an entry; a function's consecutive calls into one other
    file are one), as (caller's file, callee's file, callee)."""

    codes: list = field(default_factory=list)
    executed: set = field(default_factory=set)  # (file, line)
    entries: list = field(default_factory=list)  # (caller's file, callee's file, callee's name)
    inside_generate: set = field(default_factory=set)  # the code objects first called within `generate`


def record_step(trainer: GRPOTrainer, rows: list[dict]) -> Trace:
    """Trace trainer.step(rows): every call, line and return of the package's functions."""
    trace, seen, stack, package = Trace(), set(), [], str(PACKAGE)
    last_entered: dict[int, str] = {}  # id(frame) -> the file its last call went into

    def local(frame, event, arg):
        if event == "line":
            trace.executed.add((frame.f_code.co_filename, frame.f_lineno))
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()
        return local

    def hook(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(package) or is_import_hook(frame):
            return None
        file = code.co_filename
        if code not in seen:
            seen.add(code)
            trace.codes.append(code)
            caller = stack[-1] if stack else None
            # one function's calls into one other file, one after another, are one entry
            if caller is not None and caller[1] != file and last_entered.get(id(caller[0])) != file:
                trace.entries.append((caller[1], file, code.co_qualname))
        if stack:
            last_entered[id(stack[-1][0])] = file
            if any(name == "GRPOTrainer.sample_completions" for _, _, name in stack):
                trace.inside_generate.add(code)
        stack.append((frame, file, code.co_qualname))
        return local

    threading.settrace(hook)
    sys.settrace(hook)
    try:
        trainer.step(rows)
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return trace


def reading_path(codes: list) -> list[Function]:
    """The counted functions in first-call order: module and class bodies dropped, nested functions folded
    into the function that holds them."""
    path: list[Function] = []
    tables: dict[str, dict] = {}
    for code in codes:
        if code.co_name.startswith("<") and code.co_name != "<lambda>":
            continue  # a comprehension (inside a function, so counted with it) or a module body
        filename = code.co_filename
        table = tables.setdefault(filename, spans(Path(filename)))
        if code.co_firstlineno not in table:
            continue  # a class body
        first, last, name = table[code.co_firstlineno]
        file = str(Path(filename).resolve().relative_to(PACKAGE))
        if any(f.file == file and f.first <= first and last <= f.last for f in path):
            continue  # nested in a function already counted
        path.append(Function(file, name, first, last))
    return path


def exact_answer(prompts: list, completions: list[str], references: list[str], **kwargs) -> list[float]:
    return [float(completion.strip() == reference) for completion, reference in zip(completions, references)]


def plain_lora_trainer(output_dir: str, **changes) -> GRPOTrainer:
    """GRPOConfig's defaults with use_lora=True on the tiny model, sized to one small step, ready to step;
    `changes`: other GRPOConfig values (--set), to count what a setting adds to the path or takes from it."""
    model, tokenizer = build_tiny_model(build_tiny_tokenizer(), seed=0)
    config = GRPOConfig(**{"use_lora": True, "group_size": 4, "prompts_per_step": 2,
                           "gradient_accumulation_steps": 1, "max_new_tokens": 8, "dtype": "float32",
                           "output_dir": output_dir, **changes})
    trainer = GRPOTrainer(model, tokenizer, exact_answer, config)
    # the schedule train() would build, for one step
    trainer.scheduler = make_scheduler(trainer.optimizer, config.lr_scheduler, config.warmup_ratio, 1)
    return trainer


def walk(path: list[Function]) -> list[str]:
    """The files in the order met, a file named again only after another one."""
    files = [f.file for f in path]
    return [file for i, file in enumerate(files) if i == 0 or files[i - 1] != file]


def returns(trace: Trace) -> list[tuple[str, str, str]]:
    """The entries into a file already entered, made from a file other than the trainer's: the trainer's
    step calls each phase in turn (the recipe), so coming back to it, or going from it to a file it called
    before, is the recipe read in order; a phase that sends the reader into a file met earlier is not."""
    entered: set[str] = set()
    found = []
    for caller, callee, name in trace.entries:
        if callee in entered and not caller.endswith(RECIPE):
            found.append((caller, callee, name))
        entered.add(callee)
    return found


def relative(filename: str) -> str:
    return str(Path(filename).resolve().relative_to(PACKAGE))


def report(trace: Trace, max_lines: int, functions: bool) -> str:
    path = reading_path(trace.codes)
    per_file: dict[str, int] = {}
    for f in path:
        per_file[f.file] = per_file.get(f.file, 0) + f.lines
    switches = sum(a.file != b.file for a, b in itertools.pairwise(path))
    executed: dict[str, int] = {}
    for filename, _ in trace.executed:
        executed[relative(filename)] = executed.get(relative(filename), 0) + 1
    lines = [f"{'file':<32} {'lines':>6} {'executed':>9}"]
    lines += [f"{file:<32} {count:>6} {executed.get(file, 0):>9}"  # in the order first met
              for file, count in per_file.items()]
    lines.append(f"{len(per_file)} files, {len(path)} functions, {switches} switches: "
                 f"{sum(per_file.values())} lines in their spans, {len(trace.executed)} executed")
    lines.append(f"{len(trace.entries)} entries into another file; returns to a file already left:")
    lines += [f"  {relative(caller)} -> {relative(callee)} ({name})"
              for caller, callee, name in returns(trace)]
    longest = max(path, key=lambda f: f.lines)
    lines.append(f"longest: {longest.file} {longest.name} ({longest.lines} lines)")
    over = [f for f in path if f.lines > max_lines]
    lines.append(f"over {max_lines} lines: " + (", ".join(f"{f.file} {f.name} ({f.lines})" for f in over)
                                                or "none"))
    generate = reading_path([code for code in trace.codes if code in trace.inside_generate])
    lines.append("walk of the step: " + " -> ".join(walk(path)))
    lines.append("walk of generate: " + " -> ".join(walk(generate)))
    if functions:
        lines.append("")
        lines += [f"{f.file}:{f.first}-{f.last} {f.name} ({f.lines})" for f in path]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", action="store_true", help="list every function in reading order")
    parser.add_argument("--max-lines", type=int, default=60)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="another GRPOConfig value (a Python literal), e.g. share_prompt_prefix=False")
    args = parser.parse_args()
    pairs = (item.partition("=") for item in args.set)
    changes = {field: ast.literal_eval(value) for field, _, value in pairs}
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as output_dir:
        trace = record_step(plain_lora_trainer(output_dir, **changes), ROWS)
    print(report(trace, args.max_lines, args.functions))


if __name__ == "__main__":
    main()
