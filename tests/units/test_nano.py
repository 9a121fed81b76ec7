"""The reading edition (forge/nano.py) computes what Forge's trainer computes, and fails here when it does not.

GRPOTrainer.train with its defaults (loss_type="grpo", scale_rewards="group", k3 KL, linear warmup then
cosine decay, AdamW, gradient clipping), fp32, one process, on the tiny offline model, against nano's own
`train` on the same prompts in the same order: LoRA, LoRA with kl_beta=0 (no reference pass), full
fine-tuning, and full fine-tuning with two updates per rollout (pi_old differs from pi_theta, the clip acts).
Both sample at temperature 0.9 with the same seeded draws, so they must sample the same tokens; 4 optimizer
steps with one warmup step give the rates 1/2, 1, 3/4, 1/4 of the peak, where a linear decay gives 2/3, 1/3.

Forge's trainer computes the log-probs by another route (each prompt once per group, a cache expanded by index,
a chunked log-softmax, the completions cut to the longest), so the two agree to fp32 rounding, not to the
bit. What each comparison allows, and the largest gap measured over the four runs (Intel Xeon with
AMX-BF16, 2 cores, torch 2.13 CPU; the AVX2-only EPYC's kernels round otherwise, hence the margins):

    check             allowed                                                      measured (largest)
    rollouts          as many, each sampled token and each reward equal            equal
    learning rates    relative 1e-12                                               equal
    losses            relative 1e-3 (absolute 1e-7 near 0)                          1.2e-5
    gradients         ||g_nano - g_forge|| <= 5e-5 ||g_forge||, each step         9.8e-6 (full, step 3)
    weights           ||W_nano - W_forge|| <= 1e-3 ||W_forge - W_0||, at the end  7.2e-5 (full)

The weights are compared relative to how far training moved them: AdamW divides each gradient element by the
root of its own running square, which turns the rounding of a near-zero element into a visible part of the
learning rate. The loss follows them: with one update per rollout its policy term is the advantages' mean
(0 up to rounding, hence the absolute floor for kl_beta=0), so the loss is the KL term, which grows with the
square of how far the weights moved from the reference, and a step's weights differing by r of that movement
change it by up to 2r (the AVX2-only EPYC measured 5.9e-4 at the third step of a 3-step LoRA comparison).

A wrong nano fails by far. test_a_wrong_nano_fails_the_comparison edits nano's source one detail at a time
(MUTANTS), trains the edited copy, and requires the check named here to fail on the run named here:

    mutant                                                     run                            check
    the sampler ignores the temperature                        lora                           samples
    each token drawn with its completion's first uniform       lora                           samples
    every rollout drawn from one seed                          lora                           samples
    a linear decay instead of cosine                           lora                           learning rates
    no warmup                                                  lora                           learning rates
    train takes max_steps rollouts, not max_steps // num_it.   full, 2 updates per rollout    rollouts
    the KL term left out (kl_beta ignored)                     full                           losses
    beta fixed at 0.01 whatever kl_beta says                   full                           losses
    the k1 KL estimator instead of k3                          full                           losses
    the KL's log-ratio the other way round                     full                           losses
    the LoRA reference with its adapters on                    lora                           losses
    advantages not divided by the std                          lora, kl_beta=0                gradients
    advantages' eps 10x                                        lora, kl_beta=0                gradients
    the std divided by G instead of G - 1                      lora, kl_beta=0                gradients
    advantages not centred on the group mean                   lora, kl_beta=0                gradients
    a token mean (DAPO) instead of the per-completion mean     lora, kl_beta=0                gradients
    the loss summed over the completions, not averaged         lora, kl_beta=0                gradients
    the log-probs without the temperature                      lora, kl_beta=0                gradients
    the log-probs' logits shifted by one position              lora, kl_beta=0                gradients
    the clip range 1.5x                                        full, 2 updates per rollout    gradients
    no clip                                                    full, 2 updates per rollout    gradients
    the optimistic (min) instead of the pessimistic (max)      full, 2 updates per rollout    gradients
    pi_old = stopgrad(pi_theta) on every update                full, 2 updates per rollout    gradients
    no gradient clipping                                       full                           gradients

Most fail every later check too (a wrong step samples other tokens next). The smallest margin: eps 10x moves
the gradients by 1.6e-3 of their norm, 32x the tolerance.

nano's sampler is held against the trainer's alone too: at temperatures 0 (greedy), 0.7 and 1, the same prompts
(each prefilled once, its cache copied to its group) and the same seeded draws give the same tokens.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from forge import GRPOConfig, GRPOTrainer, nano
from forge.core.grpo import compute_group_advantages
from forge.core.rollout import SamplingSettings, generate, sampling_noise, sampling_seed, tokenize_prompts
from forge.model.tiny import build_tiny_model

GROUP, PROMPTS, MAX_NEW = 4, 2, 10
STOP_TOKENS = list(range(100, 140))  # an eighth of the tiny vocabulary ends a completion: lengths 1..MAX_NEW
ROWS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6), (3, 9), (8, 2)]]
SETTINGS = {"group_size": GROUP, "prompts_per_step": PROMPTS, "max_steps": 4, "max_new_tokens": MAX_NEW,
            "learning_rate": 1e-2, "kl_beta": 0.05, "warmup_ratio": 0.25, "temperature": 0.9,
            "seed": 3}  # warmup: int(0.25 * 4) = 1 step
ENGINE_NAMES = {"clip_eps": "clip_epsilon", "advantage_eps": "advantage_epsilon"}  # nano's -> GRPOConfig's
LORA = {"use_lora": True, "lora_r": 4, "lora_alpha": 8}
RUNS = {
    "lora": LORA,
    "lora, kl_beta=0": LORA | {"kl_beta": 0.0},
    "full": {"use_lora": False},  # the reference is a frozen copy
    "full, 2 updates per rollout": {"use_lora": False, "num_iterations": 2, "max_steps": 6},  # the clip acts
}
LOSS_RTOL, LOSS_ATOL, GRADIENT_RTOL, WEIGHTS_RTOL, RATE_RTOL = 1e-3, 1e-7, 5e-5, 1e-3, 1e-12


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


def forge_run(tmp_path, run: dict) -> dict:
    """Train Forge's trainer, recording each step's prompts, samples, rewards, loss, rate and applied gradient."""
    model, tokenizer = tiny_model()
    settings = {ENGINE_NAMES.get(name, name): value for name, value in (SETTINGS | run).items()}
    config = GRPOConfig(**settings, gradient_accumulation_steps=1, dtype="float32",
                        preflight="off", logging_steps=1, save_steps=0, output_dir=str(tmp_path / "forge"))
    trainer = GRPOTrainer(model, tokenizer, vowel_count, config)
    run = {"initial": trainable_weights(trainer.model), "prompts": [], "rollouts": [], "rewards": [],
           "losses": [], "rates": [], "gradients": recording_gradients(trainer.optimizer)}
    collect, score, update = trainer.collect, trainer.score, trainer.update

    def recording_collect(rows):
        batch, stats = collect(rows)
        run["prompts"] += [[row["prompt"] for row in mine] for mine in batch.rows]
        run["rollouts"] += [nano.Samples(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
                            for r in batch.rollouts]
        return batch, stats

    def recording_score(rows, rollout):
        scores = score(rows, rollout)
        run["rewards"].append(scores.total.clone())
        return scores

    def recording_update(batch):
        metrics = update(batch)
        run["losses"].append(metrics["loss"])
        run["rates"].append(metrics["learning_rate"])
        return metrics

    trainer.collect, trainer.score, trainer.update = recording_collect, recording_score, recording_update
    trainer.train(ROWS)
    return run | {"weights": trainable_weights(trainer.model)}


class TrainerPrompts:
    """nano's task on the trainer's prompts, batch by batch in the order the trainer drew them, scored like the
    trainer (vowel_count). A batch asked for past the trainer's last gets its first again: the comparison
    counts the rollouts."""

    def __init__(self, tokenizer, batches: list[list[str]]):
        self.tokenizer, self.batches, self.taken = tokenizer, batches, 0

    def train_batch(self, size: int) -> list[tuple[str, None]]:
        batch = self.batches[self.taken % len(self.batches)]
        self.taken += 1
        assert len(batch) == size
        return [(prompt, None) for prompt in batch]

    def prompts(self, problems) -> tuple[torch.Tensor, torch.Tensor]:
        return tokenize_prompts(self.tokenizer, [prompt for prompt, _ in problems], max_prompt_length=10**6)

    @staticmethod
    def reward(completion: str, answer: None) -> float:
        return vowel_count(None, [completion])[0]


def nano_run(module, run: dict, recorded: dict, monkeypatch) -> dict:
    """`module.train` (nano, or an edited copy of it) on the trainer's prompts, from the same initial weights,
    recording each rollout, its rewards, and each optimizer step's loss, rate and applied gradient."""
    model, tokenizer = tiny_model()
    reading = {"rollouts": [], "rewards": [], "losses": [], "rates": []}
    prepare, score, optimizer_steps = module.prepare, module.score, module.optimizer_steps

    def recording_prepare(model, config):
        prepared = prepare(model, config)
        reading["initial"] = trainable_weights(prepared[0])
        reading["gradients"] = recording_gradients(prepared[2])
        return prepared

    def recording_score(tokenizer, task, rollout, problems, group_size):
        rewards = score(tokenizer, task, rollout, problems, group_size)
        reading["rollouts"].append(rollout)
        reading["rewards"].append(rewards)
        return rewards

    def recording_steps(*args):
        stats = optimizer_steps(*args)
        reading["losses"] += [step["loss"] for step in stats]
        reading["rates"] += [step["lr"] for step in stats]
        return stats

    monkeypatch.setattr(module, "prepare", recording_prepare)
    monkeypatch.setattr(module, "score", recording_score)
    monkeypatch.setattr(module, "optimizer_steps", recording_steps)
    config = module.Config(**(SETTINGS | run))
    trained = module.train(model.eval(), tokenizer, TrainerPrompts(tokenizer, recorded["prompts"]), config)
    return reading | {"weights": trainable_weights(trained)}


def norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def same_samples(mine: nano.Samples, theirs: nano.Samples) -> bool:
    """The same tokens up to each completion's end (nano's rollout stops at the longest completion)."""
    length = mine.completion_ids.shape[1]
    return (torch.equal(mine.prompt_ids, theirs.prompt_ids) and not theirs.completion_mask[:, length:].any()
            and torch.equal(mine.completion_mask, theirs.completion_mask[:, :length])
            and torch.equal(mine.completion_ids * mine.completion_mask,
                            theirs.completion_ids[:, :length] * theirs.completion_mask[:, :length]))


def gaps(recorded: dict, reading: dict) -> dict[str, float]:
    """The largest relative gap of each compared quantity (losses, gradients, weights)."""
    losses = [abs(a - b) / max(abs(b), LOSS_ATOL / LOSS_RTOL)
              for a, b in zip(reading["losses"], recorded["losses"], strict=False)]
    gradients = [norm(a - b for a, b in zip(mine, theirs, strict=True)) / norm(theirs)
                 for mine, theirs in zip(reading["gradients"], recorded["gradients"], strict=False)]
    names = list(recorded["weights"])
    moved = norm(recorded["weights"][k] - recorded["initial"][k] for k in names)
    weights = norm(reading["weights"][k] - recorded["weights"][k] for k in names) / moved
    return {"losses": max(losses, default=0.0), "gradients": max(gradients, default=0.0), "weights": weights}


