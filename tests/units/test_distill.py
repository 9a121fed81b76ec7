"""On-policy distillation: the per-token advantages and reverse KL from given teacher and student log-probs
(forge/core/distill.py), the full-vocabulary divergences by hand, the loss taking them, the metrics, and the
teacher in the trainer (core/teacher.py): a separate model, a LoRA adapter on the student's own base, tokenizers
that do not match, and distill_loss='full' against the models' whole logits."""

import json
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from forge import GRPOConfig, GRPOTrainer
from forge.core.distill import distillation_advantages, reverse_kl, reverse_kl_sums, token_divergence
from forge.core.grpo import LossSettings, grpo_loss
from forge.core.logprobs import TeacherStates, completion_logprobs, completion_states
from forge.core.teacher import TEACHER_ADAPTER, rollout_states
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer
from forge.run.step_stats import RolloutStats, distill_metrics, step_metrics

STUDENT = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])  # (B=2, T=2) log p_student of the sampled tokens
TEACHER = torch.tensor([[-0.5, -2.5], [-1.0, -3.0]])  # (B, T) log p_teacher of the same tokens
MASK = torch.tensor([[1, 1], [1, 0]])  # the second completion has one token
REWARD_ADVANTAGES = torch.tensor([1.0, -1.0])  # (B,)


def test_reverse_kl_is_student_minus_teacher():
    assert torch.equal(reverse_kl(STUDENT, TEACHER), torch.tensor([[-0.5, 0.5], [0.5, 0.0]]))


def test_advantages_by_hand():
    # A_t = 0.5 * A_group + 2 * (log p_teacher - log p_student), 0 off the mask
    # row 0: 0.5 + 2 * 0.5 = 1.5, 0.5 + 2 * -0.5 = -0.5;  row 1: -0.5 + 2 * -0.5 = -1.5, masked: 0
    advantages = distillation_advantages(REWARD_ADVANTAGES, STUDENT, TEACHER, MASK, distill_coef=2.0, reward_coef=0.5)
    assert torch.allclose(advantages, torch.tensor([[1.5, -0.5], [-1.5, 0.0]]))


def test_pure_distillation_and_pure_reward_are_the_two_ends():
    pure = distillation_advantages(REWARD_ADVANTAGES, STUDENT, TEACHER, MASK, distill_coef=1.0, reward_coef=0.0)
    assert torch.allclose(pure, torch.tensor([[0.5, -0.5], [-0.5, 0.0]]))
    reward_only = distillation_advantages(REWARD_ADVANTAGES, STUDENT, TEACHER, MASK, distill_coef=0.0)
    assert torch.allclose(reward_only, torch.tensor([[1.0, 1.0], [-1.0, 0.0]]))


def test_reverse_kl_sums_per_sequence_and_tokens():
    sums = reverse_kl_sums(STUDENT, TEACHER, MASK)
    assert torch.allclose(sums.per_sequence, torch.tensor([0.0, 0.5]))  # -0.5 + 0.5; 0.5 (one token)
    assert torch.equal(sums.tokens, torch.tensor([2.0, 1.0]))


def test_the_metrics_per_token_and_per_sequence():
    stats = RolloutStats()
    stats.distill_kl, stats.distill_tokens = [torch.tensor([0.0, 0.5]), torch.tensor([1.5, 0.0])], \
        [torch.tensor([2.0, 1.0]), torch.tensor([3.0, 0.0])]
    metrics = distill_metrics(stats)
    assert metrics["distill/reverse_kl"] == pytest.approx(2.0 / 6.0)  # (0 + 0.5 + 1.5) / (2 + 1 + 3) tokens
    assert metrics["distill/reverse_kl_sequence"] == pytest.approx(2.0 / 3.0)  # the three with tokens
    assert not any(key.startswith("distill/") for key in plain_step_metrics(RolloutStats()))


