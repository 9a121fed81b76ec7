"""End to end on the real packaged SmolLM2-135M-Instruct (slow: `pytest -m slow`, or `make test-slow`).

The packaged GGUF converts to a HuggingFace folder once and generates text, and the README's Python quickstart
runs as written (with fewer steps) from a fresh working directory.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge.model import load_model, packaged_model_path

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_packaged_default_generates_text(tmp_path):
    folder = packaged_model_path(tmp_path / "smollm2")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert packaged_model_path(tmp_path / "smollm2") == folder  # second call reuses the folder
    model, tokenizer = load_model(folder, device="cpu")
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output_ids = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    completion = tokenizer.decode(output_ids[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    assert completion.strip(), "greedy generation produced no text"


@pytest.mark.slow
def test_the_readme_quickstart_runs_as_written(tmp_path):
    """The README's first code block is its Python quickstart: it runs as written from a fresh directory, saves
    its adapter, and its reward rises over its 8 steps as the README says."""
    readme = README.read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", readme, re.DOTALL).group(1)
    assert readme.index("```python") == readme.index("```") and len(block.splitlines()) <= 15
    script = tmp_path / "quickstart.py"
    script.write_text(block, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=1800, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "quickstart" / "final" / "adapter_model.safetensors").is_file()
    log = [json.loads(line) for line in (tmp_path / "quickstart" / "training_log.jsonl").read_text().splitlines()]
    rewards = [row["reward"] for row in log]
    assert len(rewards) == 8 and sum(rewards[-2:]) / 2 > rewards[0] + 1.0, rewards