def disagreements(recorded: dict, reading: dict) -> dict[str, str]:
    """What differs beyond the tolerances, by check (an empty dict: the two agree)."""
    assert recorded["weights"].keys() == reading["weights"].keys()
    found = {}
    if len(reading["rollouts"]) != len(recorded["rollouts"]):
        found["rollouts"] = f"{len(reading['rollouts'])} rollouts, the trainer {len(recorded['rollouts'])}"
    pairs = list(zip(reading["rollouts"], recorded["rollouts"], reading["rewards"], recorded["rewards"]))
    differ = [k for k, (mine, theirs, *rewards) in enumerate(pairs, 1)
              if not (same_samples(mine, theirs) and torch.equal(*rewards))]
    if differ:
        found["samples"] = f"rollouts {differ} sampled other tokens than the trainer's"
    if reading["rates"] != pytest.approx(recorded["rates"], rel=RATE_RTOL):
        found["learning rates"] = f"{reading['rates']} vs the trainer's {recorded['rates']}"
    if reading["losses"] != pytest.approx(recorded["losses"], rel=LOSS_RTOL, abs=LOSS_ATOL):
        found["losses"] = f"{reading['losses']} vs the trainer's {recorded['losses']}"
    measured = gaps(recorded, reading)
    if len(reading["gradients"]) != len(recorded["gradients"]) or measured["gradients"] > GRADIENT_RTOL:
        found["gradients"] = f"gradients differ by up to {measured['gradients']:.1e} of their norm"
    if measured["weights"] > WEIGHTS_RTOL:
        found["weights"] = f"weights differ by {measured['weights']:.1e} of how far they moved"
    return found


