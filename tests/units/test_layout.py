"""The layout docs/architecture.md describes, held against the code: the floors and which imports they allow,
no import cycle, the spine's size limits, pure math that imports only torch, ruff's rules with lines of at
most 110 columns, functions of at most 60 lines, and the package face's public names."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "forge"

# A room may import from rooms on a lower floor (and from its own); docs/architecture.md draws the same
# floors.
FLOORS = {
    "safe_json": -1, "user_code": -1,
    "logging": 0, "data": 0, "tools": 0, "parallel": 0,
    "model": 1, "envs": 1,
    "run": 2,
    "core": 3,
    "eval": 4, "demo_async": 4,
    "demo": 5,
    "cli_config": 6, "demo_env": 6, "demo_tools": 6,
    "cli_parser": 7,
    "cli": 8,
    "__main__": 9, "__init__": 9,
}
# Forge's own modules imported inside a function, where that is the point: the command line imports a
# command's modules when it runs (`forge --help` does not load transformers), the package face imports a
# public name on first use (`import forge` stays light), and GRPOConfig, which the command line reads for its
# flags, checks a peft LoraConfig only when GRPOTrainer is given one (forge.model loads transformers).
LAZY_BY_DESIGN = {"cli.py", "__init__.py", "config.py"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def forge_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported forge module, imported at the top level?) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "forge" \
                and node.level == 0:
            # `from forge.run import checkpoint` imports the module forge.run.checkpoint
            targets = [f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}") else node.module
                       for a in node.names]
            found += [(t, id(node) in top) for t in targets]
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names if a.name.split(".")[0] == "forge"]
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_no_module_imports_from_a_floor_above_its_own():
    upward = []
    for path in SOURCES:
        own = room(module_name(path))
        for target, _ in forge_imports(path):
            if room(target) != own and FLOORS[room(target)] >= FLOORS[own] and own != "__init__":
                upward.append(f"{module_name(path)} -> {target}")
    assert upward == []


def test_no_import_cycle_between_files():
    modules = {module_name(p): p for p in SOURCES}
    graph = {}
    for name, path in modules.items():
        graph[name] = set()
        for target, _ in forge_imports(path):
            # `from forge.run import checkpoint` names a module
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name and target != "forge":  # every module's package face runs first: not an arrow
                graph[name].add(target)
    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_forge_modules_are_imported_at_the_top_of_a_file():
    inside = [f"{path.relative_to(PACKAGE)}: {target}" for path in SOURCES if path.name not in LAZY_BY_DESIGN
              for target, at_top in forge_imports(path) if not at_top]
    assert inside == []


def test_the_pure_math_imports_only_torch():
    allowed = {"__future__", "math", "collections.abc", "dataclasses", "typing", "torch",
               "forge.core.loss_variants"}
    for name in ("grpo.py", "loss_variants.py"):
        tree = ast.parse((PACKAGE / "core" / name).read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        assert imported <= allowed, f"core/{name} imports {sorted(imported - allowed)}"
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and "Config" in n.name]


def test_no_file_is_over_600_lines_and_the_trainer_fits_300():
    long = {str(p.relative_to(PACKAGE)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
    assert len((PACKAGE / "core" / "trainer.py").read_text().splitlines()) <= 300


def test_ruff_finds_nothing_in_the_package_and_no_line_is_over_110_columns():
    """`ruff check forge` with the project's rules (pyproject.toml: ruff's defaults and E501 at
    line-length 110), so a line too long fails the default suite as `make test` runs it."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "--no-cache",
                           str(PACKAGE)], cwd=PACKAGE.parent, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"ruff check forge:\n{done.stdout}{done.stderr}"


def test_no_function_is_over_60_lines():
    """Every function and method in forge/, counted from its first decorator to its last line (docstring
    included), fits in 60 lines."""
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if (lines := node.end_lineno - first + 1) > 60:
                    long.append(f"{path.relative_to(PACKAGE)}:{first} {node.name} ({lines} lines)")
    assert long == []


def test_every_public_name_of_the_package_face_imports():
    """`forge.X` for each name in forge.__all__ is the object at its home module (the face imports each on
    first use, so a wrong home shows only here)."""
    import forge

    for name in forge.__all__:
        value = getattr(forge, name)
        assert getattr(importlib.import_module(value.__module__), value.__name__) is value, name


def test_the_original_api_imports_from_where_it_always_did():
    from forge import GRPOConfig, GRPOTrainer
    from forge.core.grpo import compute_group_advantages, grpo_loss
    from forge.core.reward import BaseReward, ExactMatchReward, RewardOutput
    from forge.data.gsm8k import load_gsm8k

    assert GRPOTrainer.__module__ == "forge.core.trainer" and GRPOConfig.__module__ == "forge.core.config"
    assert all(callable(x) for x in (compute_group_advantages, grpo_loss, load_gsm8k, ExactMatchReward))
    assert issubclass(ExactMatchReward, BaseReward) and RewardOutput([1.0]).scores == [1.0]
