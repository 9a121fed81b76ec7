"""The algorithm catalogue inside a real step on the tiny model: sampler log-probs, entropy, the new metrics,
rewards that do not apply, the trainer's step in rewards, and every variant running end to end."""

import json
import math

import pytest
import torch

from forge import GRPOConfig, GRPOTrainer
from forge.core.logprobs import token_logprobs_from_logits
from forge.core.logprobs import completion_logprobs
from forge.core.rollout import SamplingSettings, generate

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


def alternating(prompts, completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def fast_config(tmp_path, **overrides) -> GRPOConfig:
    values = {"preflight": "off", "group_size": 4, "max_new_tokens": 6, "gradient_accumulation_steps": 1, "learning_rate": 1e-2,
              "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1, "save_steps": 0,
              "output_dir": str(tmp_path / "run"), "kl_beta": 0.0}
    return GRPOConfig(**(values | overrides))


def one_step(trainer, rows) -> dict:
    """Train one optimizer step on `rows`; the metrics it logged."""
    trainer.train(rows)
    with open(f"{trainer.config.output_dir}/training_log.jsonl") as log:
        return json.loads(log.read().splitlines()[-1])


def test_generation_records_the_sampler_logprob_of_every_sampled_token(tiny_model, tiny_tokenizer):
    torch.manual_seed(0)
    settings = SamplingSettings(max_new_tokens=8, temperature=0.7)
    rollout = generate(tiny_model, tiny_tokenizer, ["What is 2 + 3?", "Tom has"], 3, settings)
    with torch.no_grad():
        trainer = completion_logprobs(tiny_model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                      rollout.prompt_index, temperature=0.7)
    mask = rollout.completion_mask.bool()
    assert rollout.sampler_logprobs.shape == rollout.completion_ids.shape
    assert torch.equal(rollout.sampler_logprobs[~mask], torch.zeros(int((~mask).sum())))  # 0 on padding
    gap = (rollout.sampler_logprobs - trainer).abs()[mask]
    assert gap.max() < 1e-4  # the same network in fp32: decode-time and loss-time log-probs agree
    assert (rollout.sampler_logprobs[mask] < 0).all()


def test_completion_logprobs_returns_the_entropy_of_the_same_pass(tiny_model, tiny_tokenizer):
    rollout = generate(tiny_model, tiny_tokenizer, ["What is 2 + 3?"], 2, SamplingSettings(max_new_tokens=5))
    with torch.no_grad():
        logprobs, entropy = completion_logprobs(tiny_model, rollout.prompt_ids, rollout.prompt_mask,
                                                rollout.completion_ids, rollout.prompt_index, temperature=0.9,
                                                with_entropy=True)
        plain = completion_logprobs(tiny_model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.prompt_index, temperature=0.9)
        # the entropy of the full-sequence distribution, computed independently with torch.distributions
        ids = torch.cat([rollout.prompt_ids[rollout.prompt_index], rollout.completion_ids], dim=1)
        logits = tiny_model(ids).logits[:, rollout.prompt_ids.shape[1] - 1:-1] / 0.9
        expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.equal(logprobs, plain)  # asking for the entropy changes no log-prob
    torch.testing.assert_close(entropy, expected, atol=1e-4, rtol=0)
    _, full_entropy = token_logprobs_from_logits(logits * 0.9, rollout.completion_ids, 0.9, with_entropy=True)
    torch.testing.assert_close(full_entropy, expected, atol=1e-5, rtol=0)


def test_a_step_logs_the_new_metrics(tiny_model, tiny_tokenizer, tmp_path):
    config = fast_config(tmp_path, prompts_per_step=2, max_steps=1)
    def constant(prompts, completions):
        return [1.0] * len(completions)

    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, reward_fn=[alternating, constant], config=config)
    metrics = one_step(trainer, ROWS[:2])
    assert metrics["entropy"] > 0
    assert 0 <= metrics["sampling/sampling_logp_difference/mean"] <= metrics["sampling/sampling_logp_difference/max"] < 1e-4
    assert "frac_zero_std_groups" not in metrics  # the number once, under TRL's name
    assert metrics["rewards/alternating/std"] == pytest.approx(torch.tensor([0.0, 1.0] * 4).std().item())
    assert metrics["rewards/constant/std"] == 0.0
    assert "completions/mean_terminated_length" in metrics
    assert metrics["clip_frac_capped"] == 0.0
    assert "sampling/importance_sampling_ratio/mean" not in metrics  # only logged when rollout_is is on


def test_rewards_that_do_not_apply_get_no_advantage(tiny_model, tiny_tokenizer, tmp_path):
    # samples 0 and 1 of each group of 4 get None: only 2 and 3 are scored ([0, 1] -> advantages -a, +a)
    def half(prompts, completions):
        return [None if i % 4 < 2 else float(i % 2) for i in range(len(completions))]

    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, reward_fn=half, config=fast_config(tmp_path))
    batch, stats = trainer.collect(ROWS[:1])
    a = 0.5 / (2 ** -0.5 + 1e-4)
    torch.testing.assert_close(batch.advantages[0], torch.tensor([0.0, 0.0, -a, a]))
    assert stats.valid[0].tolist() == [False, False, True, True]


def test_rewards_receive_the_trainer_step(tiny_model, tiny_tokenizer, tmp_path):
    seen = []

    def curriculum(prompts, completions, trainer_state):
        seen.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.device.type))
        return [float(i % 2) for i in range(len(completions))]

    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, reward_fn=curriculum, config=fast_config(tmp_path, max_steps=2))
    trainer.train(ROWS)
    assert seen == [(0, 2, "cpu"), (1, 2, "cpu")]


@pytest.mark.parametrize("overrides", [
    {"loss_type": "cispo", "clip_epsilon_high": 4.0},
    {"loss_type": "sapo"},
    {"clip_ratio_c": 3.0, "num_iterations": 2},
    {"delta": 4.0, "num_iterations": 2},
    {"kl_beta": 0.05, "kl_loss_type": "k2"},
    {"scale_rewards": "rloo"},
    {"scale_rewards": "reinforce_plus_plus_baseline"},
    {"multi_objective_aggregation": "normalize_then_sum"},
    {"top_entropy_quantile": 0.2},
    {"entropy_coef": 0.01},
    {"rollout_is": "token_truncate"},
    {"rollout_is": "sequence_mask", "rollout_is_threshold": 2.0},
    {"kl_beta": 0.05, "kl_bias_correction": True},
    {"off_policy_mask_threshold": 0.1, "num_iterations": 2},
])
def test_every_variant_trains(tiny_model, tiny_tokenizer, tmp_path, overrides):
    before = [p.detach().clone() for p in tiny_model.parameters()]
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, reward_fn=[alternating, lambda p, c: [0.5] * len(c)],
                          config=fast_config(tmp_path, max_steps=overrides.get("num_iterations", 1), **overrides))
    metrics = one_step(trainer, ROWS[:1])
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))  # no NaN anywhere
    assert any(not torch.equal(p, q) for p, q in zip(before, tiny_model.parameters()))
    if overrides.get("rollout_is"):
        assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)  # same network: w ~ 1
