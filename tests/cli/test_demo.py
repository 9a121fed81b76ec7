"""`forge demo` end to end on the tiny offline model: every file it promises, settings taken from flags.

The real demo (SmolLM2-135M, 60 steps, 240 held-out problems) takes ~10-12 minutes and is measured by hand
(README, bench/results/demo/); here the same code path runs in seconds with a random 2-layer model, so only the
plumbing is checked, not learning.
"""

import json

import pytest

from forge.cli import main
from forge.demo import DemoSettings


def test_demo_writes_the_report_curves_logs_and_adapter(model_folder, tmp_path, capsys):
    out = tmp_path / "demo_out"
    main(["demo", "--model", str(model_folder), "--steps", "2", "--prompts_per_step", "2", "--group_size", "2",
          "--heldout", "6", "--max_new_tokens", "6", "--threads", "1", "--seed", "3", "--output_dir", str(out),
          "--eval_every", "1", "--eval_subset", "3", "--eval_batch_size", "3"])
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
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log if "reward" in row] == [1, 2]
    # the held-out curve during training: the first 3 problems at steps 0 (the base eval's share), 1 and 2
    assert sorted({row["step"] for row in log if "eval_strict_accuracy" in row}) == [0, 1, 2]
    assert result["heldout_size"] == 6 and result["eval_curve_size"] == 3
    assert [point["step"] for point in result["eval_curve"]] == [0, 1, 2]
    assert all(point["n"] == 3 for point in result["eval_curve"])
    assert {"load", "base_eval", "training", "curve_evals", "final_eval", "total"} <= set(result["timings"])
    assert result["gain"] == result["after"]["strict_accuracy"] - result["before"]["strict_accuracy"]
    assert "strict accuracy" in printed and "base" in printed and "trained" in printed


def test_demo_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for name in DemoSettings.__dataclass_fields__:
        assert f"--{name}" in out, f"--{name} missing from `forge demo --help`"


def test_the_tool_demo_has_its_own_help_with_its_own_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    plain = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["demo", "--tools", "--help"])
    tools = " ".join(capsys.readouterr().out.split())
    assert tools.startswith("usage: forge demo --tools") and "with a calculator tool" in tools
    assert "with a calculator tool" not in plain and "better at arithmetic, offline, on a CPU" in plain
    assert "Optimizer steps (--tools: 20; --distill: the student's 24). (default: 20)" in tools
    assert "Optimizer steps (--tools: 20; --distill: the student's 24). (default: 60)" in plain
    assert "(4 x 8 completions; --tools: 2; --distill: the student's 8 x 1). (default: 2)" in tools
    assert "Tokens per completion, in training and evaluation. (default: 64)" in tools
    with pytest.raises(SystemExit):
        main(["demo", "--distill", "--help"])
    distill = " ".join(capsys.readouterr().out.split())
    assert "the student's 24). (default: 24)" in distill and "the student's 8 x 1). (default: 8)" in distill


def test_demo_ceiling_measures_pass_at_k_and_does_not_train(model_folder, tmp_path, capsys):
    out = tmp_path / "ceiling"
    main(["demo", "--model", str(model_folder), "--ceiling", "--heldout", "4", "--group_size", "2",
          "--max_new_tokens", "6", "--threads", "1", "--output_dir", str(out)])
    ceiling = json.loads((out / "ceiling.json").read_text())
    assert ceiling["heldout_size"] == 4 and ceiling["metrics"]["num_samples"] == 2
    assert 0.0 <= ceiling["metrics"]["pass@1"] <= ceiling["metrics"]["pass@2"] <= 1.0
    assert ceiling["decoding"]["temperature"] == 0.7
    assert not (out / "training_log.jsonl").exists()
    assert "pass@2" in capsys.readouterr().out


def test_tool_demo_uses_its_measured_recipe_unless_told_otherwise():
    import argparse

    from forge.demo import add_demo_arguments

    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    settings = lambda *argv: DemoSettings.from_args(parser.parse_args(list(argv)))
    assert (settings("--tools").steps, settings("--tools").prompts_per_step) == (20, 2)
    assert (settings().steps, settings().prompts_per_step) == (60, 4)  # the plain demo keeps its recipe
    assert settings("--tools", "--steps", "7").steps == 7
    assert settings("--tools", "--quick").steps == 3