@pytest.fixture(scope="module")
def forge_runs(tmp_path_factory):
    """Every run's trainer steps, made once when a test first asks for one."""
    made = {}

    def steps(name: str) -> dict:
        if name not in made:
            made[name] = forge_run(tmp_path_factory.mktemp("forge"), RUNS[name])
        return made[name]

    return steps


@pytest.fixture(scope="module", params=sorted(RUNS))
def forge_steps(request, forge_runs):
    return request.param, forge_runs(request.param)


def test_nano_trains_as_forge_does(forge_steps, monkeypatch):
    name, recorded = forge_steps
    settings = SETTINGS | RUNS[name]
    assert len(recorded["rollouts"]) * settings.get("num_iterations", 1) == settings["max_steps"]
    assert all(float(r.std()) > 0 for r in recorded["rewards"])  # every rollout carries a signal
    lengths = torch.cat([r.completion_mask.sum(dim=1) for r in recorded["rollouts"]])
    assert lengths.min() < lengths.max()  # completions of different lengths: the per-completion mean matters
    reading = nano_run(nano, RUNS[name], recorded, monkeypatch)
    assert all(torch.equal(reading["initial"][k], w) for k, w in recorded["initial"].items())  # same start
    assert disagreements(recorded, reading) == {}


MUTANTS = {  # one detail of nano changed -> (its text in forge/nano.py, the changed text, run, the check)
    "the sampler ignores the temperature": (
        "torch.softmax(logits.float() / temperature, dim=-1)", "torch.softmax(logits.float(), dim=-1)",
        "lora", "samples"),
    "each token drawn with its completion's first uniform": (
        "uniforms[:, t])  # (N,)", "uniforms[:, 0])  # (N,)", "lora", "samples"),
    "every rollout drawn from one seed": (
        'f"forge-sampling:{seed}:{steps_taken}"', 'f"forge-sampling:{seed}:0"', "lora", "samples"),
    "a linear decay instead of cosine": (
        "return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))", "return max(0.0, 1 - progress)",
        "lora", "learning rates"),
    "no warmup": ("if step < warmup:", "if False:", "lora", "learning rates"),
    "train takes max_steps rollouts, not max_steps // num_iterations": (
        "range(config.max_steps // config.num_iterations)", "range(config.max_steps)",
        "full, 2 updates per rollout", "rollouts"),
    "the KL term left out (kl_beta ignored)": (
        "per_token = per_token + kl_beta * kl", "per_token = per_token", "full", "losses"),
    "beta fixed at 0.01 whatever kl_beta says": (
        "per_token = per_token + kl_beta * kl", "per_token = per_token + 0.01 * kl", "full", "losses"),
    "the k1 KL estimator instead of k3": (
        "kl = torch.expm1(log_ref_ratio) - log_ref_ratio", "kl = -log_ref_ratio", "full", "losses"),
    "the KL's log-ratio the other way round": (
        "log_ref_ratio = ref_logprobs - logprobs", "log_ref_ratio = logprobs - ref_logprobs", "full",
        "losses"),
    "the LoRA reference with its adapters on": (
        "with model.disable_adapter():", "if True:", "lora", "losses"),
    "advantages not divided by the std": (
        "centred / (std + eps)", "centred", "lora, kl_beta=0", "gradients"),
    "advantages' eps 10x": ("centred / (std + eps)", "centred / (std + 10 * eps)", "lora, kl_beta=0",
                            "gradients"),
    "the std divided by G instead of G - 1": (
        "std = grouped.std(dim=1, keepdim=True)", "std = grouped.std(dim=1, keepdim=True, correction=0)",
        "lora, kl_beta=0", "gradients"),
    "advantages not centred on the group mean": (
        "centred = grouped - grouped.mean(dim=1, keepdim=True)", "centred = grouped", "lora, kl_beta=0",
        "gradients"),
    "a token mean (DAPO) instead of the per-completion mean": (
        "/ mask.sum(dim=1).clamp(min=1)  # (N,)", "/ mask.sum() * mask.shape[0]  # (N,)", "lora, kl_beta=0",
        "gradients"),
    "the loss summed over the completions, not averaged": (
        "loss = per_completion.sum() / per_completion.shape[0]", "loss = per_completion.sum()",
        "lora, kl_beta=0", "gradients"),
    "the log-probs without the temperature": (
        "log_softmax(logits.float() / temperature, dim=-1)", "log_softmax(logits.float(), dim=-1)",
        "lora, kl_beta=0", "gradients"),
    "the log-probs' logits shifted by one position": (
        "logits = logits[:, :-1]", "logits = logits[:, 1:]", "lora, kl_beta=0", "gradients"),
    "the clip range 1.5x": (
        "clamp(ratio, 1 - clip_eps, 1 + clip_eps)", "clamp(ratio, 1 - 1.5 * clip_eps, 1 + 1.5 * clip_eps)",
        "full, 2 updates per rollout", "gradients"),
    "no clip": ("torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)", "ratio", "full, 2 updates per rollout",
                "gradients"),
    "the optimistic (min) instead of the pessimistic (max) loss": (
        "torch.maximum(pg_loss1, pg_loss2)", "torch.minimum(pg_loss1, pg_loss2)",
        "full, 2 updates per rollout", "gradients"),
    "pi_old = stopgrad(pi_theta) on every update": (
        "old = logprobs.detach() if old_logprobs is None else old_logprobs", "old = logprobs.detach()",
        "full, 2 updates per rollout", "gradients"),
    "no gradient clipping": ('config.max_grad_norm or float("inf")', 'float("inf")', "full", "gradients"),
}


