"""GRPOTrainer end to end on the tiny offline model.

What a run leaves behind (weights that moved, training_log.jsonl, samples.jsonl, checkpoints, the console
line), how pi_old and the reference are built in each mode, exact repetition under a seed, how many prompts
and optimizer steps a step takes, every reward form, the DAPO masks, and the input checks that must fail
before any generation. A random tiny model rarely produces a reference answer, so most runs use rewards that
vary inside a group by construction (`alternating`) or by the text (`vowel_count`): the advantages are then
non-zero and the weights do move.
"""

import json
import math
import re
import warnings

import pytest
import torch
from completion_masks import completion_mask_from_ids
from safetensors.torch import load_file

import forge.core.logprobs as logprobs_module
import forge.core.rollout as rollout_module
import forge.core.trainer as trainer_module
from forge import ExactMatchReward, GRPOConfig, GRPOTrainer
from forge.core.logprobs import completion_logprobs
from forge.core.rollout import Rollout
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer

EOS = 2  # the tiny tokenizer's </s>

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)}
        for a, b in [(2, 3), (4, 1), (7, 5), (6, 6), (3, 9), (8, 2), (1, 1), (5, 4)]]

REQUIRED_LOG_KEYS = [
    "step", "epoch", "loss", "reward", "reward_std", "kl", "clip_ratio/region_mean", "clip_ratio/low_mean",
    "clip_ratio/high_mean", "clip_ratio/low_min", "clip_ratio/high_max", "grad_norm", "learning_rate",
    "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
    "completions/mean_terminated_length", "completions/min_terminated_length", "completions/max_terminated_length",
    "num_tokens", "tokens_per_second", "step_time", "generation_share", "param_delta_norm", "frac_reward_zero_std",
    "group_reward_std_mean",
]


def alternating(prompts, completions, **kwargs):
    """1, 0, 1, 0, ...: every group of even size has a non-zero reward std, so every step carries signal."""
    return [float(i % 2) for i in range(len(completions))]


def vowel_count(prompts, completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in text)) for text in completions]


def fast_config(tmp_path, **overrides) -> GRPOConfig:
    """A config that trains the tiny model in well under a second per step and moves its weights."""
    values = {"group_size": 4, "max_new_tokens": 6, "gradient_accumulation_steps": 1, "learning_rate": 1e-2,
              "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1, "save_steps": 0,
              "output_dir": str(tmp_path / "run"), "preflight": "off"}  # these tests count the steps' own calls
    return GRPOConfig(**(values | overrides))


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def count_optimizer_steps(trainer) -> list[int]:
    """Count the trainer's optimizer steps (a step hook); returns the one-element counter."""
    calls = [0]
    trainer.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: calls.__setitem__(0, calls[0] + 1))
    return calls


# ----------------------------------------------------------------------------------------------------
# what a run leaves behind


def test_training_moves_weights_and_writes_logs_samples_checkpoints(tmp_path, tiny_model, tiny_tokenizer, capsys):
    config = fast_config(tmp_path, prompts_per_step=2, max_steps=4, save_steps=2, log_completions=2)
    before = weights(tiny_model)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, [alternating, vowel_count], config)
    result = trainer.train(ROWS)

    assert result == {"global_step": 4}
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())

    run = tmp_path / "run"
    log = read_jsonl(run / "training_log.jsonl")
    assert [row["step"] for row in log] == [1, 2, 3, 4]
    for row in log:
        missing = [key for key in REQUIRED_LOG_KEYS + ["rewards/alternating/mean", "rewards/vowel_count/mean"]
                   if key not in row]
        assert not missing, f"log row lacks {missing}"
        assert all(value is not None and math.isfinite(value) for value in row.values())
        assert row["reward"] == pytest.approx(row["rewards/alternating/mean"] + row["rewards/vowel_count/mean"], abs=1e-5)
        assert 1 <= row["completions/min_length"] <= row["completions/mean_length"] <= row["completions/max_length"] <= 6
        assert 0 <= row["completions/clipped_ratio"] <= 1 and 0 < row["generation_share"] < 1
        assert row["frac_reward_zero_std"] == 0 and row["group_reward_std_mean"] > 0
    assert log[-1]["param_delta_norm"] > log[0]["param_delta_norm"] > 0
    assert [row["epoch"] for row in log] == [0.25, 0.5, 0.75, 1.0]

    samples = read_jsonl(run / "samples.jsonl")
    assert len(samples) == 4 * 2  # log_completions=2 per logged step
    assert {"step", "prompt", "reference", "completion", "reward"} <= set(samples[0])
    assert {s["prompt"] for s in samples} <= {row["prompt"] for row in ROWS}

    for name in ("checkpoint-2", "checkpoint-4", "final"):
        assert (run / name / "COMPLETE").is_file() and (run / name / "model.safetensors").is_file()
    assert not (run / "checkpoint-1").exists() and not (run / "checkpoint-3").exists()
    saved = load_file(run / "final" / "model.safetensors")
    for name, p in trainer.model.named_parameters():
        assert torch.equal(saved[name], p.detach())
    assert json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2

    console = capsys.readouterr().out
    assert re.search(r"^step 1 \| epoch 0\.25 \| loss -?\d+\.\d{4} \| reward \d+\.\d{4} \| kl -?\d+\.\d{4}$",
                     console, re.MULTILINE), console


