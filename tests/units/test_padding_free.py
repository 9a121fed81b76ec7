"""The loss pass without padding (forge/core/logprobs.py PaddingFree): a prompt's completions end to end in
one row after its cache give the log-probs, entropies, teacher divergences and gradients of the padded rows,
and no position after a completion's length is computed."""

import pytest
import torch

from forge.core import logprobs
from forge.core.logprobs import (PaddingFree, TeacherStates, checkpointed_layers, completion_logprobs,
                                 takes_own_mask)
from forge.model.tiny import build_tiny_model

P, G, LP, T = 2, 4, 7, 20
LENGTHS = torch.tensor([20, 3, 5, 1, 2, 9, 4, 6])  # rows of 29 and 21 tokens instead of 4 x 20 each


def batch(seed: int = 0):
    """Two prompts (the second left-padded by 2) of 4 completions each, padded with 0 after their lengths."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(10, 200, (P, LP), generator=generator)
    prompt_mask = torch.ones(P, LP, dtype=torch.long)
    prompt_mask[1, :2] = 0
    completions = torch.randint(10, 200, (P * G, T), generator=generator)
    completions[torch.arange(T)[None] >= LENGTHS[:, None]] = 0
    return prompt_ids, prompt_mask, completions, torch.arange(P).repeat_interleave(G)


@pytest.fixture
def laid_out(monkeypatch):
    """Counts the calls that took the padding-free layout."""
    calls = []
    real = PaddingFree.inputs
    monkeypatch.setattr(PaddingFree, "inputs", lambda self, *a: calls.append(self) or real(self, *a))
    return calls


def test_the_layout_by_hand():
    # prompt 0: completions of 3 and 1 tokens; prompt 1: of 2 and 0 tokens
    layout = PaddingFree.of(torch.tensor([0, 0, 1, 1]), torch.tensor([3, 1, 2, 0]))
    assert layout.start.tolist() == [0, 3, 0, 2] and layout.width == 4
    completions = torch.tensor([[11, 12, 13], [21, 0, 0], [31, 32, 0], [0, 0, 0]])
    prompt_mask = torch.tensor([[1, 1], [0, 1]])  # prompt 1 has one real token
    tokens, positions, mask = layout.inputs(completions, prompt_mask)
    assert tokens.tolist() == [[11, 12, 13, 21], [31, 32, 0, 0]]
    assert positions.tolist() == [[2, 3, 4, 2], [1, 2, 1, 1]]  # each completion's tokens follow its prompt
    assert mask.shape == (2, 1, 4, 6)
    # row 0: the prompt's 2 columns, then completion 0 causal over columns 0-2, completion 1 (column 3) alone
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 0, 0, 0],
                                         [1, 1, 1, 1, 0, 0],
                                         [1, 1, 1, 1, 1, 0],
                                         [1, 1, 0, 0, 0, 1]]
    # row 1: prompt column 0 is padding; completion 2 over columns 0-1; columns 2-3 are empty: themselves only
    assert mask[1, 0].int().tolist() == [[0, 1, 1, 0, 0, 0],
                                         [0, 1, 1, 1, 0, 0],
                                         [0, 1, 0, 0, 1, 0],
                                         [0, 1, 0, 0, 0, 1]]
    # tokens t >= 1 are 12, 13 (completion 0) and 32 (completion 2), predicted by the column before each
    assert layout.of_targets(completions[:, 1:]).tolist() == [12, 13, 32]
    columns = torch.arange(8).view(2, 4)  # (u, S): a number per column
    assert layout.before_targets(columns).tolist() == [0, 1, 4]
    assert layout.spread(torch.tensor([1.0, 2.0, 3.0]), 2).tolist() == [[1, 2], [0, 0], [3, 0], [0, 0]]


def test_it_runs_only_where_it_computes_fewer_positions_and_no_more_attention():
    expand = torch.tensor([0, 0, 0, 0])
    assert PaddingFree.pays(expand, torch.tensor([20, 3, 5, 1]), (4, 20), prompt_length=100)  # 29 < 80
    assert not PaddingFree.pays(expand, torch.tensor([5, 5, 5, 5]), (4, 5), prompt_length=100)  # 20 = 20
    # 4 x 500 tokens of which 2,000 - 10 are real: fewer positions, but each attends over its whole row
    assert not PaddingFree.pays(expand, torch.tensor([500, 500, 500, 490]), (4, 500), prompt_length=10)
    assert not PaddingFree.pays(expand, torch.tensor([0, 0, 0, 0]), (4, 1), prompt_length=10)  # nothing


@pytest.mark.parametrize("with_entropy, checkpointing", [(False, False), (True, False), (False, True)])
def test_the_same_log_probs_and_gradients_as_the_padded_rows(laid_out, with_entropy, checkpointing):
    model, _ = build_tiny_model(seed=0)
    model.eval()
    prompt_ids, prompt_mask, completions, index = batch()
    real = torch.arange(T)[None] < LENGTHS[:, None]  # (n, T)

    def run(**lengths):
        model.zero_grad()
        with checkpointed_layers(model, checkpointing):  # layers recomputed in backward, the cache kept
            out = completion_logprobs(model, prompt_ids, prompt_mask, completions, index, 0.7,
                                      with_entropy=with_entropy, **lengths)
        out = out if isinstance(out, tuple) else (out,)
        (sum(o * real for o in out)).sum().backward()
        return [o.detach() for o in out], [p.grad.clone() for p in model.parameters() if p.grad is not None]

    padded, padded_grads = run()
    assert not laid_out
    free, free_grads = run(lengths=LENGTHS)
    assert len(laid_out) == 1
    for a, b in zip(free, padded, strict=True):
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)
        assert torch.equal(a[~real], torch.zeros_like(a[~real]))  # nothing computed after a completion ends
    for a, b in zip(free_grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_the_teachers_divergence_is_the_padded_rows(laid_out):
    model, _ = build_tiny_model(seed=0)
    teacher_model, _ = build_tiny_model(seed=1)
    prompt_ids, prompt_mask, completions, index = batch(seed=2)
    width = teacher_model.config.hidden_size
    hidden = torch.randn(P * G, T, width, generator=torch.Generator().manual_seed(3))  # (n, T, H)
    teacher = TeacherStates(hidden, teacher_model.get_output_embeddings(), beta=0.5)
    real = torch.arange(T)[None] < LENGTHS[:, None]
    with torch.no_grad():
        padded = completion_logprobs(model, prompt_ids, prompt_mask, completions, index, teacher=teacher)
        free = completion_logprobs(model, prompt_ids, prompt_mask, completions, index, teacher=teacher,
                                   lengths=LENGTHS)
    assert len(laid_out) == 1
    for a, b in zip(free, padded, strict=True):
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)


def test_a_model_whose_attention_builds_its_own_mask_keeps_the_padded_rows(laid_out):
    model, _ = build_tiny_model(seed=0)
    model.config._attn_implementation = "eager"  # eager attention adds a float mask: not given a bool one
    prompt_ids, prompt_mask, completions, index = batch()
    with torch.no_grad():
        completion_logprobs(model, prompt_ids, prompt_mask, completions, index, lengths=LENGTHS)
    assert not laid_out


def test_the_switch_turns_it_off(laid_out, monkeypatch):
    model, _ = build_tiny_model(seed=0)
    monkeypatch.setattr(logprobs, "PADDING_FREE", False)
    prompt_ids, prompt_mask, completions, index = batch()
    with torch.no_grad():
        completion_logprobs(model, prompt_ids, prompt_mask, completions, index, lengths=LENGTHS)
    assert not laid_out


def test_takes_own_mask_reads_the_attention_and_the_cache():
    model, _ = build_tiny_model(seed=0)
    prompt_ids, prompt_mask, _, _ = batch()
    with torch.no_grad():
        cache = model(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True).past_key_values
    assert takes_own_mask(model, cache)
    model.config._attn_implementation = "eager"
    assert not takes_own_mask(model, cache)


def test_a_training_step_runs_its_loss_pass_without_padding(laid_out, tmp_path):
    from forge import GRPOConfig, GRPOTrainer
    from forge.run.optim import make_scheduler

    model, tokenizer = build_tiny_model(seed=0)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(100, 140)]  # lengths 1..16
    config = GRPOConfig(use_lora=True, group_size=4, prompts_per_step=2, gradient_accumulation_steps=1,
                        max_new_tokens=16, dtype="float32", output_dir=str(tmp_path), seed=3)
    def length(prompts, completions, **kwargs):
        return [float(len(text)) for text in completions]

    trainer = GRPOTrainer(model, tokenizer, length, config)
    trainer.scheduler = make_scheduler(trainer.optimizer, config.lr_scheduler, config.warmup_ratio, 1)
    rows = [{"prompt": "What is 2 + 3?"}, {"prompt": "What is 4 + 1?"}]
    batch, _ = trainer.collect(rows)
    lengths = batch.rollouts[0].completion_lengths
    assert lengths.min() < lengths.max()
    trainer.update(batch)
    assert laid_out  # the loss pass laid the groups' completions end to end
