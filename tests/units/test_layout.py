"""The layout docs/architecture.md describes, held against the code: the floors and which imports they allow,
no import cycle, the spine's size limits, pure math that imports only torch, and the old import paths of moved
modules and names still working."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "forge"

# A room may import from rooms on a lower floor (and from its own); docs/architecture.md draws the same
# floors.
FLOORS = {
    "safe_json": -1,
    "logging": 0, "data": 0, "tools": 0, "parallel": 0, "_moved": 0,
    "model": 1, "envs": 1,
    "run": 2,
    "core": 3,
    "eval": 4,
    "demo": 5,
    "cli_config": 6, "demo_env": 6, "demo_tools": 6,
    "cli": 7,
    "__main__": 8, "__init__": 8,
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
            while target not in modules and "." in target:  # `from forge.run import checkpoint` names a module
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
    allowed = {"__future__", "math", "collections.abc", "dataclasses", "typing", "torch", "forge.core.advantages"}
    for name in ("grpo.py", "advantages.py"):
        tree = ast.parse((PACKAGE / "core" / name).read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        assert imported <= allowed, f"core/{name} imports {sorted(imported - allowed)}"
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and "Config" in n.name]


def test_no_file_is_over_600_lines_and_the_trainer_fits_300():
    long = {str(p.relative_to(PACKAGE)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
    assert len((PACKAGE / "core" / "trainer.py").read_text().splitlines()) <= 300


@pytest.mark.parametrize("old", sorted(importlib.import_module("forge._moved").MOVED_MODULES))
def test_an_old_module_path_is_the_moved_module(old):
    moved = importlib.import_module("forge._moved").MOVED_MODULES
    assert importlib.import_module(old) is importlib.import_module(moved[old])


def test_old_paths_of_moved_names_and_the_original_api_keep_working():
    from forge import GRPOConfig, GRPOTrainer
    from forge._moved import MOVED_NAMES
    from forge.core.grpo import compute_group_advantages, grpo_loss
    from forge.core.reward import BaseReward, ExactMatchReward, RewardOutput
    from forge.data.gsm8k import load_gsm8k

    assert GRPOTrainer.__module__ == "forge.core.trainer" and GRPOConfig.__module__ == "forge.core.config"
    assert all(callable(x) for x in (compute_group_advantages, grpo_loss, load_gsm8k, ExactMatchReward))
    assert issubclass(ExactMatchReward, BaseReward) and RewardOutput([1.0]).scores == [1.0]
    for old, names in MOVED_NAMES.items():
        for name, new in names.items():
            assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        _ = importlib.import_module("forge.core.grpo").nothing_here


def test_helpers_of_the_earlier_api_still_import_and_compute():
    """Public names the earlier API exported (its __all__, docs/algorithm.md's helpers) that the engine
    dropped: forge/_moved.py finds them in forge/core/original_api.py and forge/model/lora.py."""
    import torch

    from forge.core.grpo import compute_token_log_probs, sequence_mean_log_probs
    from forge.core.reward import FunctionReward, wants_trainer_state
    from forge.model import enable_checkpointing

    assert callable(enable_checkpointing)
    token_logprobs = torch.tensor([[-1.0, -2.0, -3.0]])  # (B, T)
    assert sequence_mean_log_probs(token_logprobs, torch.tensor([[1, 1, 0]])).tolist() == [-1.5]
    logits = torch.zeros(1, 3, 4)  # (B, L, V): uniform, so every token's log-prob is -log 4
    masked = compute_token_log_probs(logits, torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, 0]]))  # (B, L-1)
    assert torch.allclose(masked, torch.tensor([[-torch.log(torch.tensor(4.0)).item(), 0.0]]))
    assert wants_trainer_state(FunctionReward(lambda prompts, completions, trainer_state: []))
    assert not wants_trainer_state(FunctionReward(lambda prompts, completions, **kwargs: []))