def test_the_original_quickstart_runs_unchanged(tmp_path, monkeypatch, tiny_model, tiny_tokenizer):
    monkeypatch.chdir(tmp_path)  # the quickstart writes to the default output_dir, ./forge_output
    dataset = [{"prompt": "What is 2+2?", "reference": "4"}, {"prompt": "What is 3+3?", "reference": "6"}]

    # The default max_new_tokens=512 fills the tiny model's whole 512-token context: a clear error up front.
    with pytest.raises(ValueError, match=r"max_new_tokens=512 leaves no room for a prompt .* 512 tokens"):
        GRPOTrainer(model=tiny_model, tokenizer=tiny_tokenizer, reward_fn=ExactMatchReward(),
                    config=GRPOConfig(group_size=4, num_train_epochs=1))

    trainer = GRPOTrainer(model=tiny_model, tokenizer=tiny_tokenizer, reward_fn=ExactMatchReward(),
                          config=GRPOConfig(group_size=4, num_train_epochs=1, max_new_tokens=8))
    # 2 rows, but one optimizer step asks for prompts_per_step x gradient_accumulation_steps = 4: the step
    # uses the 2 there are (with a warning) instead of silently training nothing.
    with pytest.warns(UserWarning, match="dataset has 2 rows"):
        result = trainer.train(dataset)
    assert result["global_step"] == 1
    log = read_jsonl(tmp_path / "forge_output" / "training_log.jsonl")
    assert [row["step"] for row in log] == [1]
    assert "rewards/exact_match/mean" in log[0]
    assert (tmp_path / "forge_output" / "final" / "model.safetensors").is_file()


def test_small_dataset_with_max_steps_finishes(tmp_path, tiny_model, tiny_tokenizer):
    """max_steps > 0 with fewer rows than one optimizer step finishes (each step uses every row)."""
    config = fast_config(tmp_path, gradient_accumulation_steps=4, max_steps=3)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, config)
    with pytest.warns(UserWarning, match="dataset has 3 rows"):
        assert trainer.train(ROWS[:3])["global_step"] == 3


def test_learning_rate_logged_is_the_one_the_step_used(tmp_path, tiny_model, tiny_tokenizer):
    config = fast_config(tmp_path, lr_scheduler="linear", max_steps=2)
    GRPOTrainer(tiny_model, tiny_tokenizer, alternating, config).train(ROWS)
    log = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert [row["learning_rate"] for row in log] == pytest.approx([1e-2, 5e-3])


# ----------------------------------------------------------------------------------------------------
# pi_old and the reference, per mode


def test_full_finetuning_with_kl_keeps_a_frozen_reference_copy(tmp_path, tiny_model, tiny_tokenizer):
    initial = weights(tiny_model)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, fast_config(tmp_path, kl_beta=0.1, max_steps=3))
    reference = trainer.reference_model
    assert reference is not None and reference is not trainer.model
    assert not any(p.requires_grad for p in reference.parameters())
    trainer.train(ROWS)

    for name, p in reference.named_parameters():
        assert torch.equal(p, initial[name]), f"reference weight {name} changed"
    assert any(not torch.equal(p, initial[name]) for name, p in trainer.model.named_parameters())
    log = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert log[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == reference
    assert log[-1]["kl"] > 0


def test_kl_beta_zero_builds_no_reference(tmp_path, tiny_model, tiny_tokenizer):
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, fast_config(tmp_path, kl_beta=0.0, max_steps=2))
    assert trainer.reference_model is None
    batch, _ = trainer.collect(ROWS[:1])
    assert batch.ref_logprobs == [None]
    trainer.train(ROWS)
    assert all(row["kl"] == 0 for row in read_jsonl(tmp_path / "run" / "training_log.jsonl"))


