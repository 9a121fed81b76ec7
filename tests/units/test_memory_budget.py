"""A run that fits: the preflight projects the run's peak memory from its own samples, micro_batch_size='auto'
takes the largest loss-pass micro-batch that fits max_memory_mb, and a run that cannot fit stops before step 1
naming what to turn (forge/run/memory.py, core/preflight.py)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from forge import GRPOConfig, GRPOTrainer
from forge.core.preflight import PreflightFailed, PreflightReport, fit_memory
from forge.model.tiny import build_tiny_model
from forge.run import memory
from forge.run.memory import MemoryProjection, fitting_micro_batch, project

ROWS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


def vowel_count(prompts, completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in text)) for text in completions]


def test_project_scales_generation_by_rows_and_the_loss_pass_by_rows_times_tokens():
    # generation: 100 MB for 8 sampled rows -> 32 rows: 400 MB. Loss pass: 60 MB for 4 rows x (20 + 10) tokens is
    # 0.5 MB per row-token -> 8 rows x (20 + 40) tokens: 240 MB.
    got = project(100.0, 60.0, held=500.0, sampled_rows=8, run_rows=32, measured_micro_batch=4, measured_tokens=30,
                  run_micro_batch=8, run_tokens=60)
    assert (got.generation, got.loss_pass, got.micro_batch_size) == (400.0, 240.0, 8)
    assert got.peak == 900.0  # held + the larger phase


def test_fitting_micro_batch_is_the_largest_that_fits_next_to_what_is_held():
    projection = MemoryProjection(held=500.0, generation=100.0, loss_pass=240.0, micro_batch_size=8)  # 30 MB a row
    assert fitting_micro_batch(projection, budget=500 + 30 * 5 + 29, rows=32) == 5
    assert fitting_micro_batch(projection, budget=10_000, rows=32) == 32  # never more than the rollout's rows
    assert fitting_micro_batch(projection, budget=520, rows=32) == 0  # not even one row
    assert fitting_micro_batch(projection, budget=400, rows=32) == 0  # what is held alone is over


def fake_trainer(micro_batch_size, max_memory_mb, world_size=1):
    config = GRPOConfig(group_size=4, prompts_per_step=4, micro_batch_size=micro_batch_size,
                        max_memory_mb=max_memory_mb)
    dist = SimpleNamespace(world_size=world_size, any=bool)
    return SimpleNamespace(config=config, device=torch.device("cpu"), dist=dist,
                           micro_batch_size=4 if micro_batch_size == "auto" else micro_batch_size)


def report_with(projection: MemoryProjection) -> PreflightReport:
    return PreflightReport(prompts=2, group_size=4, max_new_tokens=8, truncated=0.0, finished_lengths={}, rewards=[],
                           flat_low=0.0, flat_high=0.0, tokens_per_second=1.0, step_seconds=1.0, run_seconds=1.0,
                           seconds=1.0, prompt_as_seen="", memory=projection)


def test_auto_takes_the_largest_micro_batch_that_fits_and_a_fixed_one_that_does_not_fit_stops():
    projection = MemoryProjection(held=500.0, generation=100.0, loss_pass=120.0, micro_batch_size=4)  # 30 MB a row
    trainer = fake_trainer("auto", max_memory_mb=500 + 30 * 6 + 1)
    report = report_with(projection)
    assert fit_memory(trainer, report) is None
    assert trainer.micro_batch_size == 6 and report.memory.micro_batch_size == 6
    assert report.memory.loss_pass == pytest.approx(180.0) and report.memory_budget_mb == 681

    trainer = fake_trainer(16, max_memory_mb=600)  # 16 rows x 30 MB over 100 MB of room
    message = fit_memory(trainer, report_with(dataclasses_replace(projection, loss_pass=480.0, micro_batch_size=16)))
    assert "980 MB" in message and "600 MB" in message
    for knob in ("micro_batch_size='auto'", "gradient_checkpointing", "max_new_tokens", "max_memory_mb"):
        assert knob in message


def dataclasses_replace(projection, **changes):
    import dataclasses

    return dataclasses.replace(projection, **changes)


def test_the_default_budget_is_90_percent_of_held_plus_this_process_share_of_what_is_free(monkeypatch):
    monkeypatch.setattr(memory, "available_mb", lambda device=None: 10_500.0)  # 500 held + 10,000 free
    trainer = fake_trainer(8, max_memory_mb=None, world_size=2)
    report = report_with(MemoryProjection(held=500.0, generation=10.0, loss_pass=10.0, micro_batch_size=8))
    assert fit_memory(trainer, report) is None
    assert report.memory_budget_mb == pytest.approx(0.9 * (500 + 10_000 / 2))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures the resident set through /proc")
def test_a_run_over_its_budget_stops_before_step_1_and_auto_fits_one_under_it(tmp_path, capsys):
    model, tokenizer = build_tiny_model(seed=0)
    too_small = GRPOConfig(group_size=4, prompts_per_step=2, max_new_tokens=6, max_steps=2, logging_steps=1,
                           save_steps=0, output_dir=str(tmp_path / "small"), max_memory_mb=50)
    run = GRPOTrainer(model, tokenizer, vowel_count, too_small)
    with pytest.raises(PreflightFailed, match="over its budget of 50 MB"):
        run.train(ROWS)
    assert run.global_step == 0
    assert "memory        ~" in capsys.readouterr().out  # the report printed first, with the projection

    model, tokenizer = build_tiny_model(seed=0)
    fits = GRPOConfig(group_size=4, prompts_per_step=2, max_new_tokens=6, max_steps=2, logging_steps=1, save_steps=0,
                      output_dir=str(tmp_path / "auto"), micro_batch_size="auto")
    run = GRPOTrainer(model, tokenizer, vowel_count, fits)
    run.train(ROWS)
    assert run.global_step == 2 and run.micro_batch_size == 8  # the tiny model's whole rollout fits


def test_a_resumed_auto_run_keeps_the_micro_batch_its_preflight_chose(tmp_path, monkeypatch):
    """The preflight runs before step 1 only; the checkpoint carries the micro-batch it fitted."""
    import forge.core.preflight as preflight_module

    monkeypatch.setattr(preflight_module.memory, "fitting_micro_batch", lambda projection, budget, rows: 3)
    settings = {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6, "logging_steps": 1, "save_steps": 1,
                "output_dir": str(tmp_path / "run"), "micro_batch_size": "auto", "max_memory_mb": 100_000}
    model, tokenizer = build_tiny_model(seed=0)
    first = GRPOTrainer(model, tokenizer, vowel_count, GRPOConfig(max_steps=1, **settings))
    first.train(ROWS)
    assert first.micro_batch_size == 3
    model, tokenizer = build_tiny_model(seed=0)
    resumed = GRPOTrainer(model, tokenizer, vowel_count, GRPOConfig(max_steps=2, resume_from="latest", **settings))
    assert resumed.micro_batch_size == 4  # one group until it knows better
    resumed.train(ROWS)
    assert resumed.global_step == 2 and resumed.micro_batch_size == 3


def test_max_memory_mb_with_the_preflight_off_is_refused_since_nothing_would_check_it():
    with pytest.raises(ValueError, match=r"max_memory_mb=500.*preflight='off' skips it.*preflight='warn'"):
        GRPOConfig(max_memory_mb=500, preflight="off").validate()
    GRPOConfig(max_memory_mb=500, preflight="warn").validate()
    GRPOConfig(preflight="off").validate()
