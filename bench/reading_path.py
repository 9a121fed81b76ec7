"""The reading path of one plain LoRA step: which Forge functions `GRPOTrainer.step` runs, in the order a
reader meets them, and how many lines that is (docs/architecture.md, "One step, in reading order").

    python bench/reading_path.py [--functions] [--max-lines 60]

One step of GRPOConfig's defaults with use_lora=True (one update per rollout, the k3 KL, no tools), one
process, on the tiny offline model (forge/model/tiny.py) in fp32 (dtype='auto' picks bf16 on some machines,
which adds the mixed-precision helpers), 2 prompts x 4 completions, 8 new tokens, a plain reward function. A
profile hook (sys.setprofile, threading.setprofile) records every function of the `forge` package called while
`step` runs, in first-call order. Each counts once with its whole span, decorators and docstring included; a
function nested in a counted one (a closure, a comprehension) is not counted again and is left out of the
order (one whose enclosing function does not run, like the schedule's `factor`, counts on its own); an import
hook that Python's import system calls is not the step's code and is left out. Files are the distinct files
met; switches the changes of file from one function to the next in that order. Prints lines per file, the
totals and the functions over --max-lines.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import forge
from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer
from forge.run.optim import make_scheduler

PACKAGE = Path(forge.__file__).resolve().parent
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
    """Called by Python's import system (forge/_moved.py's finder, on a module the step imports first), not
    by the step's code: not on the reading path."""
    caller = frame.f_back
    return caller is not None and caller.f_code.co_filename.startswith("<frozen importlib")


def record_step(trainer: GRPOTrainer, rows: list[dict]) -> list:
    """The code objects of the package that run during trainer.step(rows), in first-call order."""
    seen: dict = {}
    package = str(PACKAGE)

    def hook(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code not in seen and code.co_filename.startswith(package) and not is_import_hook(frame):
                seen[code] = None

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        trainer.step(rows)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return list(seen)


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


def plain_lora_trainer(output_dir: str) -> GRPOTrainer:
    """GRPOConfig's defaults with use_lora=True on the tiny model, sized to one small step, ready to step."""
    model, tokenizer = build_tiny_model(build_tiny_tokenizer(), seed=0)
    config = GRPOConfig(use_lora=True, group_size=4, prompts_per_step=2, gradient_accumulation_steps=1,
                        max_new_tokens=8, dtype="float32", output_dir=output_dir)
    trainer = GRPOTrainer(model, tokenizer, exact_answer, config)
    # the schedule train() would build, for one step
    trainer.scheduler = make_scheduler(trainer.optimizer, config.lr_scheduler, config.warmup_ratio, 1)
    return trainer


def report(path: list[Function], max_lines: int, functions: bool) -> str:
    per_file: dict[str, int] = {}
    for f in path:
        per_file[f.file] = per_file.get(f.file, 0) + f.lines
    switches = sum(a.file != b.file for a, b in itertools.pairwise(path))
    lines = [f"{'file':<32} {'lines':>6}"]
    lines += [f"{file:<32} {count:>6}" for file, count in per_file.items()]  # in the order first met
    lines.append(f"{len(per_file)} files, {len(path)} functions, {switches} switches: "
                 f"{sum(per_file.values())} lines")
    longest = max(path, key=lambda f: f.lines)
    lines.append(f"longest: {longest.file} {longest.name} ({longest.lines} lines)")
    over = [f for f in path if f.lines > max_lines]
    lines.append(f"over {max_lines} lines: " + (", ".join(f"{f.file} {f.name} ({f.lines})" for f in over)
                                                or "none"))
    if functions:
        lines.append("")
        lines += [f"{f.file}:{f.first}-{f.last} {f.name} ({f.lines})" for f in path]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", action="store_true", help="list every function in reading order")
    parser.add_argument("--max-lines", type=int, default=60)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = plain_lora_trainer(output_dir)
        path = reading_path(record_step(trainer, ROWS))
    print(report(path, args.max_lines, args.functions))


if __name__ == "__main__":
    main()
