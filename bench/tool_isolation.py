"""The cost of isolation: sandbox start time (namespaces, the rlimits fallback, and the rlimits-only sandbox of
commit 168f1b5), calculator call latency with tool_isolation 'thread' vs 'process', and how much a timed-out
spinning tool slows the trainer afterwards in each mode.

    python bench/tool_isolation.py          # writes bench/results/tool_isolation.json
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from forge.model import cpu_name
from forge.model.tiny import build_tiny_model
from forge.tools.calls import ToolCall, ToolSettings, as_tools, calculator, run_calls
from forge.tools.sandbox import namespace_problem, run_python
from forge.tools.worker import ToolWorkers

ROOT = Path(__file__).resolve().parents[1]
OLD_SANDBOX_COMMIT = "168f1b5"


def spin(text: str) -> str:
    """Spins forever.

    Args:
        text: ignored
    """
    while True:
        pass


def median_ms(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 3)


def old_sandbox():
    source = subprocess.run(["git", "show", f"{OLD_SANDBOX_COMMIT}:forge/tools/sandbox.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_sandbox.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_sandbox"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def sandbox_start(repeats: int = 20) -> dict:
    old = old_sandbox()
    return {"rlimits only (168f1b5)": median_ms(lambda: old.run_python("pass"), repeats),
            "namespaces": median_ms(lambda: run_python("pass", namespaces=True), repeats)
            if namespace_problem() is None else None,
            "rlimits fallback": median_ms(lambda: run_python("pass", namespaces=False), repeats)}


def call_latency(repeats: int = 200) -> dict:
    out = {}
    for isolation in ("thread", "process"):
        settings = ToolSettings(as_tools([calculator]), isolation=isolation)
        for width in (1, 8):
            calls = [ToolCall("", "calculator", {"expression": "745 * 48"}) for _ in range(width)]
            run_calls(calls, settings)  # starts the workers
            out[f"{isolation}, {width} call(s) per round"] = median_ms(lambda c=calls, s=settings: run_calls(c, s), repeats)
        if settings.workers is not None:
            settings.workers.close()
    return out


def worker_start(repeats: int = 5) -> float:
    """Milliseconds to start one tool worker process that loads the calculator and answers it is ready."""
    def start():
        workers = ToolWorkers({"calculator": calculator}, 1024)
        workers.check()
        workers.close()
    return median_ms(start, repeats)


def trainer_work() -> dict:
    """Milliseconds of two kinds of trainer work: tiny-model forwards (torch, releases the GIL) and a pure-Python
    loop (the decode loop's bookkeeping holds the GIL)."""
    torch.manual_seed(0)
    model, _ = build_tiny_model()
    ids = torch.randint(0, 300, (8, 32))

    def forwards():
        with torch.no_grad():
            for _ in range(20):
                model(input_ids=ids)

    def python_loop():
        total = 0
        for i in range(300_000):
            total += i % 7
        return total

    return {"tiny-model forwards": median_ms(forwards, 5), "python loop": median_ms(python_loop, 5)}


def after_spinning_tool(isolation: str) -> dict:
    settings = ToolSettings(as_tools([spin]), isolation=isolation, timeout=0.2)
    (result,) = run_calls([ToolCall("", "spin", {"text": ""})], settings)
    assert result.failure == "timeout"
    return trainer_work()


def _cpu_name() -> str:
    return f"{cpu_name()} x {torch.get_num_threads()} thread(s) used"


def main() -> None:
    torch.set_num_threads(1)
    report = {"cpu": _cpu_name(), "python": sys.version.split()[0],
              "sandbox_start_ms": sandbox_start(), "calculator_round_ms": call_latency(),
              "tool_worker_start_ms": worker_start(),
              "trainer_work_ms": {"no tool": trainer_work(), "after a spinning tool timed out, process":
                                  after_spinning_tool("process"),
                                  # last: the abandoned thread spins until this process ends
                                  "after a spinning tool timed out, thread": after_spinning_tool("thread")}}
    print(json.dumps(report, indent=2))
    out = ROOT / "bench" / "results" / "tool_isolation.json"
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
