"""Run health: rules over each step's logged metrics that say, as it happens, when a run has gone bad.

Each rule is one small function of the recent steps' metrics and a threshold, plus the message that names the
likely cause and the knob, in one table (`HEALTH_RULES`; docs/reliability.md explains each). After every step
`HealthMonitor.check` adds `health/<rule>` = 1.0 to the logged metrics for each rule that fires (0.0
otherwise), and returns the alarms that just started: a rule that keeps firing is said once, and again only
after a step without it (an episode). GRPOConfig.stop_on_health names the rules that stop the run (the run
loop saves the last finished step and says how to resume).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from forge.logging.logger import log_rows

Window = deque  # of the last health_window steps' metrics dicts, oldest first; the newest is window[-1]


class Rule(NamedTuple):
    threshold: float  # the default; GRPOConfig.health_thresholds overrides it by name
    fires: Callable[[Window, float], bool]
    says: str  # the likely cause and what to change


def _value(metrics: dict, key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else float(value)


def _every(key: str, test: Callable[[float, float], bool]) -> Callable[[Window, float], bool]:
    """Fires when the window is full and test(value, threshold) holds for `key` at every step of it."""
    def fires(window: Window, threshold: float) -> bool:
        values = [_value(m, key) for m in window]
        return len(window) == window.maxlen and all(v is not None and test(v, threshold) for v in values)
    return fires


def _latest(key: str, test: Callable[[float, float], bool]) -> Callable[[Window, float], bool]:
    """Fires when the newest step's `key` passes test(value, threshold)."""
    def fires(window: Window, threshold: float) -> bool:
        value = _value(window[-1], key)
        return value is not None and test(value, threshold)
    return fires


def _spike(key: str, floor: float) -> Callable[[Window, float], bool]:
    """Fires when the newest `key` is over threshold x the median of the steps before it (and over `floor`). A
    0 is no measurement (a step with no token in the loss, e.g. every group dropped as flat)
    and is left out."""
    def fires(window: Window, threshold: float) -> bool:
        before = [v for v in (_value(m, key) for m in list(window)[:-1]) if v]
        value = _value(window[-1], key)
        if value is None or len(before) < 2:
            return False
        return value > floor and value > threshold * max(statistics.median(before), floor)
    return fires


def _entropy_collapsed(window: Window, threshold: float) -> bool:
    """Fires when the window is full and every step that measured an entropy (not 0: a step with no token in
    the loss measures none) measured less than `threshold`, at least two of them."""
    values = [v for v in (_value(m, "entropy") for m in window) if v]
    return len(window) == window.maxlen and len(values) >= 2 and all(v < threshold for v in values)


def _reward_stuck(window: Window, threshold: float) -> bool:
    """Fires when the window is full and the mean reward spans at most `threshold` over it."""
    rewards = [_value(m, "reward") for m in window]
    return (len(window) == window.maxlen > 1 and None not in rewards
            and max(rewards) - min(rewards) <= threshold)


COLLAPSE_MIN_FALL = 0.5
"""nats per token an entropy must fall by to count as a collapse: `forge demo`'s entropy (temperature 0.7,
measured on the tokens in the loss only) wanders between 0.0 and 0.46 from step to step on seed 0 without
collapsing."""


def _entropy_collapsing(window: Window, threshold: float) -> bool:
    """Fires when the newest step's entropy is under `threshold` x the highest entropy measured in the window
    (0 is no measurement: a step with no token in the loss), at least COLLAPSE_MIN_FALL below it, while the
    reward has not risen: the mean reward of the window's later half is no higher than that of its earlier
    half. A policy that sharpens as it learns (falling entropy, rising reward) does not fire it."""
    entropies = [v for v in (_value(m, "entropy") for m in window) if v]
    rewards = [_value(m, "reward") for m in window]
    newest = _value(window[-1], "entropy")
    if not newest or len(entropies) < 2 or None in rewards or len(rewards) < 2:
        return False
    half = len(rewards) // 2
    earlier, later = rewards[:half], rewards[len(rewards) - half:]
    highest = max(entropies)
    fell = newest < threshold * highest and highest - newest >= COLLAPSE_MIN_FALL
    return fell and sum(later) / half <= sum(earlier) / half


def _zero_signal_steps(window: Window, threshold: float) -> bool:
    """Fires when the last `threshold` steps in a row each had every group flat (`frac_reward_zero_std` 1: no
    group-relative advantage anywhere, so the step trained on nothing)."""
    count = int(threshold)
    latest = [_value(m, "frac_reward_zero_std") for m in list(window)[-count:]]
    return count >= 1 and len(latest) == count and all(v is not None and v >= 1.0 for v in latest)


def _skipped(window: Window, threshold: float) -> bool:
    counts = [_value(m, "skipped_steps") or 0.0 for m in window]
    return len(counts) > 1 and counts[-1] - counts[-2] >= threshold