def test_lora_reference_is_the_adapter_disabled_model(tmp_path, monkeypatch, tiny_model, tiny_tokenizer):
    from forge.model import policy

    def no_copy(model):
        raise AssertionError("LoRA must not copy the model for the reference")

    monkeypatch.setattr(policy, "make_reference_model", no_copy)
    config = fast_config(tmp_path, use_lora=True, lora_r=4, lora_alpha=8, kl_beta=0.1, learning_rate=5e-2,
                         max_steps=3)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, config)
    assert trainer.is_lora and trainer.reference_model is None
    trainer.train(ROWS)

    base, _ = build_tiny_model(tiny_tokenizer, seed=0)  # the same weights the adapters sit on
    base_weights = weights(base)
    for name, p in trainer.model.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base_weights[name.replace(".base_layer", "")]), f"base weight {name} changed"

    rollout = trainer.sample_completions([ROWS[0]["prompt"], ROWS[1]["prompt"]])
    reference = trainer.reference_logprobs(rollout)
    mask = rollout.completion_mask.bool()
    with torch.no_grad():
        expected = completion_logprobs(base, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                       rollout.prompt_index, config.temperature)
        policy_logprobs = trainer.logprobs(trainer.model, rollout, torch.arange(mask.shape[0]))
    torch.testing.assert_close(reference[mask], expected[mask], atol=1e-5, rtol=1e-5)
    length = policy_logprobs.shape[1]
    assert not torch.allclose(policy_logprobs[mask[:, :length]], reference[:, :length][mask[:, :length]])


def test_lora_generates_with_merged_adapters_and_trains_the_same(tmp_path, monkeypatch, tiny_tokenizer):
    """merge_lora_for_generation: generation and evaluation run with the adapters folded into the weights; the
    run trains as it does without (same completions and weights up to fp32 rounding), and the base weights are
    the same tensors, unchanged, afterwards."""
    seen, real_decode, original = [], rollout_module.decode, {}

    def spy(model, *args, **kwargs):  # (is q_proj's weight the merged copy?, are the adapters off?)
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        seen.append((layer.base_layer.weight.data_ptr() != original["q_proj"], layer.disable_adapters))
        return real_decode(model, *args, **kwargs)

    # the decode loop, in the step's generation (the decode plan's sampling weights) and the evaluator's
    monkeypatch.setattr(rollout_module, "decode", spy)
    runs = {}
    for merge in (True, False):
        seen.clear()
        model, _ = build_tiny_model(tiny_tokenizer, seed=0)
        config = fast_config(tmp_path / str(merge), use_lora=True, lora_r=4, lora_alpha=8, learning_rate=5e-2,
                             max_steps=3, merge_lora_for_generation=merge, eval_steps=3)
        trainer = GRPOTrainer(model, tiny_tokenizer, alternating, config)
        base = {n: p for n, p in trainer.model.named_parameters() if "base_layer" in n}
        original["q_proj"] = trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.data_ptr()
        base_values = {n: p.detach().clone() for n, p in base.items()}
        trainer.train(ROWS, eval_dataset=ROWS[:2])
        assert seen == [(merge, merge)] * len(seen) and len(seen) > 3  # 3 steps and the evaluations
        for name, p in trainer.model.named_parameters():
            if "base_layer" in name:
                assert p is base[name] and torch.equal(p, base_values[name]), name
        runs[merge] = (weights(trainer.model), read_jsonl(tmp_path / str(merge) / "run" / "samples.jsonl"))
    merged, plain = runs[True], runs[False]
    assert [r["completion"] for r in merged[1]] == [r["completion"] for r in plain[1]]
    for name, value in plain[0].items():
        torch.testing.assert_close(merged[0][name], value, atol=1e-5, rtol=1e-4)


