"""`forge demo` end to end on the tiny offline model: every file it promises, settings taken from flags.

The real demo (SmolLM2-135M, 60 steps) takes ~10 minutes and is measured by hand (README); here the same
code path runs in seconds with a random 2-layer model, so only the plumbing is checked, not learning.
"""

import json

import pytest

from forge.cli import main
from forge.core.tiny import build_tiny_model
from forge.demo import DemoSettings


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo") / "tiny"
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_demo_writes_the_report_curves_logs_and_adapter(tiny_folder, tmp_path, capsys):
    out = tmp_path / "demo_out"
    main(["demo", "--model", str(tiny_folder), "--steps", "2", "--prompts_per_step", "2", "--group_size", "2",
          "--heldout", "6", "--max_new_tokens", "6", "--threads", "1", "--seed", "3", "--output_dir", str(out)])
    printed = capsys.readouterr().out
    for name in ("comparison.md", "comparison.json", "training_curves.png", "training_log.jsonl",
                 "samples.jsonl", "demo_result.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
        assert name in printed, f"the demo does not say where {name} is"
    assert (out / "final" / "adapter_config.json").is_file()  # the LoRA adapter of the trained policy
    result = json.loads((out / "demo_result.json").read_text())
    assert result["settings"]["steps"] == 2 and result["settings"]["seed"] == 3
    for phase in ("before", "after"):
        assert 0.0 <= result[phase]["strict_accuracy"] <= 1.0 and result[phase]["n"] == 6
    assert len((out / "training_log.jsonl").read_text().splitlines()) == 2
    assert "strict accuracy" in printed and "base" in printed and "trained" in printed


def test_demo_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for name in DemoSettings.__dataclass_fields__:
        assert f"--{name}" in out, f"--{name} missing from `forge demo --help`"