def edited_nano(old: str, new: str, folder: Path, monkeypatch) -> types.ModuleType:
    """A copy of forge/nano.py with the one occurrence of `old` replaced by `new`, imported as a module."""
    source = Path(nano.__file__).read_text()
    assert source.count(old) == 1, f"forge/nano.py no longer holds {old!r} once: update MUTANTS"
    path = folder / "nano_edited.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location("nano_edited", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_wrong_nano_fails_the_comparison(forge_runs, mutant, tmp_path, monkeypatch):
    old, new, run, check = MUTANTS[mutant]
    recorded = forge_runs(run)
    wrong_nano = edited_nano(old, new, tmp_path, monkeypatch)
    found = disagreements(recorded, nano_run(wrong_nano, RUNS[run], recorded, monkeypatch))
    assert check in found, f"{mutant}: the {check} check passes (found: {found})"


def test_nano_group_advantages_are_forges():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.7, 0.7, 0.7, 0.7, 3.0, -1.0, 2.0, 2.0])  # one group flat
    assert torch.equal(nano.group_advantages(rewards, 4), compute_group_advantages(rewards, 4))


def forge_samples(model, tokenizer, prompts: list[str], temperature: float, seed: int) -> nano.Samples:
    settings = SamplingSettings(max_new_tokens=12, temperature=temperature, do_sample=temperature > 0,
                                backend="eager")
    noise = sampling_noise(torch.Generator().manual_seed(sampling_seed(seed, 0)), len(prompts) * 3, 12)
    sampled = generate(model, tokenizer, prompts, 3, settings, noise=noise)
    return nano.Samples(*(getattr(sampled, name) for name in nano.Samples._fields))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_nano_samples_forges_tokens(temperature):
    """Prompts of different lengths (left padding), each prefilled once and copied to its group of 3, the same
    draws: nano's generator for (seed 5, step 0) and the trainer's noise of that step."""
    model, tokenizer = tiny_model()
    prompts = ["What is 12 + 7?", "Solve step by step. 3 times 4 is", "the answer"]
    recorded = forge_samples(model, tokenizer, prompts, temperature, seed=5)
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length=10**6)
    reading = nano.sample_groups(model, tokenizer, prompt_ids, prompt_mask, 3, 12, temperature,
                            nano.sampling_generator(5, 0))
    assert same_samples(reading, recorded)
    if temperature > 0:  # the draws matter: other draws, or the same draws at another temperature, differ
        for other in (forge_samples(model, tokenizer, prompts, temperature, seed=6),
                      forge_samples(model, tokenizer, prompts, 1.7 - temperature, seed=5)):
            assert not same_samples(reading, other)
