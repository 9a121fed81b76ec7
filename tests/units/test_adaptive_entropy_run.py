"""Adaptive entropy control in a real run on the tiny model: the logged coefficient follows the rule, a resumed run
goes on with the controller's state (bitwise the same weights), and a bonus gated off leaves the run as without one."""

import json

import pytest
import torch
from safetensors.torch import load_file

from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


def alternating(prompts, completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def train(tmp_path, name, **overrides):
    values = {"preflight": "off", "group_size": 4, "max_new_tokens": 6, "gradient_accumulation_steps": 1,
              "prompts_per_step": 2, "learning_rate": 1e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0,
              "logging_steps": 1, "save_steps": 1, "max_steps": 4, "kl_beta": 0.0, "seed": 5,
              "output_dir": str(tmp_path / name)}
    model, tokenizer = build_tiny_model()
    GRPOTrainer(model, tokenizer, alternating, GRPOConfig(**(values | overrides))).train(ROWS)
    log = [json.loads(line) for line in (tmp_path / name / "training_log.jsonl").read_text().splitlines()]
    return [row["entropy_coef"] for row in log if "entropy_coef" in row], load_file(tmp_path / name / "final" /
                                                                                     "model.safetensors")


ADAPTIVE = {"adaptive_entropy": True, "entropy_coef": 0.01, "entropy_coef_delta": 0.5, "entropy_target": 100.0}


def test_the_coefficient_rises_while_entropy_is_under_target_and_a_resumed_run_goes_on_from_it(tmp_path):
    # Token entropy of the tiny model is far under 100 nats: step 1 applies 0 (no entropy known), then the
    # coefficient climbs by 0.5 a step from 0.01 and is held at entropy_coef_max 1.0: 0, 0.51, 1.0, 1.0.
    coefs, straight = train(tmp_path, "straight", **ADAPTIVE)
    assert coefs == pytest.approx([0.0, 0.51, 1.0, 1.0])
    train(tmp_path, "resumed", **ADAPTIVE, max_steps=2)
    coefs, resumed = train(tmp_path, "resumed", **ADAPTIVE, resume_from="latest")
    assert coefs == pytest.approx([0.0, 0.51, 1.0, 1.0])
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    state = json.loads((tmp_path / "resumed" / "checkpoint-2" / "trainer_state.json").read_text())["entropy_control"]
    assert state["coef"] == pytest.approx(1.0) and 0 < state["last_entropy"] < 100


def test_a_target_never_reached_keeps_the_bonus_off(tmp_path):
    coefs, gated = train(tmp_path, "gated", **(ADAPTIVE | {"entropy_target": 1e-6}))
    assert coefs == [0.0, 0.0, 0.0, 0.0]
    _, plain = train(tmp_path, "plain")
    assert all(torch.equal(gated[k], plain[k]) for k in plain)
