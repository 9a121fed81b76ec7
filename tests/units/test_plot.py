"""plot_training_curves: a PNG from a synthetic log, and clear errors without one."""

import json
import math

import pytest

from forge.eval.plot import build_panels, default_smoothing, ema, plot_training_curves, read_log

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_log(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def synthetic_rows(n_steps=30):
    rows = []
    for step in range(1, n_steps + 1):
        rows.append(
            {
                "step": step,
                "epoch": step / 10,
                "time": 1000.0 + step,
                "loss": 0.1,
                "reward": step / n_steps + 0.1 * math.sin(step),
                "rewards/correctness/mean": step / n_steps,
                "rewards/format/mean": 1.0,
                "kl": 0.001 * step if step != 5 else None,  # a NaN logged as null
                "completions/mean_length": 100 - step,
                "frac_reward_zero_std": 0.5,
            }
        )
        if step % 10 == 0:
            rows.append({"step": step, "epoch": step / 10, "eval_gsm8k/accuracy": step / 40})
    return rows


def test_writes_png_with_eval_rows(tmp_path):
    write_log(tmp_path / "training_log.jsonl", synthetic_rows())
    out = plot_training_curves(tmp_path)
    assert out == tmp_path / "training_curves.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_accepts_log_path_and_custom_out(tmp_path):
    log_path = tmp_path / "training_log.jsonl"
    write_log(log_path, synthetic_rows(5))
    out = plot_training_curves(log_path, tmp_path / "plots" / "curves.png")
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_panels_skip_missing_data():
    rows = [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.7, "kl": 0.01}]
    titles = [panel.title for panel in build_panels(rows)]
    assert titles == ["Reward", "KL to reference"]


def test_panels_from_full_log():
    panels = {panel.title: panel for panel in build_panels(synthetic_rows())}
    assert list(panels) == [
        "Reward",
        "Held-out accuracy",
        "KL to reference",
        "Completion length",
        "Groups with zero reward std",
    ]
    assert [s.label for s in panels["Reward"].series] == ["reward", "rewards/correctness/mean", "rewards/format/mean"]
    assert panels["Held-out accuracy"].series[0].steps == [10, 20, 30]
    assert 5 not in panels["KL to reference"].series[0].steps


def test_read_log_skips_torn_line(tmp_path):
    log_path = tmp_path / "training_log.jsonl"
    log_path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')
    assert read_log(log_path) == [{"step": 1, "reward": 0.5}]


def test_ema_is_bias_corrected():
    assert ema([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert ema([0.0, 1.0], smoothing=0.5) == pytest.approx([0.0, 2 / 3])


def test_missing_log_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="no training_log.jsonl in .*; run forge train first"):
        plot_training_curves(tmp_path)


def test_empty_log_raises(tmp_path):
    (tmp_path / "training_log.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="run forge train first"):
        plot_training_curves(tmp_path)


def test_default_smoothing_leaves_few_points_raw():
    assert default_smoothing(3) == 0.0
    assert default_smoothing(1000) == 0.9
    assert ema([0.0, 1.0, 0.0], default_smoothing(3)) == [0.0, 1.0, 0.0]


def test_heldout_panel_names_the_number_of_problems():
    rows = [{"step": 1, "reward": 0.5}, {"step": 0, "eval_strict_accuracy": 0.1, "eval_n": 60},
            {"step": 10, "eval_strict_accuracy": 0.2, "eval_n": 60}]
    panels = {panel.title: panel for panel in build_panels(rows)}
    assert "Held-out accuracy (60 problems)" in panels
    assert panels["Held-out accuracy (60 problems)"].series[0].steps == [0, 10]
    assert "Held-out accuracy" in {panel.title for panel in build_panels(synthetic_rows())}


def test_panels_leave_out_all_zero_series_and_reward_counters():
    from forge.eval.plot import build_panels

    rows = [{"step": s, "reward": 0.1 * s, "kl": 0.0, "rewards/math/mean": 0.2, "rewards/errors": 3,
             "rewards/timeouts": 1, "rewards/nonfinite": 0, "completions/mean_length": 20.0} for s in range(1, 6)]
    panels = {panel.title: [series.label for series in panel.series] for panel in build_panels(rows)}
    assert "KL to reference" not in panels  # kl_beta = 0: a flat-zero panel says nothing
    assert panels["Reward"] == ["reward", "rewards/math/mean"]  # the counters are not rewards


def test_alarms_are_marked_where_they_start_and_steps_are_whole_numbers():
    from forge.eval.plot import alarm_starts, build_panels, render

    rows = [{"step": s, "reward": 0.1 * s, "health/groups_flat": float(s in (3, 4, 7)), "health/kl_spike": 0.0}
            for s in range(1, 9)]
    rows.insert(4, {"step": 4, "eval_strict_accuracy": 0.5})  # an evaluation row carries no health keys
    assert alarm_starts(rows) == [(3, "groups_flat"), (7, "groups_flat")]
    figure = render(build_panels(rows), alarm_starts(rows))
    first = figure.axes[0]
    short = render(build_panels([{"step": s, "reward": 0.1 * s} for s in (1, 2, 3)]), []).axes[0]
    assert all(float(tick).is_integer() for tick in short.get_xticks())  # no 1.25, 1.5 steps on a short run
    assert [t.get_text() for t in first.texts] == ["groups_flat", "groups_flat"]
    assert sorted(line.get_xdata()[0] for line in first.lines if line.get_linestyle() == "--") == [3, 7]


def test_time_on_the_x_axis_is_seconds_since_the_runs_first_row():
    rows = [{"step": 0, "time": 500.0, "eval_strict_accuracy": 0.1},
            {"step": 1, "time": 512.5, "reward": 0.2},
            {"step": 2, "time": 530.0, "reward": 0.4, "eval_strict_accuracy": 0.3}]
    panels = {panel.title.split(" (")[0]: panel for panel in build_panels(rows, x="time")}
    assert panels["Reward"].series[0].steps == [12.5, 30.0]
    assert panels["Held-out accuracy"].series[0].steps == [0.0, 30.0]
    with pytest.raises(ValueError, match="no 'time'"):
        build_panels([{"step": 1, "reward": 0.5}], x="time")


def test_an_earlier_logs_eval_slash_keys_are_drawn():
    rows = [{"step": 0, "eval/strict_accuracy": 0.1}, {"step": 5, "eval/strict_accuracy": 0.2}]
    assert [s.label for s in build_panels(rows)[0].series] == ["eval/strict_accuracy"]


def test_two_runs_share_one_figure_each_series_named_after_its_run(tmp_path):
    from forge.cli import main
    from forge.eval.plot import merged_panels

    for name, speed in (("sync", 10.0), ("async", 6.0)):
        (tmp_path / name).mkdir()
        write_log(tmp_path / name / "training_log.jsonl",
                  [{"step": s, "time": 100.0 + speed * s, "reward": s / 10, "eval_strict_accuracy": s / 20}
                   for s in range(5)])
    panels = merged_panels([(name, build_panels(read_log(tmp_path / name / "training_log.jsonl"), x="time"))
                            for name in ("sync", "async")])
    accuracy = next(panel for panel in panels if panel.title.startswith("Held-out"))
    assert [(s.label, s.steps[-1]) for s in accuracy.series] == [("sync: eval_strict_accuracy", 40.0),
                                                                 ("async: eval_strict_accuracy", 24.0)]
    assert main(["plot", str(tmp_path / "sync"), str(tmp_path / "async"), "--x", "time"]) == 0
    assert (tmp_path / "sync" / "compared_curves.png").read_bytes().startswith(PNG_MAGIC)