def test_several_updates_per_rollout_compute_pi_old_once(tmp_path, monkeypatch, tiny_model, tiny_tokenizer):
    mu = 3
    config = fast_config(tmp_path, num_iterations=mu, max_steps=2 * mu, kl_beta=0.0, clip_epsilon=0.05,
                         learning_rate=5e-2, micro_batch_size=2)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, vowel_count, config)
    old_results, logprob_calls = [], [0]
    real_old, real_logprobs = trainer.old_logprobs, logprobs_module.completion_logprobs

    def spy_old(rollout, indices=None):
        old_results.append((real_old(rollout, indices), rollout.completion_ids.shape))
        return old_results[-1][0]

    def spy_logprobs(*args, **kwargs):
        logprob_calls[0] += 1
        return real_logprobs(*args, **kwargs)

    monkeypatch.setattr(trainer, "old_logprobs", spy_old)
    monkeypatch.setattr(logprobs_module, "completion_logprobs", spy_logprobs)
    optimizer_steps = count_optimizer_steps(trainer)
    trainer.train([{"prompt": "the a an is"}, {"prompt": "What is 12 + 7?"}])

    assert len(old_results) == 2  # one pi_old forward per rollout batch, reused by all mu updates
    for old, shape in old_results:
        assert isinstance(old, torch.Tensor) and old.shape == shape and not old.requires_grad
    assert optimizer_steps[0] == 2 * mu == trainer.global_step
    # per rollout of 4 completions in micro-batches of 2: 2 pi_old forwards + mu x 2 loss forwards
    assert logprob_calls[0] == 2 * (2 + mu * 2)
    log = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert [row["step"] for row in log] == [1, 2, 3, 4, 5, 6]  # one row per optimizer step, as in TRL
    assert [row["step"] for row in log if "reward" in row] == [1, 4]  # the rollout's with its first update
    assert max(row["clip_ratio/region_mean"] for row in log) > 0  # later updates move off pi_old and get clipped


def test_one_update_per_rollout_needs_no_pi_old_forward(tmp_path, monkeypatch, tiny_model, tiny_tokenizer):
    calls = [0]
    real_logprobs = logprobs_module.completion_logprobs

    def spy_logprobs(*args, **kwargs):
        calls[0] += 1
        return real_logprobs(*args, **kwargs)

    monkeypatch.setattr(logprobs_module, "completion_logprobs", spy_logprobs)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, fast_config(tmp_path, kl_beta=0.0, max_steps=2))
    optimizer_steps = count_optimizer_steps(trainer)
    trainer.train(ROWS)
    assert calls[0] == 2  # the loss forward of each step, nothing else
    assert optimizer_steps[0] == 2
    batch, _ = trainer.collect(ROWS[:1])
    assert batch.old_logprobs == [None]
    assert all(row["ratio_mean"] == pytest.approx(1.0) and row["clip_ratio/region_mean"] == 0
               for row in read_jsonl(tmp_path / "run" / "training_log.jsonl"))

    calls[0] = 0  # with a KL term, one reference forward per step is added
    model, _ = build_tiny_model(tiny_tokenizer, seed=0)
    GRPOTrainer(model, tiny_tokenizer, alternating,
                fast_config(tmp_path, kl_beta=0.1, max_steps=2, output_dir=str(tmp_path / "kl"))).train(ROWS)
    assert calls[0] == 4


def test_several_updates_per_rollout_still_cover_the_dataset(tmp_path, tiny_model, tiny_tokenizer):
    """num_train_epochs counts passes over the data: mu updates per rollout must not shorten the pass,
    and save_steps / logging_steps that fall between two rollouts are not skipped."""
    config = fast_config(tmp_path, num_iterations=2, num_train_epochs=1, kl_beta=0.0, save_steps=3, logging_steps=3)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, config)
    seen = []
    real_step = trainer.step
    trainer.step = lambda rows: seen.extend(r["prompt"] for r in rows) or real_step(rows)
    assert trainer.train(ROWS[:4])["global_step"] == 8
    assert sorted(seen) == sorted(row["prompt"] for row in ROWS[:4])
    assert [row["step"] for row in read_jsonl(tmp_path / "run" / "training_log.jsonl")] == [3, 6, 8]
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-4", "checkpoint-6"]


# ----------------------------------------------------------------------------------------------------
# reproducibility


def _seeded_run(tmp_path, tokenizer, seed, name, **overrides):
    model, _ = build_tiny_model(tokenizer, seed=0)
    config = fast_config(tmp_path, seed=seed, max_steps=3, output_dir=str(tmp_path / name), **overrides)
    trainer = GRPOTrainer(model, tokenizer, vowel_count, config)
    trainer.train(ROWS)
    log = read_jsonl(tmp_path / name / "training_log.jsonl")
    samples = [s["completion"] for s in read_jsonl(tmp_path / name / "samples.jsonl")]
    return ([(row["loss"], row["reward"], row["kl"]) for row in log], samples,
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()})


