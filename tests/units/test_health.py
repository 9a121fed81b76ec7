"""Run health (forge/run/health.py): each rule fires on a crafted stream of step metrics and stays quiet on a
healthy one, an alarm is said once per episode, and stop_on_health stops a run at its alarm, saving the step."""

from __future__ import annotations

import json

import pytest

from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model
from forge.run.health import HEALTH_RULES, HealthMonitor, parse_thresholds
from forge.run.loop import HealthStop


def healthy(step: int) -> dict:
    """One step of a run that learns: moving reward, mixed groups, steady KL and gradient norm."""
    return {"reward": 0.2 + 0.03 * step, "frac_reward_zero_std": 0.3, "entropy": 1.1, "kl": 0.01 + 0.001 * step,
            "clip_ratio/region_mean": 0.02, "completions/mean_length": 30.0, "completions/clipped_ratio": 0.1,
            "sampling/sampling_logp_difference/mean": 0.03, "sampling/sampling_logp_difference/max": 2.8 if step % 7 == 3 else 0.6,  # bf16's tail
            "grad_norm": 1.0 + 0.05 * step, "skipped_steps": 0}


BROKEN = {  # rule -> how the last steps of an otherwise healthy stream go bad
    "reward_stuck": lambda m, i: m | {"reward": 0.5},
    "groups_flat": lambda m, i: m | {"frac_reward_zero_std": 1.0},
    "entropy_collapsed": lambda m, i: m | {"entropy": 0.001},
    "entropy_collapsing": lambda m, i: m | {"entropy": [0.9, 0.5, 0.2, 0.1, 0.1][i - 5], "reward": 0.3},
    "zero_signal_steps": lambda m, i: m | {"frac_reward_zero_std": 1.0} if i >= 7 else m,
    "kl_spike": lambda m, i: m | {"kl": 0.5} if i == 9 else m,
    "clip_spike": lambda m, i: m | {"clip_ratio/region_mean": 0.6} if i == 9 else m,
    "length_collapsed": lambda m, i: m | {"completions/mean_length": 1.0} if i == 9 else m,
    "length_pinned": lambda m, i: m | {"completions/clipped_ratio": 1.0},
    "logprob_gap": lambda m, i: m | {"sampling/sampling_logp_difference/mean": 0.4} if i == 9 else m,
    "grad_norm_exploding": lambda m, i: m | {"grad_norm": 40.0} if i == 9 else m,
    "skipped_steps": lambda m, i: m | {"skipped_steps": 1} if i == 9 else m,
    "episodes_failing": lambda m, i: m | {"env/frac_failed_episodes": 0.75 if i == 9 else 0.25},
}


def run_stream(stream: list[dict], **monitor) -> list[list[str]]:
    health = HealthMonitor(5, **monitor)
    return [health.check(metrics)[1] for metrics in stream]


def test_a_healthy_stream_raises_no_alarm():
    assert run_stream([healthy(i) for i in range(20)]) == [[]] * 20


@pytest.mark.parametrize("rule", sorted(HEALTH_RULES))
def test_each_rule_fires_on_its_failure(rule):
    stream = [healthy(i) for i in range(5)] + [BROKEN[rule](healthy(i), i) for i in range(5, 10)]
    said = run_stream(stream)
    assert rule in said[-1] or any(rule in alarms for alarms in said[5:]), said
    assert not any(rule in alarms for alarms in said[:5])
    assert set(BROKEN) == set(HEALTH_RULES)


FLAT_REWARDS = [0.25, 0.27, 0.24, 0.26, 0.25, 0.26, 0.24, 0.25]  # a reward that stalls: noise, no rise


def collapse(entropies: list[float], rewards: list[float] = FLAT_REWARDS) -> list[dict]:
    """A run whose sampling entropy falls step by step while its reward stays where it was."""
    return [healthy(0) | {"entropy": entropy, "reward": reward} for entropy, reward in zip(entropies, rewards)]


