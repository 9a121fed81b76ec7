"""Training curves from `training_log.jsonl` as one PNG: reward, held-out accuracy, KL,
length, zero-std groups.

Each panel shows the raw per-step values faintly and an exponential moving average on top, since
GRPO rewards are noisy from step to step. Panels without data, or whose values are all 0 (the KL of a run
with kl_beta=0), are left out; the reward counters (errors, timeouts, non-finite) stay off the reward axis.
Steps are whole numbers on the x axis, legends sit beside the panels, and the steps where a run-health alarm
started (`health/<rule>` turning 1, forge/run/health.py) are marked on every panel and named on the first.

Several runs draw on one figure, each series named after its run's folder (`forge plot A B --out ab.png`), and
`x="time"` puts the wall-clock seconds since each run's first log row on the x axis instead of the step: two
runs that reach the same accuracy at different speeds (synchronous and async GRPO, say) then compare at a
glance.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from forge.logging.logger import log_rows

TRAINING_LOG_NAME = "training_log.jsonl"
REWARD_COUNTERS = ("rewards/errors", "rewards/timeouts", "rewards/nonfinite")  # counts, not rewards


X_AXES = {"step": "optimizer step", "time": "seconds since the run's first log row (wall clock)"}


@dataclass
class Series:
    """One line on a panel: where `key` was logged (steps; with x="time" seconds) and its values."""

    label: str
    steps: list[float]
    values: list[float]


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series]


def ema(values: list[float], smoothing: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard's smoothing slider)."""
    smoothed, running, weight = [], 0.0, 0.0
    for value in values:
        running = smoothing * running + (1 - smoothing) * value
        weight = smoothing * weight + (1 - smoothing)
        smoothed.append(running / weight)
    return smoothed


def default_smoothing(n_points: int) -> float:
    """Smooth long, noisy series strongly (0.9 at >= 100 points) and leave a handful of points raw."""
    return min(0.9, max(0.0, 1 - 10 / max(n_points, 1)))


def resolve_log_path(output_dir_or_log_path: str | os.PathLike) -> Path:
    """Accept a run directory or the log file itself; raise a clear error when there is no log to plot."""
    path = Path(output_dir_or_log_path)
    log_path = path / TRAINING_LOG_NAME if path.is_dir() or path.suffix != ".jsonl" else path
    if not log_path.is_file() or log_path.stat().st_size == 0:
        where = path if path.suffix != ".jsonl" else path.parent
        raise FileNotFoundError(f"no {TRAINING_LOG_NAME} in {where}; run forge train first")
    return log_path


def read_log(log_path: Path) -> list[dict]:
    """The rows of training_log.jsonl that have a step (`log_rows`: a line that is no row is
    left out, said)."""
    return [row for _, row in log_rows(log_path) if row.get("step") is not None]


def extract_series(rows: list[dict], key: str, label: str | None = None, x: str = "step") -> Series:
    """The finite values of `key` across rows (nulls and missing entries skipped), at each row's step or, with
    x="time", its seconds since the first row that has a time."""
    start = min((row["time"] for row in rows if isinstance(row.get("time"), (int, float))), default=None)
    if x == "time" and start is None:
        raise ValueError("the log's rows have no 'time': draw it against the step (x='step')")
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        where = row["step"] if x == "step" else row.get("time")
        if isinstance(value, (int, float)) and math.isfinite(value) and isinstance(where, (int, float)):
            steps.append(where if x == "step" else where - start)
            values.append(float(value))
    return Series(label or key, steps, values)


def build_panels(rows: list[dict], x: str = "step") -> list[Panel]:
    """Pick what to draw from the keys that appear in the log; drop panels with no data."""
    keys = sorted({key for row in rows for key in row})
    reward_keys = ["reward"] + [k for k in keys if k.startswith("rewards/") and not k.endswith("/std")
                                and k not in REWARD_COUNTERS]
    # eval_<metric>: the logs of this Forge; eval/<metric>: an earlier one's
    accuracy_keys = [k for k in keys if k.startswith(("eval_", "eval/")) and "accuracy" in k]
    candidates = [
        Panel("Reward", "mean reward", [extract_series(rows, k, x=x) for k in reward_keys]),
        Panel(_heldout_title(rows), "accuracy", [extract_series(rows, k, x=x) for k in accuracy_keys]),
        Panel("KL to reference", "KL", [extract_series(rows, "kl", x=x)]),
        Panel("Completion length", "tokens",
              [extract_series(rows, "completions/mean_length", "completion length", x=x)]),
        Panel(
            "Groups with zero reward std",
            "fraction of groups",
            [extract_series(rows, "frac_reward_zero_std", x=x)],
        ),
    ]
    panels = []
    for panel in candidates:
        panel.series = [series for series in panel.series if any(series.values)]  # all 0: nothing to show
        if panel.series:
            panels.append(panel)
    return panels