def test_demo_evaluates_before_and_after_in_the_training_precision(model_folder, tmp_path, monkeypatch):
    import torch

    import forge.demo

    seen, real = [], forge.demo.evaluate  # forge.eval.evaluate's evaluate, as the demo imported it

    def recording(*args, **kwargs):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32)
        return real(*args, **kwargs)

    monkeypatch.setattr(forge.demo, "evaluate", recording)
    asked = _count_precision_choices(monkeypatch)
    out = tmp_path / "bf16"
    main(["demo", "--model", str(model_folder), "--steps", "1", "--prompts_per_step", "2", "--group_size", "2",
          "--heldout", "4", "--max_new_tokens", "4", "--threads", "1", "--output_dir", str(out), "--eval_every", "0",
          "--eval_batch_size", "4", "--dtype", "bfloat16"])
    # the base model's evaluation too, not only the trained one's: before and after differ by training alone
    assert len(seen) == 2 and seen == [torch.bfloat16] * 2, seen
    assert asked == ["bfloat16"]  # the demo decides its precision in one call (the trainer asks the same question)
    assert json.loads((out / "demo_result.json").read_text())["machine"]["precision"] == "bfloat16"


def _count_precision_choices(monkeypatch) -> list:
    """The dtypes the demo asks forge.model.choose_precision about (the trainer's own call is not counted)."""
    import forge.demo

    asked, real = [], forge.demo.choose_precision

    def counting(dtype, *args, **kwargs):
        asked.append(dtype)
        return real(dtype, *args, **kwargs)

    monkeypatch.setattr(forge.demo, "choose_precision", counting)
    return asked


def test_tool_demo_evaluates_without_and_with_the_tool_in_the_training_precision(model_folder, tmp_path, monkeypatch,
                                                                                 capsys):
    import torch

    import forge.demo_tools

    seen, real = [], forge.demo_tools.evaluate_with_tools

    def recording(*args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
        seen.append((kwargs["with_tool"], dtype))
        return real(*args, **kwargs)

    monkeypatch.setattr(forge.demo_tools, "evaluate_with_tools", recording)
    asked = _count_precision_choices(monkeypatch)
    out = tmp_path / "tools"
    main(["demo", "--tools", "--model", str(model_folder), "--steps", "1", "--prompts_per_step", "2", "--group_size",
          "2", "--heldout", "3", "--max_new_tokens", "4", "--threads", "1", "--output_dir", str(out),
          "--eval_batch_size", "3", "--dtype", "bfloat16"])
    # the base model without and with the calculator, then the trained one with it: all in the training precision
    assert seen == [(False, torch.bfloat16), (True, torch.bfloat16), (True, torch.bfloat16)]
    assert asked == ["bfloat16"]  # decided once, by the same function as the plain demo's
    result = json.loads((out / "demo_tools_result.json").read_text())
    assert result["precision"] == "bfloat16" and result["heldout_size"] == 3 and result["settings"]["tools"]
    assert result["settings"]["steps"] == 1  # a flag the user set wins over the tool recipe's 20
    for phase in ("no_tool", "before", "after"):
        assert result[phase]["n"] == 3 and 0.0 <= result[phase]["accuracy"] <= 1.0
    assert result["gain_vs_no_tool"] == result["after"]["accuracy"] - result["no_tool"]["accuracy"]
    assert {"load", "no_tool_eval", "base_eval", "training", "final_eval", "total"} <= set(result["timings"])
    assert "demo_tools_result.json" in capsys.readouterr().out


def test_the_async_demo_samples_ahead_and_reports_who_waited(model_folder, tmp_path, capsys):
    out = tmp_path / "async_out"
    main(["demo", "--model", str(model_folder), "--steps", "3", "--prompts_per_step", "2", "--group_size", "2",
          "--heldout", "4", "--max_new_tokens", "6", "--threads", "2", "--seed", "3", "--output_dir", str(out),
          "--eval_every", "0", "--eval_batch_size", "4", "--async", "--max_staleness", "2"])
    printed = capsys.readouterr().out
    result = json.loads((out / "demo_result.json").read_text())
    assert result["settings"]["asynchronous"] and result["settings"]["max_staleness"] == 2
    assert result["async"]["steps"] == 3 and result["async"]["staleness_max"] == 2.0  # steps 1, 2, 3: 0, 1, 2
    assert "async:" in printed and "trainer_wait_s_total" in printed
