"""rollout_slices > 1 (core/rollout_slices.py): one rollout, advantages over all of it, cut into optimizer steps
that each train on a slice of its completions.

The gradient of a slice's optimizer step is derived here by hand, with the model's own forward (not Forge's
log-prob code): on the first slice the policy is the one that sampled, so the clipped ratio is 1 and the
gradient of the loss is that of the surrogate -sum_i A_i sum_t log pi(o_it) / normaliser over the slice's
completions i, with A_i the whole group's advantages: (r_i - mean_G r) / (std_G r + eps), std Bessel-corrected,
and the normaliser that TRL 1.16's _compute_loss uses for the loss type (grpo: the slice's completions, each
length-normalised; dr_grpo: the slice's completions x max_completion_length; dapo: the rollout's tokens / the
slices, TRL's num_items_in_batch rescaled by gradient_accumulation_steps / steps_per_generation).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback

from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model

ROWS = [{"prompt": "What is 2 + 3?"}, {"prompt": "Name a color."}, {"prompt": "Count to three."},
        {"prompt": "Say yes."}, {"prompt": "the a an is"}, {"prompt": "What is 12 + 7?"}]


def config(tmp_path, **overrides) -> GRPOConfig:
    values = {"group_size": 4, "prompts_per_step": 2, "gradient_accumulation_steps": 1, "rollout_slices": 2,
              "max_new_tokens": 6, "learning_rate": 1e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0,
              "logging_steps": 1, "save_steps": 0, "kl_beta": 0.0, "preflight": "off",
              "output_dir": str(tmp_path / "run")}
    return GRPOConfig(**(values | overrides))


def length_reward(prompts, completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


# --------------------------------------------------------------------------------------------------
# the gradient of a slice's optimizer step


def hand_completion_logprobs(model, rollout, i: int, temperature: float) -> torch.Tensor:
    """(T_i,) log pi(o_it | prompt, o_i<t) of completion i, from one plain forward of its unpadded tokens."""
    p = i // rollout.group_size
    prompt = rollout.prompt_ids[p][rollout.prompt_mask[p].bool()]  # (Lp,)
    length = int(rollout.completion_mask[i].sum())
    completion = rollout.completion_ids[i, :length]  # (T_i,)
    ids = torch.cat([prompt, completion])[None]  # (1, Lp + T_i)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature  # (T_i, V)
    return torch.log_softmax(logits, dim=-1).gather(1, completion[:, None]).squeeze(1)  # (T_i,)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_a_slices_gradient_is_its_completions_loss_with_the_whole_groups_advantages(tmp_path, tiny_tokenizer,
                                                                                    loss_type):
    model, _ = build_tiny_model(tiny_tokenizer, seed=0)
    rewards = []

    def recorded_length(prompts, completions, **kwargs):
        rewards.extend(length_reward(prompts, completions))
        return rewards[-len(completions):]

    trainer = GRPOTrainer(model, tiny_tokenizer, recorded_length, config(tmp_path, loss_type=loss_type))
    trainer.model.eval()
    batch, _ = trainer.collect(ROWS[:2])
    rollout, group = batch.rollouts[0], 4
    # The tiny model rarely stops early: give the completions 1..6 loss tokens (as tool results or a mask would),
    # 25 in all, so that no slice's own token count is the rollout's / 2 and the sequence mean weighs each length
    kept = torch.tensor([1, 2, 3, 4, 5, 6, 1, 3])  # (N,)
    assert bool((rollout.completion_mask.sum(dim=1) >= kept).all())
    batch.loss_mask[0] = batch.loss_mask[0] * (torch.arange(6)[None, :] < kept[:, None])  # (N, T)
    first, second = trainer.cut(batch)
    slice_rows = first.loss_indices[0].tolist()
    assert len(slice_rows) == 4 and sorted(slice_rows + second.loss_indices[0].tolist()) == list(range(8))

    # The advantages of the whole groups, by hand
    r = torch.tensor(rewards).view(2, group)  # (P, G)
    advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()  # (N,)
    assert r.std(1).min() > 0  # every group carries a signal: a wrong advantage would show
    torch.testing.assert_close(batch.advantages[0], advantages)

    grads = []
    trainer.scheduler = SimpleNamespace(step=lambda: None)
    trainer.guard.step = lambda *args, **kwargs: grads.append(
        [p.grad.detach().clone() for p in trainer.trainable]) or 0.0
    trainer.update(first)  # the first slice's optimizer step; its gradient as clipped and stepped

    lengths = kept.float()  # (N,) loss tokens
    temperature = trainer.config.temperature
    surrogate = {i: advantages[i] * hand_completion_logprobs(model, rollout, i, temperature)[:kept[i]].sum()
                 for i in slice_rows}  # A_i sum_t log pi(o_it), over its loss tokens
    if loss_type == "grpo":
        loss = -sum(surrogate[i] / lengths[i] for i in slice_rows) / len(slice_rows)
    elif loss_type == "dr_grpo":
        loss = -sum(surrogate.values()) / (len(slice_rows) * trainer.config.max_new_tokens)
    else:  # dapo: the rollout's tokens shared by its 2 slices, not this slice's own count
        loss = -sum(surrogate.values()) / (lengths.sum() / 2)
    for p in trainer.trainable:
        p.grad = None
    loss.backward()
    for got, param in zip(grads[0], trainer.trainable):
        torch.testing.assert_close(got, param.grad, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# steps, log rows, num_iterations, checkpoints and resume


def test_slices_are_optimizer_steps_in_trls_order_with_num_iterations(tmp_path, tiny_model, tiny_tokenizer):
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, length_reward,
                          config(tmp_path, num_iterations=2, max_steps=8, save_steps=3))
    trained, real = [], trainer.loss_and_backward

    def spy(batch, r, indices, normaliser, totals):
        trained.append((trainer.global_step + 1, tuple(indices.tolist())))
        return real(batch, r, indices, normaliser, totals)

    trainer.loss_and_backward = spy
    assert trainer.train(ROWS)["global_step"] == 8  # max_steps counts optimizer steps
    by_step = {step: sorted(i for s, rows in trained if s == step for i in rows) for step in range(1, 9)}
    for start in (1, 5):  # a rollout: slice 0, slice 1, slice 0, slice 1 (TRL's _step % steps_per_generation)
        one, two, three, four = (by_step[start + k] for k in range(4))
        assert len(one) == len(two) == 4 and sorted(one + two) == list(range(8))
        assert (three, four) == (one, two)
    log = read_jsonl(tmp_path / "run" / "training_log.jsonl")
    assert [row["step"] for row in log] == list(range(1, 9))  # one row per optimizer step
    assert [row["step"] for row in log if "reward" in row] == [1, 5]  # the rollout's with its first step
    assert all("loss" in row and "learning_rate" in row and "grad_norm" in row for row in log)
    # save_steps=3 falls inside the first rollout's steps: saved after its last slice, as num_iterations does
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-4", "checkpoint-8"]


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_lands_on_a_rollout_boundary_and_repeats_nothing(tmp_path, tiny_tokenizer):
    def run(name, callbacks=(), **overrides):
        model, _ = build_tiny_model(tiny_tokenizer, seed=0)
        prompts = []

        def reward(prompts_, completions, **kwargs):
            prompts.extend(prompts_[::4])
            return length_reward(prompts_, completions)

        trainer = GRPOTrainer(model, tiny_tokenizer, reward, config(tmp_path / name, max_steps=6, save_steps=1,
                                                                    **overrides), callbacks=list(callbacks))
        trainer.train(ROWS)
        return trainer, prompts, read_jsonl(tmp_path / name / "run" / "training_log.jsonl")

    whole, whole_prompts, whole_log = run("whole")
    folders = sorted(p.name for p in (tmp_path / "whole" / "run").iterdir() if p.name.startswith("checkpoint-"))
    assert folders == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]  # save_steps=1: between rollouts only

    stopped, first_prompts, _ = run("part", callbacks=[StopAt(2)])
    assert stopped.global_step == 2
    checkpoint = str(tmp_path / "part" / "run" / "checkpoint-2")
    resumed, later_prompts, log = run("part", resume_from=checkpoint)
    assert resumed.global_step == 6
    assert first_prompts + later_prompts == whole_prompts  # each rollout's prompts once, none again
    assert [row["step"] for row in log] == [1, 2, 3, 4, 5, 6]
    for row, expected in zip(log, whole_log):
        assert row["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7), row["step"]
    for name, value in whole.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("overrides, field", [
    ({"rollout_slices": 0}, "rollout_slices"),
    ({"rollout_slices": 3}, "rollout_slices"),  # 8 completions do not cut into 3
    ({"rollout_slices": 2, "max_steps": 3}, "max_steps"),
    ({"rollout_slices": 2, "max_staleness": 1}, "max_staleness"),
    ({"rollout_slices": 2, "dynamic_sampling": True}, "dynamic_sampling"),
    ({"rollout_slices": 2, "fsdp": True}, "fsdp"),
])
def test_what_slices_cannot_do_is_refused_before_any_model_loads(overrides, field):
    with pytest.raises(ValueError, match="invalid GRPOConfig") as error:
        GRPOConfig(**overrides).validate()
    assert field in str(error.value) and str(error.value).count("\n  - ") == 1