def test_a_collapse_raises_the_alarm_within_a_few_steps():
    """Entropy 2.7 -> 0.1 nats/token in 4 steps, reward flat: the alarm goes off while it happens (the step's
    entropy under 0.2 x the window's highest: 0.3 < 0.54 at step 4), names it and says what to try."""
    stream = collapse([2.7, 2.7, 1.4, 0.6, 0.3, 0.1, 0.1, 0.1])
    said = run_stream(stream, thresholds={"entropy_collapsing": 0.2})
    assert said[:4] == [[]] * 4 and said[4] == ["entropy_collapsing"]  # 0.6 > 0.54 was not yet
    assert said[5:] == [[]] * 3  # said once while it lasts
    message = HEALTH_RULES["entropy_collapsing"].says
    assert all(word in message for word in ("temperature", "entropy_target", "kl_beta", "prompts_per_step"))
    # The threshold sets how deep a fall: 0.1 x 2.7 = 0.27 is first passed at step 5; 0.03 x 2.7 never.
    assert run_stream(stream, thresholds={"entropy_collapsing": 0.1})[4:6] == [[], ["entropy_collapsing"]]
    assert run_stream(stream, thresholds={"entropy_collapsing": 0.03}) == [[]] * 8


def test_entropy_that_falls_while_the_reward_rises_raises_no_alarm():
    """A policy that sharpens as it learns: the same fall of entropy while the reward climbs (at step 4 the
    window's earlier half 0.05, 0.15, its later half 0.35, 0.45). One lucky step in a stalled window does not
    hide the stall (0.3, 0.31 | 0.5 | 0.3, 0.29)."""
    entropies = [2.7, 2.7, 1.4, 0.6, 0.3, 0.1]
    rising = collapse(entropies, [0.05 + 0.1 * i for i in range(6)])
    assert run_stream(rising, thresholds={"entropy_collapsing": 0.2}) == [[]] * 6
    lucky = collapse(entropies, [0.3, 0.31, 0.5, 0.3, 0.29, 0.3])
    assert run_stream(lucky, thresholds={"entropy_collapsing": 0.2})[4] == ["entropy_collapsing"]


def test_repeated_zero_signal_steps_raise_the_alarm():
    """Every group flat on 3 steps in a row (3 by default) is an alarm; 2, or 3 that are only mostly flat, are
    not."""
    def flat(i, share=1.0):
        return healthy(i) | {"frac_reward_zero_std": share}

    assert run_stream([healthy(0), flat(1), flat(2), flat(3)])[-1] == ["zero_signal_steps"]
    assert run_stream([flat(0), flat(1), healthy(2), flat(3), flat(4)]) == [[]] * 5
    assert run_stream([flat(0), flat(1), flat(2, 0.75), flat(3), flat(4)]) == [[]] * 5
    assert run_stream([flat(0), flat(1)], thresholds={"zero_signal_steps": 2})[-1] == ["zero_signal_steps"]


