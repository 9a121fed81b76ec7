"""Every script in bench/ imports: a module that moved or a name that changed breaks a benchmark at once, in
the suite, not the next time somebody runs it. Importing runs no benchmark (each runs under `__main__`)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_the_bench_script_imports(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their shared helpers (workloads.py) by name
    name = f"bench_{script[:-3]}"
    spec = importlib.util.spec_from_file_location(name, BENCH / script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as missing:
        if missing.name is not None and missing.name.split(".")[0] == "vllm":
            pytest.skip("needs vLLM (make test-vllm's venv)")
        raise