def plain_step_metrics(stats: RolloutStats) -> dict:
    """step_metrics of one rollout batch of two completions without a teacher (or tools)."""
    stats.scores, stats.valid = [torch.tensor([1.0, 0.0])], [torch.tensor([True, True])]
    stats.lengths, stats.truncated = [torch.tensor([2.0, 3.0])], [torch.tensor([0.0, 0.0])]
    update = dict.fromkeys(("loss", "kl", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
                            "ratio_mean", "grad_norm", "learning_rate"), 0.0)
    return step_metrics(stats, update, group_std=torch.tensor([0.5]), seconds=1.0, skipped_steps=0,
                        param_delta_norm=0.0)


def test_grpo_loss_takes_per_token_advantages():
    """With one update per rollout the ratio is 1: the per-completion-mean loss is mean_b mean_t(-A_bt), and a
    (B,) advantage broadcast over the tokens gives the same loss and gradient as that advantage per sequence."""
    logprobs = STUDENT.clone().requires_grad_(True)
    advantages = torch.tensor([[1.5, -0.5], [-1.5, 0.0]])
    loss, _ = grpo_loss(logprobs, None, None, advantages, MASK, settings=LossSettings())
    assert float(loss.detach()) == pytest.approx(((-1.5 + 0.5) / 2 + 1.5 / 1) / 2)  # per completion, then the mean
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-0.375, 0.125], [0.75, 0.0]]))  # -A / (2 * tokens)

    per_sequence, per_token = (STUDENT.clone().requires_grad_(True) for _ in range(2))
    a, _ = grpo_loss(per_sequence, None, None, REWARD_ADVANTAGES, MASK)
    b, _ = grpo_loss(per_token, None, None, REWARD_ADVANTAGES[:, None].expand(2, 5), MASK)  # wider than T
    a.backward()
    b.backward()
    assert float(a.detach()) == float(b.detach()) and torch.equal(per_sequence.grad, per_token.grad)


# ----------------------------------------------------------------------------------------------------
# distill_loss='full': GKD's divergences over the whole vocabulary, by hand

UNIFORM = torch.tensor([[0.0, 0.0]])  # student logits: p = (1/2, 1/2)
SKEWED = torch.tensor([[math.log(3.0), 0.0]])  # teacher logits: q = (3/4, 1/4)
REVERSE = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL(p || q) = 0.143841
FORWARD = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL(q || p) = 0.130812
# beta = 1/2: M = (5/8, 3/8); 1/2 KL(q || M) + 1/2 KL(p || M)
JSD_HALF = 0.5 * (0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)) \
    + 0.5 * (0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375))  # 0.033822


@pytest.mark.parametrize(("beta", "expected"), [(1.0, REVERSE), (0.0, FORWARD), (0.5, JSD_HALF)])
def test_the_divergences_by_hand(beta, expected):
    assert float(token_divergence(UNIFORM, SKEWED, beta)[0]) == pytest.approx(expected, abs=1e-6)
    assert float(token_divergence(SKEWED, SKEWED, beta)[0]) == pytest.approx(0.0, abs=1e-7)  # same model
    # the temperature divides both logits: at 2, q = (sqrt 3, 1) / (sqrt 3 + 1)
    q = (math.sqrt(3) / (math.sqrt(3) + 1), 1 / (math.sqrt(3) + 1))
    if beta == 1.0:
        hot = 0.5 * math.log(0.5 / q[0]) + 0.5 * math.log(0.5 / q[1])
        assert float(token_divergence(UNIFORM, SKEWED, beta, temperature=2.0)[0]) == pytest.approx(hot, abs=1e-6)


