"""`forge demo --distill` end to end on the tiny offline model (plumbing, not learning), and the time to 90% of a
teacher's held-out gain (forge/eval/gain.py) on hand-made curves."""

import json

import pytest

from forge.cli import main
from forge.eval.gain import time_to_gain
from forge.model.tiny import build_tiny_model


def curve(*points):
    return [{"step": s, "strict_accuracy": a, "n": n, "train_cpu_seconds": c} for s, a, n, c in points]


TEACHER = {"heldout_size": 240, "after": {"strict_accuracy": 0.20},
           "eval_curve": curve((0, 0.10, 60, 0.0), (30, 0.15, 60, 400.0), (60, 0.25, 60, 800.0))}


def test_time_to_gain_on_the_full_held_out_set():
    # base 0.10 (the student's own step 0), teacher 0.20 on the 240: threshold 0.10 + 0.9 x 0.10 = 0.19
    run = {"eval_curve": curve((0, 0.10, 240, 0.0), (8, 0.18, 240, 120.0), (16, 0.19, 240, 250.0))}
    reached = time_to_gain(run, TEACHER)
    assert reached["threshold"] == pytest.approx(0.19)
    assert reached["step"] == 16 and reached["train_cpu_seconds"] == 250.0 and reached["n"] == 240


def test_time_to_gain_on_the_teachers_subset_and_not_reached():
    # on the 60-problem subset the teacher's last curve point counts: 0.10 + 0.9 x 0.15 = 0.235
    assert time_to_gain(TEACHER, TEACHER)["step"] == 60
    run = {"eval_curve": curve((0, 0.10, 60, 0.0), (10, 0.2, 60, 100.0))}
    assert time_to_gain(run, TEACHER)["step"] is None
    other = {"eval_curve": curve((0, 0.10, 30, 0.0), (10, 0.5, 30, 100.0))}  # the teacher has no figure on 30
    assert time_to_gain(other, TEACHER)["threshold"] is None and time_to_gain(other, TEACHER)["step"] is None


@pytest.mark.slow
def test_demo_distill_trains_a_teacher_then_distills_from_it(tmp_path, capsys):
    folder = tmp_path / "tiny"
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "distill"
    main(["demo", "--distill", "--quick", "--model", str(folder), "--heldout", "6", "--max_new_tokens", "6",
          "--threads", "1", "--output_dir", str(out), "--eval_subset", "6", "--eval_batch_size", "6"])
    printed = capsys.readouterr().out
    assert "90% of the teacher's held-out gain" in printed and "distillation" in printed
    result = json.loads((out / "distill_result.json").read_text())
    assert set(result["to_90_percent"]) == {"GRPO (the teacher)", "distillation"}
    assert (out / "teacher" / "final" / "adapter_config.json").is_file()
    log = [json.loads(line) for line in (out / "student" / "training_log.jsonl").read_text().splitlines()]
    assert all("distill/divergence" in row for row in log if "loss" in row)  # the recipe's distill_loss='full'
    teacher_settings, student_settings = result["grpo"]["settings"], result["distillation"]["settings"]
    # the student takes the distillation recipe (x 1; --quick's steps and prompts), the teacher trained here
    # the plain demo's (x 8); flags outside the recipe apply to both
    assert (student_settings["group_size"], student_settings["steps"], student_settings["distill_loss"]) == (1, 3, "full")
    assert (teacher_settings["group_size"], teacher_settings["steps"]) == (8, 3)
    assert teacher_settings["max_new_tokens"] == student_settings["max_new_tokens"] == 6
    assert all("train_cpu_seconds" in point for point in result["distillation"]["eval_curve"])
    student = json.loads((out / "student" / "demo_result.json").read_text())["settings"]
    assert student["distill"] and student["teacher"] == str(out / "teacher" / "final")  # it says it was distilled
    assert not result["grpo"]["settings"]["distill"]
    # again from the saved teacher: no second teacher run
    main(["demo", "--distill", "--teacher", str(out / "teacher" / "final"), "--model", str(folder), "--steps", "1",
          "--prompts_per_step", "2", "--group_size", "2", "--heldout", "6", "--max_new_tokens", "6",
          "--threads", "1", "--output_dir", str(tmp_path / "again"), "--eval_every", "1", "--eval_subset", "6"])
    assert not (tmp_path / "again" / "teacher").exists()
    assert (tmp_path / "again" / "distill_result.json").is_file()


def test_the_student_takes_the_distillation_recipe_unless_told_otherwise():
    import argparse

    from forge.demo import DemoSettings, add_demo_arguments

    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    settings = lambda *argv: DemoSettings.from_args(parser.parse_args(list(argv)))
    student = settings("--distill")
    assert (student.steps, student.prompts_per_step, student.group_size, student.distill_loss) == (24, 8, 1, "full")
    assert settings("--distill", "--group_size", "4").group_size == 4  # a flag the user gave wins
    assert settings("--distill", "--quick").steps == 3  # --quick wins over the recipe
    assert (settings().group_size, settings().distill_loss) == (8, "sampled")  # the plain demo keeps its own
