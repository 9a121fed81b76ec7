"""Old import paths of modules that moved, kept working: `import forge.core.policy` gives forge.model.

One table, read by a meta-path finder that `forge/__init__.py` installs: importing an old path imports the
new module and registers it under the old name too, so both names are the same module object (a monkeypatch
through either reaches the code). docs/architecture.md lists where everything lives now.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED_MODULES = {
    "forge.checkpoint": "forge.run.checkpoint",
    "forge.core.distributed": "forge.parallel.distributed",
    "forge.core.lifecycle": "forge.run.lifecycle",
    "forge.core.metrics": "forge.run.metrics",
    "forge.core.optim": "forge.run.optim",
    "forge.core.policy": "forge.model",
    "forge.core.sharding": "forge.parallel.sharding",
    "forge.core.tiny": "forge.model.tiny",
    "forge.core.tool_rollout": "forge.core.rollout",
    "forge.core.tools": "forge.tools.calls",
    "forge.sandbox": "forge.tools.sandbox",
    "forge.tool_demo": "forge.demo",
}


class _Loader(importlib.abc.Loader):
    def __init__(self, new_name: str):
        self.new_name = new_name

    def create_module(self, spec):
        module = importlib.import_module(self.new_name)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.own_spec  # it ran when imported; the import system stamped the old name's spec on it


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of MOVED_MODULES and hands out the module at the new path."""

    def find_spec(self, fullname, path=None, target=None):
        new_name = MOVED_MODULES.get(fullname)
        if new_name is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(new_name))


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