def test_same_seed_repeats_exactly_and_another_seed_differs(tmp_path, tiny_tokenizer):
    log_a, samples_a, weights_a = _seeded_run(tmp_path, tiny_tokenizer, 1, "a")
    log_b, samples_b, weights_b = _seeded_run(tmp_path, tiny_tokenizer, 1, "b")
    assert log_a == log_b and samples_a == samples_b
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)

    _log_c, samples_c, weights_c = _seeded_run(tmp_path, tiny_tokenizer, 2, "c")
    assert samples_c != samples_a
    assert any(not torch.equal(weights_a[k], weights_c[k]) for k in weights_a)


def test_same_seed_repeats_exactly_with_lora(tmp_path, tiny_tokenizer):
    """The LoRA adapters are initialised randomly in GRPOTrainer.__init__: the seed must cover that too."""
    lora = {"use_lora": True, "lora_r": 4, "lora_alpha": 8, "learning_rate": 5e-2}
    log_a, _, weights_a = _seeded_run(tmp_path, tiny_tokenizer, 1, "a", **lora)
    torch.manual_seed(12345)  # whatever the global RNG did in between must not matter
    log_b, _, weights_b = _seeded_run(tmp_path, tiny_tokenizer, 1, "b", **lora)
    assert log_a == log_b
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


# ----------------------------------------------------------------------------------------------------
# batching


def test_gradient_accumulation_consumes_prompts_per_step_times_accumulation(tmp_path, tiny_model, tiny_tokenizer):
    config = fast_config(tmp_path, prompts_per_step=2, gradient_accumulation_steps=2, num_train_epochs=1,
                         group_size=2)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, config)
    generated, step_rows = [], []
    real_generate, real_step = trainer.sample_completions, trainer.step
    trainer.sample_completions = lambda prompts, rows=None: generated.append(list(prompts)) or real_generate(prompts, rows)
    trainer.step = lambda rows: step_rows.append(len(rows)) or real_step(rows)
    optimizer_steps = count_optimizer_steps(trainer)
    trainer.train(ROWS)

    assert step_rows == [4, 4]  # 8 rows / (2 prompts x 2 accumulated rollouts)
    assert optimizer_steps[0] == 2 == trainer.global_step
    assert [len(p) for p in generated] == [2, 2, 2, 2]  # each rollout batch: prompts_per_step prompts
    assert sorted(p for batch in generated for p in batch) == sorted(row["prompt"] for row in ROWS)
    log = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert [row["epoch"] for row in log] == [0.5, 1.0]


# ----------------------------------------------------------------------------------------------------
# reward forms


def test_plain_function_reward(tmp_path, tiny_model, tiny_tokenizer):
    seen = {}

    def references_in_completion(prompts, completions, references):
        seen.update(prompts=list(prompts), references=list(references))
        return [float(ref in text) + len(text) % 3 for ref, text in zip(references, completions)]

    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, references_in_completion, fast_config(tmp_path, max_steps=1))
    trainer.train(ROWS)
    (row,) = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert row["rewards/references_in_completion/mean"] == row["reward"]
    assert len(seen["prompts"]) == 4 and len(set(seen["prompts"])) == 1  # one prompt, group_size copies
    assert len(set(seen["references"])) == 1


def test_list_of_rewards_with_weights(tmp_path, tiny_model, tiny_tokenizer):
    rewards = [alternating, vowel_count, ExactMatchReward()]
    config = fast_config(tmp_path, max_steps=2, reward_weights=[2.0, 0.5, 1.0], prompts_per_step=2)
    GRPOTrainer(tiny_model, tiny_tokenizer, rewards, config).train(ROWS)
    for row in read_jsonl(tmp_path / "run" / "training_log.jsonl"):
        assert row["rewards/alternating/mean"] == pytest.approx(0.5)
        expected = 2.0 * row["rewards/alternating/mean"] + 0.5 * row["rewards/vowel_count/mean"] + row["rewards/exact_match/mean"]
        assert row["reward"] == pytest.approx(expected, abs=1e-5)

    with pytest.raises(ValueError, match="reward_weights has 2 entries for 3 reward functions"):
        GRPOTrainer(tiny_model, tiny_tokenizer, rewards, fast_config(tmp_path, reward_weights=[1.0, 1.0]))


# ----------------------------------------------------------------------------------------------------
# DAPO masks


