"""The reading edition (forge/nano.py) computes what the engine computes.

GRPOTrainer.train with its defaults (loss_type="grpo", scale_rewards="group", k3 KL, linear warmup then
cosine decay, AdamW, gradient clipping), fp32, one process, on the tiny offline model: LoRA, full fine-tuning,
and full fine-tuning with two updates per rollout (where pi_old differs from pi_theta and the clip acts).
Each step's rollout (the engine's own samples), rewards, loss and clipped gradient are recorded; nano then
takes its steps from the same initial weights on the same rollouts and rewards.

The engine computes the log-probs by another route (a cache expanded by index, a chunked log-softmax, the
completions cut to the longest), so the two agree to fp32 rounding, not to the bit, within these tolerances:

    every step's loss               relative 1e-3       (measured: equal to the bit, or 5.9e-4 at step 3)
    every step's clipped gradient   ||g_nano - g_engine|| <= 1e-5 ||g_engine||       (measured: <= 2e-6)
    the weights after the run       ||W_nano - W_engine|| <= 3e-4 ||W_engine - W_0|| (measured: <= 3e-5)

The weights are compared relative to how far training moved them: AdamW divides each gradient element by the
root of its own running square, which turns the rounding of a near-zero element into a visible part of the
learning rate. The loss follows them: with one update per rollout its policy term is the advantages' mean
(about 0), so the loss is the KL term, which grows with the square of how far the weights moved from the
reference, and a step's weights differing by r of that movement change it by up to 2r (on the AVX2-only EPYC,
whose kernels round otherwise, 5.9e-4 at the third step of the LoRA run). A real difference in the math fails at least one check by far; the perturbation test changes
one such detail in nano at a time and checks that the comparison fails. nano's sampler is held against the
engine's too: greedy decoding of the same prompts (each prefilled once, its cache copied to its group) gives
the same tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from forge import GRPOConfig, GRPOTrainer, nano
from forge.core.advantages import compute_group_advantages
from forge.core.rollout import SamplingSettings, generate, tokenize_prompts
from forge.model.tiny import build_tiny_model

STEPS, GROUP, PROMPTS, MAX_NEW = 3, 4, 2, 10
STOP_TOKENS = list(range(100, 140))  # an eighth of the tiny vocabulary ends a completion: lengths 1..MAX_NEW
ROWS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6), (3, 9), (8, 2)]]
SETTINGS = {"group_size": GROUP, "max_steps": STEPS, "max_new_tokens": MAX_NEW, "learning_rate": 1e-2,
            "kl_beta": 0.05, "warmup_ratio": 0.5, "seed": 3}  # warmup: int(0.5 * 3) = 1 step
LORA = {"use_lora": True, "lora_r": 4, "lora_alpha": 8}
RUNS = {
    "lora": LORA,
    "full": {"use_lora": False},  # the reference is a frozen copy
    "full, 2 updates per rollout": {"use_lora": False, "num_iterations": 2, "max_steps": 4},  # the clip acts
}
LOSS_RTOL, GRADIENT_RTOL, WEIGHTS_RTOL = 1e-3, 1e-5, 3e-4


def tiny_model():
    model, tokenizer = build_tiny_model(seed=0)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *STOP_TOKENS]
    return model, tokenizer


def vowel_count(prompts, completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in text)) for text in completions]


def recording_gradients(optimizer) -> list[list[torch.Tensor]]:
    """The gradients each optimizer step applies (after clipping), step by step."""
    steps = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: steps.append(
        [p.grad.detach().clone() for group in opt.param_groups for p in group["params"]]))
    return steps


def trainable_weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def engine_run(tmp_path, run: dict) -> dict:
    """Train the engine, recording what each step sampled, scored, lost and applied."""
    model, tokenizer = tiny_model()
    config = GRPOConfig(**(SETTINGS | run), prompts_per_step=PROMPTS,
                        gradient_accumulation_steps=1, dtype="float32", preflight="off", logging_steps=1,
                        save_steps=0, output_dir=str(tmp_path / "engine"))
    trainer = GRPOTrainer(model, tokenizer, vowel_count, config)
    run = {"initial": trainable_weights(trainer.model), "rollouts": [], "rewards": [], "losses": [],
           "gradients": recording_gradients(trainer.optimizer)}
    collect, score, update = trainer.collect, trainer.score, trainer.update

    def recording_collect(rows):
        batch, stats = collect(rows)
        run["rollouts"] += [nano.Rollout(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
                            for r in batch.rollouts]
        return batch, stats

    def recording_score(rows, rollout):
        scores = score(rows, rollout)
        run["rewards"].append(scores.total.clone())
        return scores

    def recording_update(batch):
        metrics = update(batch)
        run["losses"].append(metrics["loss"])
        return metrics

    trainer.collect, trainer.score, trainer.update = recording_collect, recording_score, recording_update
    trainer.train(ROWS)
    return run | {"weights": trainable_weights(trainer.model)}


def nano_run(run: dict, rollouts, rewards) -> dict:
    """nano's steps from the same initial weights on the engine's rollouts and rewards."""
    model, _ = tiny_model()
    config = nano.Config(**(SETTINGS | run), temperature=0.9)
    model, reference, optimizer, scheduler = nano.prepare(model.eval(), config)
    run = {"initial": trainable_weights(model), "losses": [], "gradients": recording_gradients(optimizer)}
    for rollout, reward in zip(rollouts, rewards, strict=True):
        stats = nano.update(model, reference, optimizer, scheduler, rollout, reward, config)
        run["losses"] += [update["loss"] for update in stats]
    return run | {"weights": trainable_weights(model)}


def norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def disagreements(engine: dict, reading: dict) -> list[str]:
    """What differs beyond the tolerances (an empty list: the two agree)."""
    assert engine["weights"].keys() == reading["weights"].keys()
    found = []
    if reading["losses"] != pytest.approx(engine["losses"], rel=LOSS_RTOL, abs=1e-9):
        found.append(f"losses {reading['losses']} vs the engine's {engine['losses']}")
    for step, (mine, theirs) in enumerate(zip(reading["gradients"], engine["gradients"], strict=True), 1):
        gap = norm(a - b for a, b in zip(mine, theirs)) / norm(theirs)
        if gap > GRADIENT_RTOL:
            found.append(f"step {step}: gradients differ by {gap:.1e} of their norm")
    names = list(engine["weights"])
    moved = norm(engine["weights"][k] - engine["initial"][k] for k in names)
    gap = norm(reading["weights"][k] - engine["weights"][k] for k in names) / moved
    if gap > WEIGHTS_RTOL:
        found.append(f"weights differ by {gap:.1e} of how far they moved")
    return found


@pytest.fixture(scope="module", params=sorted(RUNS))
def engine_steps(request, tmp_path_factory):
    run = RUNS[request.param]
    return run, engine_run(tmp_path_factory.mktemp("engine"), run)


def test_nano_takes_the_engines_steps(engine_steps):
    run, engine = engine_steps
    settings = SETTINGS | run
    assert len(engine["rollouts"]) * settings.get("num_iterations", 1) == settings["max_steps"]
    assert all(float(r.std()) > 0 for r in engine["rewards"])  # every rollout carries a signal
    lengths = torch.cat([r.completion_mask.sum(dim=1) for r in engine["rollouts"]])
    assert lengths.min() < lengths.max()  # completions of different lengths: the per-completion mean matters
    reading = nano_run(run, engine["rollouts"], engine["rewards"])
    assert all(torch.equal(reading["initial"][k], w) for k, w in engine["initial"].items())  # same start
    assert disagreements(engine, reading) == []


def token_mean_loss(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask, clip_eps, kl_beta):
    mask = completion_mask.float()
    ratio = torch.exp(logprobs - old_logprobs)
    per_token = torch.maximum(-advantages[:, None] * ratio,
                              -advantages[:, None] * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps))
    log_ref_ratio = ref_logprobs - logprobs
    per_token = per_token + kl_beta * (torch.expm1(log_ref_ratio) - log_ref_ratio)
    return (per_token * mask).sum() / mask.sum(), torch.zeros(())


def k1_kl_loss(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask, clip_eps, kl_beta):
    loss, kl = GRPO_LOSS(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask, clip_eps, 0.0)
    k1 = ((logprobs - ref_logprobs) * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)
    return loss + kl_beta * k1.mean(), kl


GRPO_LOSS, GROUP_ADVANTAGES = nano.grpo_loss, nano.group_advantages
CHANGES = {  # one detail of the math changed in nano -> (the name it replaces, the changed function)
    "token mean (DAPO) instead of the mean per completion": ("grpo_loss", token_mean_loss),
    "the k1 KL estimator instead of k3": ("grpo_loss", k1_kl_loss),
    "the loss twice as large": ("grpo_loss", lambda *args: (2 * GRPO_LOSS(*args)[0], GRPO_LOSS(*args)[1])),
    "no clip (with 2 updates per rollout)": (
        "grpo_loss", lambda *args: GRPO_LOSS(*args[:5], math.inf, args[6])),
    "the std divided by G instead of G - 1": (
        "group_advantages", lambda rewards, g, eps: GROUP_ADVANTAGES(rewards, g, eps) * (g / (g - 1)) ** 0.5),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_detail_in_nano_fails_the_comparison(engine_steps, change, monkeypatch):
    run, engine = engine_steps
    if change.startswith("no clip") and run.get("num_iterations", 1) == 1:
        pytest.skip("with one update per rollout the ratio is 1: the clip never acts, in the engine either")
    monkeypatch.setattr(nano, *CHANGES[change])
    assert disagreements(engine, nano_run(run, engine["rollouts"], engine["rewards"])) != []


def test_nano_group_advantages_are_the_engines():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.7, 0.7, 0.7, 0.7, 3.0, -1.0, 2.0, 2.0])  # one group flat
    assert torch.equal(nano.group_advantages(rewards, 4), compute_group_advantages(rewards, 4))


def test_nano_greedy_decoding_gives_the_engines_tokens(tiny_model, tiny_tokenizer):
    """Prompts of different lengths (left padding), each prefilled once and copied to its group of 3."""
    prompts = ["What is 12 + 7?", "Solve step by step. 3 times 4 is", "the answer"]
    prompt_ids, prompt_mask = tokenize_prompts(tiny_tokenizer, prompts, max_prompt_length=10**6)
    settings = SamplingSettings(max_new_tokens=12, do_sample=False, backend="eager")
    engine = generate(tiny_model, tiny_tokenizer, prompts, 3, settings)
    reading = nano.generate(tiny_model, tiny_tokenizer, prompt_ids, prompt_mask, 3, 12, temperature=0.0)
    length = reading.completion_ids.shape[1]
    assert not engine.completion_mask[:, length:].any()
    assert torch.equal(reading.completion_mask, engine.completion_mask[:, :length])
    assert torch.equal(reading.completion_ids * reading.completion_mask,
                       engine.completion_ids[:, :length] * engine.completion_mask[:, :length])