def alarm_starts(rows: list[dict]) -> list[tuple[int, str]]:
    """(step, rule) where a run-health alarm started: `health/<rule>` is 1 there and was not
    at the row before."""
    starts, before = [], set()
    for row in rows:
        if not any(key.startswith("health/") for key in row):
            continue  # an evaluation row
        now = {key.removeprefix("health/") for key, value in row.items()
               if key.startswith("health/") and value}
        starts += [(int(row["step"]), rule) for rule in sorted(now - before)]
        before = now
    return starts


def _heldout_title(rows: list[dict]) -> str:
    """'Held-out accuracy', with the number of problems when the evaluator logged it (eval_n)."""
    sizes = sorted({int(row["eval_n"]) for row in rows if isinstance(row.get("eval_n"), (int, float))})
    if not sizes:
        return "Held-out accuracy"
    return f"Held-out accuracy ({'/'.join(map(str, sizes))} problems)"


def plot_training_curves(
    output_dir_or_log_path: str | os.PathLike | list, out_path: str | os.PathLike | None = None,
    x: str = "step",
) -> Path:
    """Draw the training curves of a run (or of several, given as a list) into a PNG; returns its path
    (default `{run}/training_curves.png`; several runs: `compared_curves.png` in the first run's folder).
    x: "step" or "time" (X_AXES)."""
    if x not in X_AXES:
        raise ValueError(f"x={x!r}: choose one of {sorted(X_AXES)}")
    runs = output_dir_or_log_path if isinstance(output_dir_or_log_path, list) else [output_dir_or_log_path]
    log_paths = [resolve_log_path(run) for run in runs]
    logs = [read_log(log_path) for log_path in log_paths]
    panels = merged_panels([(path.parent.name, build_panels(rows, x)) for path, rows in zip(log_paths, logs)])
    if not panels:
        where = ", ".join(map(str, log_paths))
        raise ValueError(f"{where}: no reward, accuracy, kl or length values to plot")
    default = "training_curves.png" if len(runs) == 1 else "compared_curves.png"
    out_path = Path(out_path) if out_path is not None else log_paths[0].parent / default
    alarms = alarm_starts(logs[0]) if len(runs) == 1 and x == "step" else []
    figure = render(panels, alarms, X_AXES[x])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=100, bbox_inches="tight")
    return out_path


def merged_panels(runs: list[tuple[str, list[Panel]]]) -> list[Panel]:
    """One run's panels as they are; several runs' panels of one title on one panel, each series named
    `{run}: {label}` (the held-out sizes of the first run that has the panel)."""
    if len(runs) == 1:
        return runs[0][1]
    merged: dict[str, Panel] = {}
    for name, panels in runs:
        for panel in panels:
            key = panel.title.split(" (")[0]
            target = merged.setdefault(key, Panel(panel.title, panel.ylabel, []))
            target.series += [Series(f"{name}: {s.label}", s.steps, s.values) for s in panel.series]
    return list(merged.values())


def render(panels: list[Panel], alarms: list[tuple[int, str]], xlabel: str = X_AXES["step"]):
    """The panels as one matplotlib Figure (Agg canvas; pyplot's global backend is left alone)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(9, 2.8 * len(panels)))
    axes = figure.subplots(len(panels), 1, squeeze=False)
    for number, (ax, panel) in enumerate(zip(axes[:, 0], panels)):
        for index, series in enumerate(panel.series):
            color = f"C{index}"
            ax.plot(series.steps, series.values, color=color, alpha=0.3, linewidth=1)
            smoothed = ema(series.values, default_smoothing(len(series.values)))
            marker = "o" if len(series.values) <= 20 else None  # sparse series (evals): show each point
            ax.plot(series.steps, smoothed, color=color, linewidth=2, marker=marker, label=series.label)
        for step, rule in alarms:
            ax.axvline(step, color="red", linestyle="--", linewidth=1, alpha=0.6)
            if number == 0:
                ax.annotate(
                    rule,
                    (step, 1.0),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    fontsize="x-small",
                    color="red",
                    va="top",
                    ha="right",
                )
        ax.set_title(panel.title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(panel.series) > 1:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    figure.tight_layout()
    return figure