def finish_odd_rows_early(real_generate):
    """Wrap rollout.generate so that every odd completion ends with EOS after 2 tokens (the random tiny
    model rarely samples EOS by itself): a rollout with both finished and truncated completions."""

    def generate(*args, **kwargs):
        rollout = real_generate(*args, **kwargs)
        ids = rollout.completion_ids.clone()
        ids[1::2, 1] = EOS
        ids[1::2, 2:] = 0
        mask = completion_mask_from_ids(ids, [EOS])
        truncated = mask.all(dim=1) & (ids[:, -1] != EOS)
        return Rollout(rollout.prompt_ids, rollout.prompt_mask, ids, mask, truncated, rollout.group_size,
                       rollout.completions)

    return generate


def test_mask_truncated_completions(tmp_path, monkeypatch, tiny_model, tiny_tokenizer):
    monkeypatch.setattr(trainer_module, "generate", finish_odd_rows_early(trainer_module.generate))
    config = fast_config(tmp_path, mask_truncated_completions=True, prompts_per_step=2, max_steps=2)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, config)
    trainer_module.seed_everything(0)
    batch, _ = trainer.collect(ROWS[:2])
    (rollout,), (loss_mask,) = batch.rollouts, batch.loss_mask
    truncated = rollout.truncated
    assert truncated.any() and not truncated[1::2].any()
    assert loss_mask[truncated].sum() == 0
    assert torch.equal(loss_mask[~truncated], rollout.completion_mask[~truncated])
    assert loss_mask[1].tolist() == [1, 1, 0, 0, 0, 0]  # two tokens, EOS included

    trainer.train(ROWS)
    log = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert len(log) == 2
    assert all(0 < row["completions/clipped_ratio"] <= 0.5 and row["completions/min_length"] <= 2 for row in log)


def test_everything_masked_is_a_no_op_step(tmp_path, tiny_model, tiny_tokenizer):
    """All completions truncated and masked: the step runs, the weights stay, nothing is NaN."""
    config = fast_config(tmp_path, mask_truncated_completions=True, max_new_tokens=2, max_steps=1, kl_beta=0.0)
    before = weights(tiny_model)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, config)
    trainer.train([{"prompt": "0 1 2 3 4 5 6 7 8 9"}])
    (row,) = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert row["completions/clipped_ratio"] == 1.0  # the seeded tiny model samples no EOS in 2 tokens here
    assert row["loss"] == 0 and row["grad_norm"] == 0 and row["param_delta_norm"] == 0
    assert all(torch.equal(before[name], p) for name, p in trainer.model.named_parameters())


def test_a_config_changed_between_steps_changes_sampling_and_the_loss_pass_together(
        tmp_path, tiny_model, tiny_tokenizer):
    """A callback may change the config between steps (a shorter budget, another temperature): the next
    step's sampler, its noise and the loss pass all read the new values."""
    from transformers import TrainerCallback

    class Anneal(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            args.max_new_tokens, args.temperature = 3, 2.5

    config = fast_config(tmp_path, max_new_tokens=6, max_steps=2, mask_truncated_completions=False)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, config, callbacks=[Anneal()])
    assert trainer.max_prompt_length == 512 - 6  # the tiny model's context less the completion budget
    trainer.train([{"prompt": "0 1 2 3 4 5 6 7 8 9"}])
    assert trainer.max_prompt_length == 512 - 3
    first, second = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert first["completions/max_length"] == 6 and second["completions/max_length"] == 3  # the new budget
    # the sampler's log-probs (temperature 2.5) are the loss pass's: at the build's 0.9 they would differ by ~1
    assert second["sampling/sampling_logp_difference/max"] < 1e-4


def test_drop_zero_std_groups(tmp_path, tiny_model, tiny_tokenizer):
    def flat_for_flat_prompts(prompts, completions, **kwargs):
        return [1.0 if "flat" in prompt else float(i % 2) for i, prompt in enumerate(prompts)]

    rows = [{"prompt": "flat yes"}, {"prompt": "the total"}]
    config = fast_config(tmp_path, drop_zero_std_groups=True, prompts_per_step=2, max_steps=2, shuffle=False)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, flat_for_flat_prompts, config)
    batch, _ = trainer.collect(rows)
    (rollout,), (loss_mask,), (advantages,) = batch.rollouts, batch.loss_mask, batch.advantages
    assert loss_mask[:4].sum() == 0  # the flat group is out of the loss
    assert torch.equal(loss_mask[4:], rollout.completion_mask[4:])
    assert torch.equal(advantages[:4], torch.zeros(4)) and advantages[4:].abs().min() > 0

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(rows)
    assert not [w for w in caught if "identical rewards" in str(w.message)]  # half flat: under the 75% bar
    log = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert all(row["frac_reward_zero_std"] == 0.5 for row in log)


