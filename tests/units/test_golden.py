"""Golden runs: four optimizer steps of fixed configurations give bit-for-bit the recorded final weights.

Guards every refactor of the engine: LoRA with KL, full fine-tuning with KL, and a tool run (LoRA, every
completion opening with a calculator call), on the tiny offline model with a fixed seed. The final trainable
weights are hashed (sha256 of their bytes in name order) and compared with tests/fixtures/golden_runs.json.

Float results depend on the CPU's kernels and the library versions, so the recorded hashes are keyed by a
signature of both. On a machine kind without an entry the runs still run: each twice, which must give the
same weights to the bit (what a recorded hash stands on), and the hashes go to the log as a warning that holds
the JSON entry to add to the fixture; then the test is skipped, as there is nothing to compare with. To record
every run of this machine kind into the fixture at once:
    python tests/units/test_golden.py --record
The math of the step is held on every machine by tests/units/test_nano.py (the engine against forge/nano.py,
within fp32 rounding); this test holds the engine's exact bits where they were recorded.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from test_tools import install_script

from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model
from forge.tools.calls import calculator

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "golden_runs.json"
ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)}
        for a, b in [(2, 3), (4, 1), (7, 5), (6, 6), (3, 9), (8, 2), (1, 1), (5, 4)]]
CALL = "<calc>2+3</calc>"


def vowel_count(prompts, completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in text)) for text in completions]


def config(output_dir: Path, **overrides) -> GRPOConfig:
    values = {"group_size": 4, "prompts_per_step": 2, "gradient_accumulation_steps": 1, "max_new_tokens": 8,
              "learning_rate": 1e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1,
              "save_steps": 0, "max_steps": 4, "kl_beta": 0.05, "seed": 3, "dtype": "float32",
              "output_dir": str(output_dir)}
    return GRPOConfig(**(values | overrides))


RUNS = {
    "lora_kl": {"use_lora": True, "lora_r": 4, "lora_alpha": 8},
    "full_kl": {},
    "tools_lora": {"use_lora": True, "lora_r": 4, "lora_alpha": 8, "max_new_tokens": 20, "tool_format": "text"},
}


def scripted_calls(patch, tokenizer) -> None:
    """Every completion of a rollout opens with CALL (then the real sampler runs): the tool path is taken."""
    install_script(patch)(tokenizer, CALL)


def final_weights_sha256(name: str, output_dir: Path, patch) -> str:
    model, tokenizer = build_tiny_model(seed=0)
    tools = None
    if name.startswith("tools"):
        scripted_calls(patch, tokenizer)
        tools = [calculator]
    trainer = GRPOTrainer(model, tokenizer, vowel_count, config(output_dir, **RUNS[name]), tools=tools)
    trainer.train(ROWS)
    digest = hashlib.sha256()
    for key, param in sorted(trainer.model.named_parameters()):
        if param.requires_grad:
            digest.update(key.encode())
            digest.update(param.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def signature() -> str:
    """The CPU's kernel family and the library versions that decide the floats."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    amx = "amx" if "amx_bf16" in flags else "noamx"
    return (f"{torch.backends.cpu.get_cpu_capability()}-{amx}/torch-{torch.__version__}/"
            f"transformers-{transformers.__version__}")


def recorded() -> dict:
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


class UnrecordedMachineKind(UserWarning):
    """A golden run on a machine kind the fixture has no weights for: the warning holds this machine's."""


def run_weights_sha256(name: str, output_dir: Path) -> str:
    """final_weights_sha256 with its patches (the tool run's script) undone afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        return final_weights_sha256(name, output_dir, patch.setattr)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_golden_run_gives_the_recorded_weights(name, tmp_path):
    expected = recorded().get(signature(), {}).get(name)
    weights = run_weights_sha256(name, tmp_path / name)
    if expected is None:
        again = run_weights_sha256(name, tmp_path / f"{name}-again")
        assert again == weights, f"golden run {name}: the same run gave other weights the second time"
        entry = json.dumps({signature(): {name: weights}})
        warnings.warn(UnrecordedMachineKind(
            f"golden run {name}: no weights recorded for this machine kind; its weights, reproduced twice: "
            f"{entry} (add them to tests/fixtures/golden_runs.json, or run python tests/units/test_golden.py "
            f"--record)"))
        pytest.skip(f"no golden weights recorded for {signature()}; this machine's {name}: {weights}")
    assert weights == expected


def record() -> None:
    import tempfile

    torch.set_num_threads(1)
    patches = []

    def patch(owner, attribute, value):
        patches.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, value)

    hashes = {}
    for name in sorted(RUNS):
        with tempfile.TemporaryDirectory() as tmp:
            hashes[name] = final_weights_sha256(name, Path(tmp) / name, patch)
        for owner, attribute, value in reversed(patches):
            setattr(owner, attribute, value)
        patches.clear()
        print(name, hashes[name])
    table = recorded()
    table[signature()] = hashes
    FIXTURE.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    print(f"recorded under {signature()} in {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/units/test_golden.py --record")
    import os

    os.environ["FORGE_CPU_BF16"] = "0"
    record()