def test_the_reverse_kl_gradient_by_hand_and_none_into_the_teacher():
    """d KL(p || q) / d z_i = p_i (log(p_i / q_i) - KL(p || q)) for the student's logits z; the teacher's logits
    get no gradient."""
    student, teacher = UNIFORM.clone().requires_grad_(), SKEWED.clone().requires_grad_()
    token_divergence(student, teacher, 1.0).sum().backward()
    expected = [0.5 * (math.log(0.5 / 0.75) - REVERSE), 0.5 * (math.log(0.5 / 0.25) - REVERSE)]  # -/+ 0.274653
    assert student.grad[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert teacher.grad is None


# ----------------------------------------------------------------------------------------------------
# the teacher in the trainer (tiny models)

ROWS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


def alternating(prompts, completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def config(tmp_path, **overrides):
    values = {"group_size": 4, "max_new_tokens": 6, "gradient_accumulation_steps": 1, "prompts_per_step": 2,
              "learning_rate": 1e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1,
              "save_steps": 0, "max_steps": 2, "kl_beta": 0.0, "seed": 1, "preflight": "off",
              "output_dir": str(tmp_path / "run")}
    return GRPOConfig(**(values | overrides))


def logged(tmp_path) -> list[dict]:
    rows = [json.loads(line) for line in (tmp_path / "run" / "training_log.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def test_a_teacher_that_is_the_student_has_zero_reverse_kl_and_another_one_does_not(tmp_path):
    student, tokenizer = build_tiny_model(seed=0)
    twin, _ = build_tiny_model(tokenizer, seed=0)
    trainer = GRPOTrainer(student, tokenizer, alternating, config(tmp_path, max_steps=1), teacher_model=twin)
    trainer.train(ROWS)
    assert abs(logged(tmp_path)[0]["distill/reverse_kl"]) < 1e-4  # sampler vs scoring pass: fp32 rounding

    other, _ = build_tiny_model(tokenizer, seed=7)
    student, _ = build_tiny_model(tokenizer, seed=0)
    GRPOTrainer(student, tokenizer, alternating, config(tmp_path, overwrite_output_dir=True, reward_coef=0.0),
                teacher_model=other).train(ROWS)
    rows = logged(tmp_path)
    # a one-sample estimate per token: of either sign on near-uniform random models, but not 0
    assert len(rows) == 2 and all(abs(row["distill/reverse_kl"]) > 1e-3 for row in rows)
    for row in rows:  # every completion has max_new_tokens tokens here: per sequence = per token x length
        assert row["completions/min_length"] == row["completions/max_length"]
        assert row["distill/reverse_kl_sequence"] == pytest.approx(row["distill/reverse_kl"]
                                                                   * row["completions/mean_length"], rel=1e-4)
    assert all(row["distill/teacher_seconds"] > 0 for row in rows)


def test_the_per_token_advantages_reach_the_loss(tmp_path):
    """Pure distillation from a teacher that equals the student is no signal: the gradient is 0."""
    student, tokenizer = build_tiny_model(seed=0)
    twin, _ = build_tiny_model(tokenizer, seed=0)
    trainer = GRPOTrainer(student, tokenizer, alternating, config(tmp_path, reward_coef=0.0), teacher_model=twin)
    batch, _ = trainer.collect(ROWS[:2])
    assert all(a.shape == r.completion_ids.shape for a, r in zip(batch.advantages, batch.rollouts))
    assert all(float(a.abs().max()) < 1e-4 for a in batch.advantages)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)  # train() builds it
    update = trainer.update(batch)
    assert update["grad_norm"] < 1e-3


def save_tiny(folder, seed=0, tokenizer=None):
    model, tokenizer = build_tiny_model(tokenizer, seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_a_lora_adapter_on_the_students_base_is_its_second_adapter(tmp_path):
    base = save_tiny(tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    adapted.save_pretrained(tmp_path / "adapter")
    trainer = GRPOTrainer(base, None, alternating, config(tmp_path, use_lora=True, lora_r=4, max_steps=1,
                                                          reward_coef=0.0, teacher_model=str(tmp_path / "adapter")))
    assert trainer.teacher.model is trainer.model and trainer.teacher.adapter == TEACHER_ADAPTER  # one base
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and not any(TEACHER_ADAPTER in n for n in trainable)
    batch, _ = trainer.collect(ROWS[:2])
    # the teacher's log-probs are those of the base with the saved adapter, loaded on its own
    rollout = batch.rollouts[0]
    expected = trainer.rollout_logprobs(adapted.eval(), rollout)
    assert torch.allclose(trainer.teacher.logprobs(rollout, trainer.rollout_logprobs), expected, atol=1e-5)
    assert {n for n, p in trainer.model.named_parameters() if p.requires_grad} == trainable  # restored
    assert trainer.model.active_adapter == "default"
    trainer.train(ROWS)
    saved = sorted(p.name for p in (tmp_path / "run" / "final").iterdir())
    assert "adapter_model.safetensors" in saved and TEACHER_ADAPTER not in saved  # only the student's adapter


def test_a_teacher_with_another_tokenizer_is_refused_before_training(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["<other>"])
    teacher = save_tiny(tmp_path / "teacher", tokenizer=tokenizer)
    student, student_tokenizer = build_tiny_model(seed=0)
    with pytest.raises(ValueError, match="same tokenizer"):
        GRPOTrainer(student, student_tokenizer, alternating, config(tmp_path, teacher_model=teacher))


def test_the_config_checks_the_coefficients():
    with pytest.raises(ValueError, match="distill_coef"):
        GRPOConfig(teacher_model="x", distill_coef=-1.0).validate()
    with pytest.raises(ValueError, match="teacher_model"):
        GRPOConfig(teacher_model="x", fsdp=True).validate()


def test_the_distillation_math_imports_only_torch():
    import ast
    from pathlib import Path

    from forge.core import distill

    tree = ast.parse(Path(distill.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert imported <= {"__future__", "math", "typing", "torch"}


# ----------------------------------------------------------------------------------------------------
# distill_loss='full' in the loss pass and the trainer


def prompts_and_completions(vocab: int):
    generator = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(3, vocab, (2, 5), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0  # a left-padded prompt
    return prompt_ids, prompt_mask, torch.randint(3, vocab, (4, 6), generator=generator), torch.tensor([0, 0, 1, 1])


def whole_log_softmax(model, prompt_ids, prompt_mask, completion_ids, index) -> torch.Tensor:
    """(n, T, V) by the plain route: each completion after its prompt in one forward, whole logits."""
    ids = torch.cat([prompt_ids[index], completion_ids], dim=1)
    mask = torch.cat([prompt_mask[index], torch.ones_like(completion_ids)], dim=1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return torch.log_softmax(logits[:, prompt_ids.shape[1] - 1:-1].float(), dim=-1)


@pytest.mark.parametrize(("beta", "share"), [(1.0, True), (0.5, True), (1.0, False)])
def test_the_loss_pass_divergence_is_that_of_the_whole_distributions(beta, share):
    """completion_states + completion_logprobs(teacher=) against the two models' whole logits: the teacher's
    states make its logits, and the divergence and its gradient equal token_divergence on whole log-softmaxes."""
    student, tokenizer = build_tiny_model(seed=0)
    teacher, _ = build_tiny_model(tokenizer, seed=7)
    inputs = prompts_and_completions(student.config.vocab_size)
    with torch.no_grad():
        states = completion_states(teacher, *inputs)  # (4, 6, H)
        torch.testing.assert_close(torch.log_softmax(teacher.get_output_embeddings()(states), -1),
                                   whole_log_softmax(teacher, *inputs), rtol=1e-5, atol=1e-5)
    padded = torch.cat([states, torch.zeros(4, 3, states.shape[2])], dim=1)  # the teacher pass pads to the rollout
    view = TeacherStates(padded, teacher.get_output_embeddings(), beta)
    values, divergence = completion_logprobs(student, *inputs, chunk_size=5, share_prompt_prefix=share, teacher=view)
    divergence.sum().backward()
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    with torch.no_grad():
        teacher_log_p = whole_log_softmax(teacher, *inputs)
    student_log_p = whole_log_softmax(student, *inputs)
    expected = token_divergence(student_log_p.flatten(0, 1), teacher_log_p.flatten(0, 1), beta).view(4, 6)
    expected.sum().backward()
    torch.testing.assert_close(divergence.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(values.detach(), student_log_p.gather(2, inputs[2][..., None])[..., 0].detach(),
                               rtol=1e-5, atol=1e-6)
    for name, parameter in student.named_parameters():
        torch.testing.assert_close(got[name], parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_teacher_states_of_a_one_token_prompt():
    """A prompt of one token has nothing to run before its last token: its states are still the whole forward's."""
    teacher, _ = build_tiny_model(seed=7)
    prompt_ids, prompt_mask, completion_ids, index = prompts_and_completions(teacher.config.vocab_size)
    prompt_mask[1, :4] = 0  # the second prompt is its last token only
    with torch.no_grad():
        states = completion_states(teacher, prompt_ids, prompt_mask, completion_ids, index)
        torch.testing.assert_close(torch.log_softmax(teacher.get_output_embeddings()(states), -1),
                                   whole_log_softmax(teacher, prompt_ids, prompt_mask, completion_ids, index),
                                   rtol=1e-5, atol=1e-5)


def test_full_distillation_trains_on_the_divergence_and_logs_it(tmp_path):
    """reward_coef 0: the loss of a step is distill_coef x the mean divergence over its loss tokens (the policy
    term has zero advantages); a teacher equal to the student gives 0 and no gradient."""
    student, tokenizer = build_tiny_model(seed=0)
    other, _ = build_tiny_model(tokenizer, seed=7)
    GRPOTrainer(student, tokenizer, alternating, config(tmp_path, reward_coef=0.0, distill_loss="full",
                                                        distill_coef=2.0), teacher_model=other).train(ROWS)
    rows = logged(tmp_path)
    assert len(rows) == 2 and all(row["distill/divergence"] > 1e-3 for row in rows)
    for row in rows:
        assert row["loss"] == pytest.approx(2.0 * row["distill/divergence"], rel=1e-4)
        assert "distill/reverse_kl" not in row and row["distill/teacher_seconds"] > 0

    # two updates per rollout reuse the teacher's states: the loss is still the divergence
    student, _ = build_tiny_model(tokenizer, seed=0)
    GRPOTrainer(student, tokenizer, alternating, config(tmp_path / "twice", reward_coef=0.0, distill_loss="full",
                                                        num_iterations=2), teacher_model=other).train(ROWS)
    rows = [json.loads(line) for line in (tmp_path / "twice" / "run" / "training_log.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss" in row]
    assert rows and all(row["loss"] == pytest.approx(row["distill/divergence"], rel=1e-4) for row in rows)

    student, _ = build_tiny_model(tokenizer, seed=0)
    twin, _ = build_tiny_model(tokenizer, seed=0)
    trainer = GRPOTrainer(student, tokenizer, alternating, config(tmp_path / "twin", reward_coef=0.0,
                                                                  distill_loss="full"), teacher_model=twin)
    batch, _ = trainer.collect(ROWS[:2])
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    update = trainer.update(batch)
    assert abs(update["distill/divergence"]) < 1e-5 and update["grad_norm"] < 1e-3


def test_a_lora_adapter_teacher_of_a_full_fine_tune_loads_without_peft_deprecation_warnings(tmp_path):
    """A full fine-tune's teacher adapter is loaded on its own base (PeftModel.from_pretrained), without the
    FutureWarning of transformers' is_gradient_checkpointing that peft's wrapping prints."""
    import warnings

    base = save_tiny(tmp_path / "base")
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                             LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    adapted.save_pretrained(tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        trainer = GRPOTrainer(base, None, alternating, config(tmp_path, reward_coef=0.0,
                                                              teacher_model=str(tmp_path / "adapter")))
    assert trainer.teacher.adapter is None and trainer.teacher.model is not trainer.model


def test_full_distillation_from_a_lora_adapter_uses_the_adapter(tmp_path):
    """The teacher adapter is switched on for its states pass: the states equal those of the base with the
    saved adapter loaded on its own."""
    base = save_tiny(tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    adapted.save_pretrained(tmp_path / "adapter")
    trainer = GRPOTrainer(base, None, alternating, config(tmp_path, use_lora=True, lora_r=4, reward_coef=0.0,
                                                          distill_loss="full",
                                                          teacher_model=str(tmp_path / "adapter")))
    batch, _ = trainer.collect(ROWS[:2])
    rollout = batch.rollouts[0]
    expected = rollout_states(trainer, adapted.eval(), rollout)
    torch.testing.assert_close(batch.teacher_hidden[0], expected, rtol=1e-5, atol=1e-5)
    assert trainer.model.active_adapter == "default"
    trainer.train(ROWS)
    assert all(row["distill/divergence"] > 0 for row in logged(tmp_path))


def test_full_distillation_refuses_a_student_with_capped_logits_before_training(tmp_path):
    """Gemma 2 soft-caps its logits after the head, so 'full' cannot make them chunk by chunk: refused when the
    trainer is built, before any step's generation."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    teacher, tokenizer = build_tiny_model(seed=0)
    capped = Gemma2ForCausalLM(Gemma2Config(vocab_size=teacher.config.vocab_size, hidden_size=16,
                                            intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=8, final_logit_softcapping=1.0))
    with pytest.raises(ValueError, match="the student's logits .* Gemma2ForCausalLM scales or caps"):
        GRPOTrainer(capped, tokenizer, alternating, config(tmp_path, distill_loss="full"), teacher_model=teacher)
    GRPOTrainer(capped, tokenizer, alternating, config(tmp_path, distill_loss="sampled"), teacher_model=teacher)


def test_the_config_checks_the_distillation_loss():
    with pytest.raises(ValueError, match="distill_loss"):
        GRPOConfig(distill_loss="topk").validate()
    with pytest.raises(ValueError, match="distill_beta"):
        GRPOConfig(distill_beta=1.5).validate()


def test_one_completion_per_prompt_is_for_pure_distillation(tmp_path):
    """group_size=1 has no group baseline: refused for GRPO, allowed with a teacher and reward_coef 0, where the
    teacher's signal trains and the alarms about flat groups stay quiet (every group of one is flat)."""
    with pytest.raises(ValueError, match="group_size=1: GRPO needs >= 2"):
        GRPOConfig(group_size=1).validate()
    student, tokenizer = build_tiny_model(seed=0)
    with pytest.raises(ValueError, match="needs a teacher_model"):
        GRPOTrainer(student, tokenizer, alternating, config(tmp_path, group_size=1, reward_coef=0.0))
    other, _ = build_tiny_model(tokenizer, seed=7)
    trainer = GRPOTrainer(student, tokenizer, alternating,
                          config(tmp_path, group_size=1, prompts_per_step=4, reward_coef=0.0, distill_loss="full",
                                 max_steps=3, health_window=2), teacher_model=other)
    assert not trainer.rewards_teach
    trainer.train(ROWS * 3)
    rows = logged(tmp_path)
    assert len(rows) == 3 and all(row["frac_reward_zero_std"] == 1.0 for row in rows)
    assert all(row["loss"] == pytest.approx(row["distill/divergence"], rel=1e-4) and row["loss"] > 0 for row in rows)
    assert all(row["health/groups_flat"] == 0.0 and row["health/reward_stuck"] == 0.0 for row in rows)


def test_the_preflight_does_not_judge_flat_groups_in_pure_distillation():
    from forge.core.preflight import PreflightReport, judge

    def report():
        return PreflightReport(prompts=2, group_size=1, max_new_tokens=6, truncated=0.0, finished_lengths={},
                               rewards=[], flat_low=1.0, flat_high=0.0, tokens_per_second=1.0, step_seconds=1.0,
                               run_seconds=1.0, seconds=1.0, prompt_as_seen="p", memory=None)

    flat = report()
    judge(flat, string_prompts=False, chat_model=True)
    assert any("no group" in problem for problem in flat.problems)
    distilling = report()
    judge(distilling, string_prompts=False, chat_model=True, rewards_teach=False)
    assert not any("no group" in problem for problem in distilling.problems)
