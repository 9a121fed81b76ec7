"""The user's own modules that a command line names (`--reward module:function`, `--tools module:function`,
`--environment module:Class`): imported with the current folder searched first, and an import that fails said
in words a user can act on. The standard library only.

The installed `forge` program, unlike `python -m forge`, does not put the current folder on sys.path; a module
next to the user's data would not be found. `import_named_module` puts it there first, as uvicorn and gunicorn
do for their `module:app`.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def import_named_module(module_name: str) -> ModuleType:
    """`module_name` imported, the current folder searched before PYTHONPATH and the installed packages."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(module_name)


def import_problem(error: ImportError, module_name: str) -> str:
    """What went wrong importing `module_name`, and what to do: the module is not there, it imports a package
    that is not installed, or a name it imports is not where it looks."""
    if isinstance(error, ModuleNotFoundError) and error.name is not None and (
            module_name == error.name or module_name.startswith(error.name + ".")):
        return (f"there is no module {error.name!r} in this folder or on PYTHONPATH; give the file instead "
                f"(path/to/file.py:name), or add its folder to PYTHONPATH")
    if isinstance(error, ModuleNotFoundError):
        return f"its module imports {error.name!r}, which is not installed here; install it where forge runs"
    return f"importing its module failed ({error}); fix that import in it"


__all__ = ["import_named_module", "import_problem"]