HEALTH_RULES: dict[str, Rule] = {
    "reward_stuck": Rule(
        1e-6,
        _reward_stuck,
        "the mean reward has not moved over the last health_window steps: every group scores alike "
        "or training has stalled; check frac_reward_zero_std, screen the prompts (`forge screen`), "
        "or give partial credit",
    ),
    "groups_flat": Rule(
        0.9,
        _every("frac_reward_zero_std", lambda v, t: v >= t),
        "most groups scored all alike for health_window steps in a row and carry no signal: the task "
        "is too hard or too easy; `forge screen`, a larger group_size, or a softer reward",
    ),
    "entropy_collapsed": Rule(
        0.01,
        _entropy_collapsed,
        "the policy's token entropy stayed under 0.01 over health_window steps (it samples "
        "nearly one answer): lower learning_rate, raise temperature, or add entropy_coef",
    ),
    "entropy_collapsing": Rule(
        0.2,
        _entropy_collapsing,
        "the policy's token entropy fell under 20% of its level a few steps ago while the mean reward did "
        "not rise: it is settling on one answer without learning the task (a collapse); raise temperature, "
        "hold an entropy floor (adaptive_entropy with entropy_target), add kl_beta, lower learning_rate, "
        "or sample more prompts_per_step",
    ),
    "zero_signal_steps": Rule(
        3,
        _zero_signal_steps,
        "every group scored all alike on the last 3 steps in a row, so they trained on nothing: the task "
        "is too hard or too easy for the policy now; `forge screen` the prompts, dynamic_sampling, a larger "
        "group_size, or a softer reward",
    ),
    "kl_spike": Rule(
        10.0,
        _spike("kl", 1e-3),
        "the KL to the reference jumped over 10x its recent level: lower learning_rate or raise kl_beta",
    ),
    "clip_spike": Rule(
        0.3,
        _latest("clip_ratio/region_mean", lambda v, t: v > t),
        "over 30% of tokens were clipped: the updates move the policy too far from the one that "
        "sampled; lower learning_rate or num_iterations",
    ),
    "length_collapsed": Rule(
        2.0,
        _latest("completions/mean_length", lambda v, t: v <= t),
        "completions have collapsed to a token or two: a reward that pays for short answers, or "
        "a diverging policy; check the samples (samples.jsonl) and the rewards",
    ),
    "length_pinned": Rule(
        0.9,
        _every("completions/clipped_ratio", lambda v, t: v >= t),
        "almost every completion hits max_new_tokens: raise max_new_tokens, ask for shorter "
        "answers, or set mask_truncated_completions",
    ),
    "logprob_gap": Rule(
        0.1,
        _latest("sampling/sampling_logp_difference/mean", lambda v, t: v > t),
        "the sampler's and the trainer's log-probs of the sampled tokens differ by over 0.1 nat on "
        "average (the samples come from another policy than the one trained): check the precision "
        "(dtype) and merge_lora_for_generation, or set rollout_is",
    ),
    "grad_norm_exploding": Rule(
        10.0,
        _spike("grad_norm", 1e-6),
        "the gradient norm jumped over 10x its recent level: lower learning_rate or max_grad_norm",
    ),
    "episodes_failing": Rule(
        0.5,
        _latest("env/frac_failed_episodes", lambda v, t: v > t),
        "most of this step's environment episodes failed (env/failed_episodes), so they "
        "sampled nothing and taught nothing: their environment's __init__ or reset raised or "
        "took longer than tool_timeout; samples.jsonl says why (episode_failure)",
    ),
    "skipped_steps": Rule(
        1.0,
        _skipped,
        "an optimizer step was skipped for a NaN/inf loss, gradient or weight: lower learning_rate "
        "or use dtype='float32'",
    ),
}


REWARD_RULES = ("reward_stuck", "groups_flat", "zero_signal_steps", "entropy_collapsing")
"""The rules about the rewards' learning signal: off when the rewards do not enter the loss (pure on-policy
distillation, whose signal is the teacher's)."""


class HealthMonitor:
    """Holds the recent steps' metrics and which rules are firing; `check` after every step (the rules in
    `off` never fire)."""

    def __init__(self, window: int, thresholds: dict[str, float] | None = None, off=()):
        self.steps: deque[dict] = deque(maxlen=window)
        self.thresholds = {name: rule.threshold for name, rule in HEALTH_RULES.items()} | (thresholds or {})
        self.firing: set[str] = set()
        self.rules = {name: rule for name, rule in HEALTH_RULES.items() if name not in off}

    def check(self, metrics: dict) -> tuple[dict[str, float], list[str]]:
        """({health/<rule>: 1.0 or 0.0}, the names of the rules that started firing at this step)."""
        self.steps.append(metrics)
        now = {name for name, rule in self.rules.items() if rule.fires(self.steps, self.thresholds[name])}
        started = sorted(now - self.firing)
        self.firing = now
        return {f"health/{name}": float(name in now) for name in HEALTH_RULES}, started


    def resume(self, training_log: Path) -> None:
        """Refill the window (and which rules fire) from the training rows of a resumed run's
        training_log.jsonl, so the alarms after a resume are those of the uninterrupted run (exactly so with
        logging_steps=1)."""
        if not training_log.exists():
            return
        rows = [row for _, row in log_rows(training_log)]  # a line that is no row is left out, said
        rows = [{k: v for k, v in row.items() if isinstance(v, (int, float))} for row in rows]  # numbers only
        for row in [row for row in rows if "loss" in row][-(self.steps.maxlen or 0):]:
            self.check(row)


def parse_thresholds(entries: Sequence[str] | None) -> dict[str, float]:
    """GRPOConfig.health_thresholds, ["kl_spike=5", ...], as {rule: threshold}; a ValueError
    names a bad entry."""
    out = {}
    for entry in entries or ():
        name, _, value = entry.partition("=")
        if name not in HEALTH_RULES:
            raise ValueError(f"health_thresholds: unknown rule {name!r}; the rules are "
                             f"{sorted(HEALTH_RULES)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"health_thresholds: {entry!r} is not rule=number") from None
    return out


__all__ = ["HEALTH_RULES", "REWARD_RULES", "HealthMonitor", "Rule", "parse_thresholds"]
