"""How fast a run reaches a share of a teacher's held-out gain (`forge demo --distill`).

A run's held-out curve (the demo's `eval_curve`: greedy strict accuracy at some steps, each point on the first
`n` held-out problems) is compared with the teacher on the same problems: the threshold is
base + fraction x (teacher - base), with base the curve's own step-0 point (the same base model) and teacher
the teacher's accuracy on those `n` problems (its full held-out result, or its own curve's last point). The
first point at or past it gives the steps and the training CPU seconds to get there.
"""

from __future__ import annotations

from pathlib import Path

from forge.logging.logger import log_rows


def teacher_accuracy(teacher: dict, n: int) -> float | None:
    """The teacher run's strict accuracy on the first n held-out problems (a demo_result.json dict), or None
    when it was not measured on exactly those."""
    if n == teacher["heldout_size"]:
        return teacher["after"]["strict_accuracy"]
    last = teacher["eval_curve"][-1] if teacher.get("eval_curve") else None
    return last["strict_accuracy"] if last is not None and last["n"] == n else None


def step_seconds(log_path: Path) -> dict[int, float]:
    """step -> training seconds up to and including it, summed from training_log.jsonl's step_time (for a
    run whose curve points do not carry train_cpu_seconds; wall seconds, one thread). A log written before
    the metric took TRL's name has step_seconds instead."""
    total, out = 0.0, {0: 0.0}
    for _, row in log_rows(Path(log_path)):
        seconds = row.get("step_time", row.get("step_seconds"))
        if seconds is not None and row.get("step") is not None:
            total += seconds
            out[row["step"]] = total
    return out


def time_to_gain(run: dict, teacher: dict, fraction: float = 0.9, log_path: Path | None = None) -> dict:
    """{'threshold', 'step', 'train_cpu_seconds', 'n'} of the first point of run['eval_curve'] at or past
    base + fraction x (teacher - base); step and seconds None when no point reaches it (or the teacher was not
    measured on the curve's problems: threshold None too)."""
    points = run["eval_curve"]
    n, base = points[0]["n"], points[0]["strict_accuracy"]
    target = teacher_accuracy(teacher, n)
    threshold = None if target is None else base + fraction * (target - base)
    hit = next((p for p in points[1:] if threshold is not None and p["strict_accuracy"] >= threshold - 1e-9),
               None)
    seconds = None if hit is None else hit.get("train_cpu_seconds")
    if hit is not None and seconds is None and log_path is not None and Path(log_path).is_file():
        seconds = step_seconds(log_path).get(hit["step"])
    return {"threshold": threshold, "n": n, "step": None if hit is None else hit["step"],
            "train_cpu_seconds": seconds}


def gain_table(rows: list[tuple[str, dict, dict]]) -> str:
    """The printed table: (label, run result, time_to_gain) per run."""
    lines = [f"{'':>20} | steps to 90% | CPU s to 90% | strict (held-out) | training CPU s"]
    for label, run, reached in rows:
        step = "-" if reached["step"] is None else str(reached["step"])
        seconds = "-" if reached["train_cpu_seconds"] is None else f"{reached['train_cpu_seconds']:.0f}"
        total = run.get("train_cpu_seconds", run["train_seconds"])
        lines.append(f"{label:>20} | {step:>12} | {seconds:>12} | {run['after']['strict_accuracy']:17.1%} | "
                     f"{total:14.0f}")
    return "\n".join(lines)