def test_the_loss_pass_runs_no_forward_on_rows_without_loss(tmp_path, tiny_model, tiny_tokenizer):
    """micro_batch_size=0 (the whole batch at once): the dropped group's rows are not in the gradient forward."""
    def flat_for_flat_prompts(prompts, completions, **kwargs):
        return [1.0 if "flat" in prompt else float(i % 2) for i, prompt in enumerate(prompts)]

    rows = [{"prompt": "flat yes"}, {"prompt": "the total"}, {"prompt": "flat no"}]
    config = fast_config(tmp_path, drop_zero_std_groups=True, prompts_per_step=3, max_steps=1, shuffle=False,
                         micro_batch_size=0)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, flat_for_flat_prompts, config)
    rows_per_forward = []
    hook = trainer.model.get_decoder().register_forward_pre_hook(  # the decoder runs in every forward
        lambda module, args, kwargs: rows_per_forward.append(kwargs["input_ids"].shape[0])
        if torch.is_grad_enabled() else None, with_kwargs=True)
    trainer.train(rows)  # one step: sampling (no gradients), then the loss pass
    hook.remove()
    # only "the total"'s group of 4 (its prompt once, then its 4 completions), never the 8 flat rows
    assert rows_per_forward and max(rows_per_forward) == 4, rows_per_forward


@pytest.mark.parametrize("value", [0.7, 100.3])
def test_drop_zero_std_groups_drops_groups_of_equal_inexact_rewards(value, tmp_path, tiny_model, tiny_tokenizer):
    """A group of eight 0.7s has a float32 std of ~6e-8, not 0: it must still count as flat and be dropped."""
    def flat_for_flat_prompts(prompts, completions, **kwargs):
        return [value if "flat" in prompt else float(i % 2) for i, prompt in enumerate(prompts)]

    rows = [{"prompt": "flat yes"}, {"prompt": "the total"}]
    config = fast_config(tmp_path, drop_zero_std_groups=True, group_size=8, prompts_per_step=2, max_steps=1,
                         shuffle=False)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, flat_for_flat_prompts, config)
    batch, _ = trainer.collect(rows)
    (loss_mask,), (advantages,) = batch.loss_mask, batch.advantages
    assert loss_mask[:8].sum() == 0 and loss_mask[8:].sum() > 0
    assert torch.equal(advantages[:8], torch.zeros(8))
    trainer.train(rows)
    (row,) = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert row["frac_reward_zero_std"] == 0.5


def test_a_nonfinite_reward_sample_is_left_out_of_its_group_statistics(tmp_path, tiny_model, tiny_tokenizer):
    def one_nan(prompts, completions, **kwargs):
        return [1.0, 0.0, float("nan"), 1.0]

    config = fast_config(tmp_path, on_reward_error="score", max_steps=1)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, one_nan, config)
    batch, stats = trainer.collect(ROWS[:1])
    # statistics of [1, 0, 1]: mean 2/3, Bessel std sqrt(1/3); A = (r - 2/3) / (0.577350 + 1e-4)
    scale = math.sqrt(1 / 3) + 1e-4
    expected = torch.tensor([1 / 3 / scale, -2 / 3 / scale, 0.0, 1 / 3 / scale])  # [0.57725, -1.15450, 0, 0.57725]
    torch.testing.assert_close(batch.advantages[0], expected, atol=1e-6, rtol=0)
    assert batch.loss_mask[0][2].sum() == 0 and batch.loss_mask[0][[0, 1, 3]].sum() > 0
    assert stats.nonfinite == 1


