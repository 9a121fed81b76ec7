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


def test_steps_that_measured_nothing_raise_no_alarm():
    """A step with no token in the loss (every group dropped as flat) logs entropy, KL and grad norm as 0."""
    stream = [healthy(i) for i in range(4)] + [healthy(4) | {"entropy": 0.0, "kl": 0.0, "grad_norm": 0.0}] * 3
    stream += [healthy(8)]
    assert run_stream(stream) == [[]] * 8


def test_an_alarm_is_said_once_per_episode_and_logged_every_step():
    health = HealthMonitor(3)
    flat = [healthy(i) | {"frac_reward_zero_std": 1.0} for i in range(5)]
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
    assert trainer.global_step == 3 and (tmp_path / "run" / "3" / "COMPLETE").is_file()
    printed = capsys.readouterr()
    assert "forge: health: step 3: groups_flat: most groups scored all alike" in printed.out + printed.err
    rows = [json.loads(line) for line in (tmp_path / "run" / "training_log.jsonl").read_text().splitlines()]
    assert [row["health/groups_flat"] for row in rows] == [0.0, 0.0, 1.0]
