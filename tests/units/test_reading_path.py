"""The reading path of one plain LoRA step (bench/reading_path.py, docs/architecture.md): no function a reader
follows through `GRPOTrainer.step` is over 60 lines."""

import importlib.util
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "reading_path.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("reading_path", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["reading_path"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_no_function_on_the_step_path_is_over_60_lines():
    bench = load_bench()
    with tempfile.TemporaryDirectory() as output_dir:
        path = bench.reading_path(bench.record_step(bench.plain_lora_trainer(output_dir), bench.ROWS).codes)
    names = {f.name for f in path}
    assert {"GRPOTrainer.step", "grpo_loss", "decode", "score_batch"} <= names  # the hook saw the step
    over = [f"{f.file} {f.name} ({f.lines} lines)" for f in path if f.lines > 60]
    assert not over, f"functions on the step's reading path over 60 lines: {over}"