def test_pi_old_is_the_sampling_policy_and_the_first_update_has_ratio_one(tmp_path, tiny_model, tiny_tokenizer):
    """num_iterations > 1: pi_old must be the weights that sampled, not those after the first optimizer step."""
    import copy

    config = fast_config(tmp_path, num_iterations=3, max_steps=3, kl_beta=0.0, learning_rate=5e-2,
                         micro_batch_size=2, prompts_per_step=2)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, vowel_count, config)
    sampler = copy.deepcopy(trainer.model)  # the policy as it samples the first rollout
    collected, updates = [], []
    real_collect, real_update = trainer.collect, trainer.update
    trainer.collect = lambda rows: collected.append(real_collect(rows)) or collected[-1]
    trainer.update = lambda batch: updates.append(real_update(batch)) or updates[-1]
    trainer.train(ROWS[:2])

    (batch, _), = collected
    (rollout,), (old,) = batch.rollouts, batch.old_logprobs
    with torch.no_grad():
        expected = completion_logprobs(sampler, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                       rollout.prompt_index, config.temperature)
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(old[mask], expected[mask], atol=1e-5, rtol=1e-5)
    assert len(updates) == 3
    assert updates[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and updates[0]["clip_ratio/region_mean"] == 0
    assert abs(updates[2]["ratio_mean"] - 1.0) > 1e-4  # later updates do move off pi_old


# ----------------------------------------------------------------------------------------------------
# bad inputs fail before any generation


def _chat_tokenizer_without_template():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("empty dataset", "dataset is empty"),
        ("row without prompt", r"dataset row 1 has no 'prompt' key"),
        ("chat prompt, no chat template", "needs a tokenizer with a chat template"),
        ("prompt over max_prompt_length", r"dataset rows 0\.\.1: prompt 1 has \d+ tokens, over max_prompt_length=8"),
        ("output_dir is a file", "is a file; choose a directory path"),
    ],
)
def test_bad_inputs_fail_before_training(case, match, tmp_path, monkeypatch, tiny_model, tiny_tokenizer):
    def no_generation(*args, **kwargs):
        raise AssertionError("generation started before the input check")

    monkeypatch.setattr(trainer_module, "generate", no_generation)
    tokenizer, rows, overrides = tiny_tokenizer, [{"prompt": "What is 1 + 1?"}, {"prompt": "yes"}], {}
    if case == "empty dataset":
        rows = []
    elif case == "row without prompt":
        rows = [{"prompt": "yes"}, {"question": "What is 1 + 1?"}]
    elif case == "chat prompt, no chat template":
        tokenizer = _chat_tokenizer_without_template()
        rows = [{"prompt": [{"role": "user", "content": "What is 1 + 1?"}]}]
    elif case == "prompt over max_prompt_length":
        rows = [{"prompt": "yes"}, {"prompt": "What is 12 + 7? Answer: 19 and the total is"}]
        overrides = {"max_prompt_length": 8}
    elif case == "output_dir is a file":
        (tmp_path / "taken").write_text("not a directory")
        overrides = {"output_dir": str(tmp_path / "taken")}
    before = weights(tiny_model)
    trainer = GRPOTrainer(tiny_model, tokenizer, alternating, fast_config(tmp_path, max_steps=1, **overrides))
    with pytest.raises(ValueError, match=match):
        trainer.train(rows)
    assert trainer.global_step == 0
    assert all(torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
    assert not (tmp_path / "run" / "training_log.jsonl").exists()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"group_size": 1}, "group_size=1: GRPO needs >= 2 completions per prompt"),
        ({"max_prompt_length": 510, "max_new_tokens": 8}, "exceeds the model's context of 512 tokens"),
        ({"loss_type": "ppo"}, "loss_type='ppo' unknown"),
    ],
)
def test_bad_config_fails_in_the_constructor(overrides, match, tmp_path, tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match=match):
        GRPOTrainer(tiny_model, tiny_tokenizer, alternating, fast_config(tmp_path, **overrides))
    assert not (tmp_path / "run").exists()


def test_missing_reward_or_tokenizer(tmp_path, tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="needs reward_fn"):
        GRPOTrainer(tiny_model, tiny_tokenizer, None, fast_config(tmp_path))
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        GRPOTrainer(tiny_model, None, alternating, fast_config(tmp_path))


def test_rows_without_a_loss_token_get_no_reference_pass(tiny_model, tiny_tokenizer, tmp_path):
    """With flat groups dropped, their completions cost no reference forward (0 in its place); the rows in the
    loss get the log-probs that a pass over every row gives them."""
    def by_kind(prompts, completions, kind, **kwargs):
        return [float(i % 2) if k == "mixed" else 0.0 for i, k in enumerate(kind)]

    config = fast_config(tmp_path, kl_beta=0.1, drop_zero_std_groups=True, prompts_per_step=2, max_steps=1)
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, by_kind, config)
    rows = [{"prompt": "What is 2 + 3?", "kind": "flat"}, {"prompt": "What is 4 + 1?", "kind": "mixed"}]
    batch, _ = trainer.collect(rows)
    assert batch.loss_indices[0].tolist() == [4, 5, 6, 7]  # the mixed group's completions
    every_row = trainer.reference_logprobs(batch.rollouts[0])
    assert (batch.ref_logprobs[0][:4] == 0).all() and (every_row[:4] != 0).any()
    torch.testing.assert_close(batch.ref_logprobs[0][4:], every_row[4:], atol=1e-6, rtol=0)
