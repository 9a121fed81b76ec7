"""Dynamic sampling (DAPO, forge/core/dynamic_sampling.py): the rounds logic on scripted informative groups, the
trainer's rounds on scripted rewards, its metrics, and a resume that is exact bit for bit."""

import json

import pytest
import torch
from safetensors.torch import load_file

from forge import GRPOConfig, GRPOTrainer
from forge.core.dynamic_sampling import SamplingRounds, pool_rows
from forge.model.tiny import build_tiny_model

POOL = [{"prompt": f"question {i}", "id": i} for i in range(20)]


def scripted_rounds(informative_per_round: list[list[bool]], wanted: int, max_rounds: int, per_round: int = 4,
                    dynamic: bool = True):
    """Run SamplingRounds over a step of `wanted` rows with these groups-with-signal per round; returns
    (rounds object, the rows of each round, the chosen masks)."""
    report = {}
    rows = POOL[:wanted]
    rounds = SamplingRounds(rows, per_round, wanted, max_rounds, POOL, torch.Generator().manual_seed(0),
                            dynamic, report)
    seen, chosen = [], []
    for i, round_rows in enumerate(rounds):
        seen.append(round_rows)
        chosen.append(rounds.take(torch.tensor(informative_per_round[i])).tolist())
    return rounds, seen, chosen, report


def test_a_step_whose_groups_all_carry_signal_takes_one_round():
    _rounds, seen, chosen, report = scripted_rounds([[True] * 4], wanted=4, max_rounds=3)
    assert len(seen) == 1 and seen[0] == POOL[:4]
    assert chosen == [[True] * 4]
    assert report == {"dynamic_sampling/rounds": 1.0, "dynamic_sampling/prompts": 4.0, "dynamic_sampling/groups_with_signal": 4.0}


def test_rounds_go_on_until_the_step_has_its_groups_and_take_the_first_in_order():
    # round 1: 1 of 4 with signal; round 2: 2 more (3); round 3: 3 with signal but only 1 is wanted -> the first
    script = [[False, True, False, False], [True, False, True, False], [False, True, True, True]]
    rounds, seen, chosen, report = scripted_rounds(script, wanted=4, max_rounds=5)
    assert len(seen) == 3
    assert chosen == [[False, True, False, False], [True, False, True, False], [False, True, False, False]]
    assert report == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/prompts": 12.0, "dynamic_sampling/groups_with_signal": 4.0}
    assert rounds.flat == 1 * 3 + 2 + 1  # flat groups seen over the rounds: 3 + 2 + 1


def test_the_cap_stops_the_rounds_with_fewer_groups():
    script = [[False] * 4, [False, False, True, False], [True] * 4]
    _rounds, seen, chosen, report = scripted_rounds(script, wanted=4, max_rounds=2)
    assert len(seen) == 2  # the step's rows and one more round: the cap
    assert chosen[1] == [False, False, True, False]
    assert report["dynamic_sampling/rounds"] == 2.0 and report["dynamic_sampling/groups_with_signal"] == 1.0


def test_a_step_of_two_rollout_batches_counts_both_before_another_round():
    script = [[True, False], [False, False], [True, True]]
    _rounds, seen, _chosen, report = scripted_rounds(script, wanted=4, max_rounds=2, per_round=2)
    # the step's 4 rows come as two rollout batches (round 1), then one more round of 2 prompts
    assert [len(s) for s in seen] == [2, 2, 2] and report["dynamic_sampling/rounds"] == 2.0
    assert report["dynamic_sampling/prompts"] == 6.0 and report["dynamic_sampling/groups_with_signal"] == 3.0


def test_without_dynamic_sampling_one_round_keeps_every_group_with_signal():
    _rounds, seen, chosen, report = scripted_rounds([[False, True, True, False]], wanted=4, max_rounds=4,
                                                   dynamic=False)
    assert len(seen) == 1 and chosen == [[False, True, True, False]] and report == {}


def test_pool_rows_are_a_function_of_the_generator_state():
    a = pool_rows(POOL, 5, torch.Generator().manual_seed(3))
    b = pool_rows(POOL, 5, torch.Generator().manual_seed(3))
    assert a == b and len({r["id"] for r in a}) == 5  # without replacement
    assert len(pool_rows(POOL[:2], 5, torch.Generator().manual_seed(3))) == 5  # with, from a smaller pool


def test_the_config_checks_the_cap():
    with pytest.raises(ValueError, match="max_sampling_rounds"):
        GRPOConfig(dynamic_sampling=True, max_sampling_rounds=0).validate()


# ----------------------------------------------------------------------------------------------------
# in the trainer, on the tiny model

ROWS = [{"prompt": f"What is {a} + {b}?", "key": a * 10 + b} for a in range(1, 5) for b in range(1, 5)]


def only_odd_keys_vary(prompts, completions, key, **kwargs):
    """A prompt whose key is odd gets rewards 0, 1, 0, 1 (a signal); an even one all 0 (a flat group)."""
    return [float(k % 2 == 1 and i % 2 == 1) for i, k in enumerate(key)]


def config(tmp_path, name, **overrides):
    values = {"group_size": 4, "max_new_tokens": 6, "gradient_accumulation_steps": 1, "prompts_per_step": 4,
              "learning_rate": 1e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1,
              "save_steps": 1, "max_steps": 4, "kl_beta": 0.0, "seed": 3, "preflight": "off",
              "dynamic_sampling": True, "max_sampling_rounds": 3, "output_dir": str(tmp_path / name)}
    return GRPOConfig(**(values | overrides))


def run(tmp_path, name, **overrides):
    model, tokenizer = build_tiny_model(seed=0)
    GRPOTrainer(model, tokenizer, only_odd_keys_vary, config(tmp_path, name, **overrides)).train(ROWS)
    log = [json.loads(line) for line in (tmp_path / name / "training_log.jsonl").read_text().splitlines()]
    return [row for row in log if "loss" in row], load_file(tmp_path / name / "final" / "model.safetensors")


def test_the_trainer_samples_more_rounds_and_logs_them(tmp_path):
    log, _ = run(tmp_path, "dyn")
    for row in log:
        assert 1 <= row["dynamic_sampling/rounds"] <= 3
        assert row["dynamic_sampling/prompts"] == 4 * row["dynamic_sampling/rounds"]
        # half the prompts carry a signal: 4 groups need about two rounds, never more than 3
        assert row["dynamic_sampling/groups_with_signal"] <= 4
        assert row["dynamic_sampling/rounds"] == 3 or row["dynamic_sampling/groups_with_signal"] == 4
    assert any(row["dynamic_sampling/rounds"] > 1 for row in log)


def test_a_resumed_dynamic_sampling_run_is_the_uninterrupted_one(tmp_path):
    straight_log, straight = run(tmp_path, "straight")
    run(tmp_path, "resumed", max_steps=2)
    resumed_log, resumed = run(tmp_path, "resumed", resume_from="latest")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    keys = ("dynamic_sampling/rounds", "dynamic_sampling/prompts", "dynamic_sampling/groups_with_signal", "reward")
    assert [[r[k] for k in keys] for r in resumed_log] == [[r[k] for k in keys] for r in straight_log]
