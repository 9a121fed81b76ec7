"""The loss pass makes its logits from the hidden states a chunk at a time: the same log-probs, entropies and
gradients as the model's whole logits, and memory that does not grow with the vocabulary."""

import sys

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from forge.core import logprobs
from forge.core.logprobs import completion_logprobs, logit_head, logprobs_from_hidden
from forge.model.lora import apply_lora
from forge.run import memory


def test_logprobs_from_hidden_equal_the_log_softmax_of_whole_logits_with_gradients():
    """Values, entropies and the gradients of hidden states and head, in fp32, for chunks of 1, 3 and all."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    weights = torch.randn(2, 5)  # an upstream gradient that differs per position

    def run(fn):
        hidden.grad, head.weight.grad = None, None
        values, entropy = fn()
        ((values * weights).sum() + entropy.sum()).backward()
        return values.detach(), entropy.detach(), hidden.grad.clone(), head.weight.grad.clone()

    # By hand: log p = z_target / temperature - logsumexp(z / temperature), over whole logits.
    def whole():
        logits = head(hidden) / 0.7  # (2, 5, 11)
        log_p = torch.log_softmax(logits, dim=-1)
        return log_p.gather(2, targets[..., None]).squeeze(2), -(log_p.exp() * log_p).sum(-1)

    expected = run(whole)
    for chunk in (1, 3, 100):
        got = run(lambda chunk=chunk: logprobs_from_hidden(hidden, head, targets, 0.7, chunk, with_entropy=True,
                                                           entropy_grad=True))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_chunk_keeps_no_logits_for_backward():
    """Under autograd, the saved tensors of the log-probs are the hidden states and targets, never (c, V) logits."""
    head = torch.nn.Linear(8, 1000, bias=False)
    hidden = torch.randn(1, 6, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        logprobs_from_hidden(hidden, head, torch.zeros(1, 6, dtype=torch.long), chunk_size=2).sum().backward()
    assert saved and all(1000 not in shape for shape in saved), saved


def batch(vocab: int, rows: int = 4, length: int = 6, prompt: int = 5):
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, vocab, (2, prompt), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0  # a left-padded prompt
    completion_ids = torch.randint(3, vocab, (rows, length), generator=generator)
    return prompt_ids, prompt_mask, completion_ids, torch.tensor([0, 0, 1, 1])[:rows]


@pytest.mark.parametrize("share", [True, False])
def test_completion_logprobs_equal_the_models_whole_logits(tiny_model, share):
    """The chunked path against the same function on the model's own (n, T, V) logits: values, entropies and the
    LoRA gradients, fp32."""
    model = apply_lora(tiny_model, r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)  # B != 0, so the adapters change the logits
    inputs = batch(model.config.vocab_size)
    head = logit_head(model)
    assert head is model.get_output_embeddings()
    results = []
    try:
        for chosen in (head, None):
            logprobs._HEADS[model] = chosen
            model.zero_grad(set_to_none=True)
            values, entropy = completion_logprobs(model, *inputs, temperature=0.9, chunk_size=5,
                                                  share_prompt_prefix=share, with_entropy=True)
            (values.sum() + 0.1 * (values * values).sum()).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            results.append((values.detach(), entropy.detach(), grads))
    finally:
        logprobs._HEADS.pop(model, None)
    (v1, e1, g1), (v2, e2, g2) = results
    torch.testing.assert_close(v1, v2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(e1, e2, rtol=1e-6, atol=1e-6)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_model_that_caps_its_logits_keeps_its_own_logits():
    """Gemma 2 soft-caps its logits after the head: the chunked path would drop that, so it is not taken."""
    config = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=1.0)
    torch.manual_seed(0)
    capped = Gemma2ForCausalLM(config).eval()
    assert logit_head(capped) is None
    prompt_ids, prompt_mask, completion_ids, index = batch(64)
    with torch.no_grad():
        got = completion_logprobs(capped, prompt_ids, prompt_mask, completion_ids, index, share_prompt_prefix=False)
        row = torch.cat([prompt_ids[0], completion_ids[0]])[None]
        expected = torch.log_softmax(capped(input_ids=row).logits[0, 4:-1], -1).gather(1, completion_ids[0, :, None])
    torch.testing.assert_close(got[0], expected[:, 0], rtol=1e-6, atol=1e-6)


def resident_peak_mb(fn) -> float:
    """What fn adds to the process's peak resident memory (Linux: VmHWM, restarted by memory.reset_peak)."""
    start = memory.reset_peak()
    fn()
    return memory.peak_mb() - start


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak resident memory from /proc")
def test_the_loss_pass_memory_does_not_grow_with_the_vocabulary():
    """Two random models that differ only in vocabulary (8,192 and 4x that): the loss pass over 8 x 128 tokens adds
    < 10% more peak memory with the bigger one. Whole fp32 logits would be 32 MB against 128 MB, twice over."""
    def loss_pass_mb(vocab: int) -> float:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        model = apply_lora(LlamaForCausalLM(config).eval(), r=4, alpha=8, target_modules=["q_proj", "v_proj"])
        prompt_ids, prompt_mask, completion_ids, index = batch(vocab, rows=8, length=128)
        index = torch.tensor([0] * 4 + [1] * 4)

        def run():
            values, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, index,
                                                  with_entropy=True)
            values.sum().backward()

        run()  # the first pass also makes the allocator's pools
        return min(resident_peak_mb(run) for _ in range(2))

    memory.return_freed_memory()  # as GRPOTrainer does
    small, large = loss_pass_mb(8192), loss_pass_mb(4 * 8192)
    assert large < 1.10 * small, (small, large)
