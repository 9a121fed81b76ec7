"""Old import paths of modules and names that moved, kept working: `import forge.core.policy` gives
forge.model, `from forge.core.grpo import GRPOConfig` gives forge.core.config's.

Two tables, read by a meta-path finder that `forge/__init__.py` installs. Importing an old module path imports
the new module and registers it under the old name too, so both names are the same module object (a
monkeypatch through either reaches the code). A module that stays but lost a name (MOVED_NAMES) looks the name
up where it lives now on first use, so the module itself keeps no import of its new home (core/grpo.py imports
only torch; core/config.py imports it). docs/architecture.md lists where everything lives now.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

MOVED_MODULES = {
    "forge.checkpoint": "forge.run.checkpoint",
    "forge.core.distributed": "forge.parallel.distributed",
    "forge.core.lifecycle": "forge.run.lifecycle",
    "forge.core.metrics": "forge.run.step_stats",
    "forge.core.optim": "forge.run.optim",
    "forge.core.policy": "forge.model",
    "forge.core.sharding": "forge.parallel.sharding",
    "forge.core.tiny": "forge.model.tiny",
    "forge.core.tool_rollout": "forge.core.rollout",
    "forge.core.tools": "forge.tools.calls",
    "forge.sandbox": "forge.tools.sandbox",
    "forge.tool_demo": "forge.demo_tools",
}


MOVED_NAMES = {
    "forge.core.grpo": {"GRPOConfig": "forge.core.config",
                        "compute_token_log_probs": "forge.core.original_api",
                        "sequence_mean_log_probs": "forge.core.original_api"},
    "forge.core.reward": dict.fromkeys(("REWARD_REGISTRY", "CompositeReward", "SequenceClassificationReward",
                                        "as_reward", "build_reward", "is_model_and_tokenizer",
                                        "load_reward_from_path"), "forge.core.reward_sources")
    | {"wants_trainer_state": "forge.core.original_api"},
    "forge.core.rollout": {"Batch": "forge.core.batch"},
    "forge.model": {"enable_checkpointing": "forge.model.lora"},
}
"""Names that left a module that stayed: old module -> {name: the module it lives in now}. Helpers of the
earlier API that the engine no longer calls live in forge/core/original_api.py."""


class _Loader(importlib.abc.Loader):
    def __init__(self, new_name: str):
        self.new_name = new_name

    def create_module(self, spec):
        module = importlib.import_module(self.new_name)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # it ran when imported; the import system stamped the old name's spec on it
        module.__spec__ = self.own_spec


class _WithMovedNames(importlib.abc.Loader):
    """Runs a module as its own loader does, then gives it a module `__getattr__` for the names that left
    it."""

    def __init__(self, loader, moved: dict[str, str]):
        self.loader, self.moved = loader, moved

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        moved, name = self.moved, module.__name__

        def __getattr__(attribute: str):
            if attribute not in moved:
                raise AttributeError(f"module {name!r} has no attribute {attribute!r}")
            return getattr(importlib.import_module(moved[attribute]), attribute)

        module.__getattr__ = __getattr__


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of MOVED_MODULES (the module at the new path) and the modules of MOVED_NAMES."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, _Loader(MOVED_MODULES[fullname]))
        if fullname in MOVED_NAMES:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None:
                spec.loader = _WithMovedNames(spec.loader, MOVED_NAMES[fullname])
            return spec
        return None


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