def test_stop_on_health_stops_a_run_on_its_zero_signal_steps(tmp_path):
    """A reward that scores every completion alike: the run stops at its third step on zero_signal_steps, the
    step saved, with a window longer than the steps groups_flat would need."""
    def constant(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    model, tokenizer = build_tiny_model(seed=0)
    config = GRPOConfig(group_size=4, max_new_tokens=4, gradient_accumulation_steps=1, max_steps=10,
                        logging_steps=1, save_steps=0, preflight="off", health_window=8,
                        stop_on_health=["zero_signal_steps"], output_dir=str(tmp_path / "run"))
    trainer = GRPOTrainer(model, tokenizer, constant, config)
    with pytest.raises(HealthStop, match="step 3: stopped on the run-health alarm zero_signal_steps"):
        trainer.train([{"prompt": "What is 1 + 1?"}, {"prompt": "Name a color."}] * 4)
    assert trainer.global_step == 3 and (tmp_path / "run" / "checkpoint-3" / "COMPLETE").is_file()


def test_steps_that_measured_nothing_raise_no_alarm():
    """A step with no token in the loss (every group dropped as flat) logs entropy, KL and grad norm as 0."""
    stream = [healthy(i) for i in range(4)] + [healthy(4) | {"entropy": 0.0, "kl": 0.0, "grad_norm": 0.0}] * 3
    stream += [healthy(8)]
    assert run_stream(stream) == [[]] * 8


def test_an_alarm_is_said_once_per_episode_and_logged_every_step():
    health = HealthMonitor(3)
    flat = [healthy(i) | {"frac_reward_zero_std": 0.95} for i in range(5)]  # mostly flat: groups_flat alone
    said = [health.check(m) for m in [*flat, healthy(6), *flat]]
    started = [alarms for _, alarms in said]
    assert started[2] == ["groups_flat"] and started[3:5] == [[], []]  # said once while it lasts
    assert started[5] == [] and said[5][0]["health/groups_flat"] == 0.0  # cleared
    assert started[8] == ["groups_flat"]  # a new episode is said again
    assert said[4][0]["health/groups_flat"] == 1.0 and set(said[4][0]) == {f"health/{r}" for r in HEALTH_RULES}


def test_thresholds_can_be_changed_and_bad_ones_are_named():
    stream = [healthy(i) for i in range(5)] + [healthy(5) | {"kl": 0.04}]
    assert run_stream(stream)[-1] == []  # 0.04 is under 10x the recent median
    assert run_stream(stream, thresholds=parse_thresholds(["kl_spike=2"]))[-1] == ["kl_spike"]
    with pytest.raises(ValueError, match="unknown rule 'kl'"):
        parse_thresholds(["kl=2"])
    with pytest.raises(ValueError, match="invalid GRPOConfig"):
        GRPOConfig(health_thresholds=["kl_spike=lots"]).validate()
    with pytest.raises(ValueError, match="stop_on_health"):
        GRPOConfig(stop_on_health=["loss_nan"]).validate()


def test_stop_on_health_stops_at_the_alarm_and_saves_that_step(tmp_path, capsys):
    def constant(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    model, tokenizer = build_tiny_model(seed=0)
    config = GRPOConfig(group_size=4, max_new_tokens=4, gradient_accumulation_steps=1, max_steps=10, logging_steps=1,
                        save_steps=0, preflight="off", health_window=3, stop_on_health=["groups_flat"],
                        output_dir=str(tmp_path / "run"))
    trainer = GRPOTrainer(model, tokenizer, constant, config)
    with pytest.raises(HealthStop, match=r"(?s)step 3: stopped on the run-health alarm groups_flat.*The last finished "
                                         r"step \(3\) is saved"):
        trainer.train([{"prompt": "What is 1 + 1?"}, {"prompt": "Name a color."}] * 4)
    assert trainer.global_step == 3 and (tmp_path / "run" / "checkpoint-3" / "COMPLETE").is_file()
    printed = capsys.readouterr()
    assert "forge: health: step 3: groups_flat: most groups scored all alike" in printed.out + printed.err
    rows = [json.loads(line) for line in (tmp_path / "run" / "training_log.jsonl").read_text().splitlines()]
    assert [row["health/groups_flat"] for row in rows] == [0.0, 0.0, 1.0]


def test_a_low_entropy_that_wanders_raises_no_collapse_alarm():
    """`forge demo`'s entropy on its last steps (seed 0, AMX Xeon; measured on the tokens in the loss only, 0
    where none): it wanders from 0.142 to 0.013 with the reward stalled, a fall of 0.13 nats, under the 0.5 a
    collapse needs."""
    stream = collapse([0.021, 0.142, 0.0, 0.063, 0.013], [0.787, 0.412, 0.1, 0.288, 0.506])
    assert run_stream(stream) == [[]] * 5
